"""The embedded demo model: built once into the user cache, then reused.

``ensure_demo_model`` writes a small synthetic ``qwen3_5_moe`` checkpoint in HF format
(``ftjax.demo_checkpoint``) and converts it to an FTW store with ``ftjax.ftw.convert``. Everything is
built in a temporary directory and renamed into place, so the cache holds either nothing or a
complete model; a store that fails verification (or was built from a different spec) is rebuilt.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

from ftjax.demo_checkpoint import DemoSpec, write_hf_checkpoint

log = logging.getLogger(__name__)

STORE_NAME = "demo-ftw"
HF_NAME = "demo-hf"
STAMP_NAME = "demo.json"  # inside the FTW store: which spec and ftjax built it
DEMO_FORMAT = 1  # bump when the demo checkpoint changes in a way a cached one should be rebuilt for

__all__ = ["DemoSpec", "default_cache_dir", "ensure_demo_model"]


def default_cache_dir() -> Path:
    """``$FTJAX_CACHE``, else ``$XDG_CACHE_HOME/ftjax``, else ``~/.cache/ftjax``."""
    if os.environ.get("FTJAX_CACHE"):
        return Path(os.environ["FTJAX_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "ftjax"


def _stamp(spec: DemoSpec) -> dict:
    return {"demo_format": DEMO_FORMAT, "spec": spec.to_dict()}


def _is_valid(store: Path, spec: DemoSpec) -> bool:
    """The stamp matches and every checksum of the store verifies."""
    from ftjax.ftw import StoreError, verify_store

    stamp = store / STAMP_NAME
    if not stamp.is_file():
        return False
    try:
        if json.loads(stamp.read_text()) != _stamp(spec):
            log.info("%s was built from another demo spec; rebuilding", store)
            return False
        verify_store(store)
    except (StoreError, ValueError, OSError) as e:
        log.warning("cached demo model %s is damaged (%s); rebuilding", store, str(e).splitlines()[0])
        return False
    return True


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """One builder at a time per cache directory (a second process waits, then reuses)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".demo.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _replace_dir(src: Path, dst: Path) -> None:
    if dst.exists():
        trash = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.rename(dst, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(src, dst)


def _build(cache: Path, spec: DemoSpec, progress: bool) -> Path:
    from ftjax.ftw import convert

    tmp = cache / f".demo-build-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        tmp.mkdir(parents=True)
        if progress:
            print(f"ftjax: building the demo model in {cache} (once; a few seconds to a minute)", file=sys.stderr)
        write_hf_checkpoint(tmp / HF_NAME, spec, progress=progress)
        convert(tmp / HF_NAME, tmp / STORE_NAME, dtype="bf16", progress=progress)
        (tmp / STORE_NAME / STAMP_NAME).write_text(json.dumps(_stamp(spec), indent=1) + "\n")
        _replace_dir(tmp / HF_NAME, cache / HF_NAME)
        _replace_dir(tmp / STORE_NAME, cache / STORE_NAME)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        print(f"ftjax: demo model ready in {time.perf_counter() - t0:.1f}s: {cache / STORE_NAME}", file=sys.stderr)
    return cache / STORE_NAME


def ensure_demo_model(cache_dir: str | os.PathLike | None = None, force: bool = False, *,
                      spec: DemoSpec | None = None, progress: bool = True) -> Path:
    """Path of the demo FTW store under ``cache_dir`` (default: :func:`default_cache_dir`),
    building it first if it is missing, damaged, built from another spec, or ``force``.

    The HF checkpoint it was converted from is kept beside it (``demo-hf/``).
    """
    spec = spec or DemoSpec()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    store = cache / STORE_NAME
    with _locked(cache):
        if not force and _is_valid(store, spec):
            log.info("reusing the demo model %s", store)
            return store
        return _build(cache, spec, progress)
