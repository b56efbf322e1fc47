"""Load an FTW store: non-expert weights to the device, expert banks into aligned host buffers.

Every structural problem (missing manifest or array, unknown version, shapes/dtypes that disagree
between the config, the manifest and the arrays, missing or truncated chunk files) raises
``StoreError`` before any data is read. Checksums: always for the non-expert tensors when
``verify`` is true; for the banks with ``verify="full"`` or ``verify_store``.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ftjax.config import ModelConfig
from ftjax.ftw import store
from ftjax.ftw.convert import DTYPE_ALIASES
from ftjax.ftw.manifest import BANKS, StoreError, check_against_config, checksum, read_manifest

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict[str, Any]  # nested (ftjax.models.params.unflatten), on the device when device=True
    experts: dict[str, np.ndarray]  # {"gate_up": [L*E, 2I, H], "down": [L*E, H, I]}: the host pool
    manifest: dict[str, Any]
    path: Path


def default_threads() -> int:
    return max(2, min(16, os.cpu_count() or 2))


def open_store(path: str | os.PathLike) -> tuple[Path, dict[str, Any], ModelConfig]:
    """Read the manifest, parse its config and check the tensor list against the model's shapes."""
    from ftjax.models.params import expert_bank_shapes, param_shapes

    root = Path(path)
    man = read_manifest(root)
    where = root / "ftw.json"
    try:
        cfg = ModelConfig.from_dict(man["config"])
    except Exception as e:
        raise StoreError(f"{where}: the model config in the manifest is invalid: {e}") from e
    check_against_config(man, param_shapes(cfg), expert_bank_shapes(cfg), where)
    return root, man, cfg


def _check_arrays(root: Path, man: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Open every array, compare it with the manifest and size-check its chunk files."""
    arrays = {}
    for name, entry in man["tensors"].items():
        what = f"tensor {name!r}"
        arrays[name] = store.open_array(root, entry["path"], what)
        store.check_array(arrays[name], entry, root / entry["path"], what)
        store.check_chunk_files(root, entry["path"], store.array_meta(root, entry["path"]), what)
    for bank, entry in man["experts"]["banks"].items():
        what = f"expert bank {bank!r}"
        arr = store.open_array(root, entry["path"], what)
        store.check_array(arr, entry, root / entry["path"], what)
        store.check_chunk_files(root, entry["path"], store.array_meta(root, entry["path"]), what,
                                num_experts=cfg.num_experts, bank=True)
    return arrays


def _read_tensor(root: Path, arr, entry: dict[str, Any], name: str, algorithm: str | None) -> np.ndarray:
    try:
        x = arr.read().result()
    except Exception as e:
        raise StoreError(f"{root / entry['path']}: reading tensor {name!r} failed: {e}") from e
    if algorithm is not None and checksum(x, algorithm) != entry["checksum"]:
        raise StoreError(f"{root / entry['path']}: checksum mismatch in tensor {name!r} (corrupt chunk)")
    return x


def _read_dense(root: Path, man: dict[str, Any], arrays: dict[str, Any], verify: bool, threads: int):
    """Yield (name, array) with a bounded number of reads (and checksums) in flight."""
    algorithm = man["checksum_algorithm"] if verify else None
    with ThreadPoolExecutor(threads, thread_name_prefix="ftw-dense") as pool:
        pending: collections.deque = collections.deque()
        for name, entry in man["tensors"].items():
            pending.append((name, pool.submit(_read_tensor, root, arrays[name], entry, name, algorithm)))
            if len(pending) > 2 * threads:
                name0, fut = pending.popleft()
                yield name0, fut.result()
        while pending:
            name0, fut = pending.popleft()
            yield name0, fut.result()


def _device_put(x: np.ndarray):
    import jax  # imported here so converting and verifying never start a JAX backend

    return jax.device_put(x)


def load_store(path: str | os.PathLike, device: bool = True, dtype=None, *, verify: bool | str = True,
               threads: int | None = None, reader: str = "auto", bank_allocator=None) -> LoadedModel:
    """Load the store at ``path``.

    device: put the non-expert params on JAX's default device (else keep numpy arrays).
    dtype: cast the non-expert params ("bf16", "fp32" or a numpy/jax dtype); the banks keep the
        stored dtype: they are the host pool, laid out at convert time.
    verify: True = checksum the non-expert tensors and size-check bank chunks; "full" = also
        checksum every expert chunk; False = structural checks only.
    reader: bank reader, "auto" | "odirect" | "buffered" | "tensorstore" (see store.read_bank).
    bank_allocator: ``alloc(bank, shape, dtype) -> writable C-contiguous array`` the banks are read
        into (``ftjax.host.HostPool.allocator()`` puts them in the C++ host pool); default
        ``store.alloc_aligned``.
    """
    from ftjax.models.params import unflatten

    if verify not in (True, False, "full"):
        raise ValueError(f"verify={verify!r}; valid: True, False, 'full'")
    threads = threads or default_threads()
    if dtype is not None:
        dtype = store.np_dtype(DTYPE_ALIASES[dtype]) if dtype in DTYPE_ALIASES else np.dtype(dtype)
    t0 = time.perf_counter()
    root, man, cfg = open_store(path)
    arrays = _check_arrays(root, man, cfg)
    put = _device_put if device else (lambda x: x)
    flat = {}
    for name, x in _read_dense(root, man, arrays, bool(verify), threads):
        flat[name] = put(x if dtype is None else x.astype(dtype))
    t1 = time.perf_counter()
    experts = read_banks(root, man, cfg, threads=threads, verify=verify == "full", reader=reader,
                         bank_allocator=bank_allocator)
    t2 = time.perf_counter()
    nbytes = sum(b.nbytes for b in experts.values())
    log.info("loaded %s: params %.2fs, experts %.2f GiB in %.2fs (%.2f GB/s)", root, t1 - t0,
             nbytes / 2**30, t2 - t1, nbytes / max(t2 - t1, 1e-9) / 1e9)
    return LoadedModel(config=cfg, params=unflatten(flat), experts=experts, manifest=man, path=root)


def read_banks(root: Path, man: dict[str, Any], cfg: ModelConfig, *, threads: int, verify: bool = False,
               reader: str = "auto", bank_allocator=None) -> dict[str, np.ndarray]:
    """Allocate each bank once (2 MiB aligned) and fill it in parallel straight from the chunk files."""
    experts = {}
    for bank in BANKS:
        entry = man["experts"]["banks"][bank]
        if bank_allocator is None:
            out = store.alloc_aligned(entry["shape"], store.np_dtype(entry["dtype"]))
        else:
            out = bank_allocator(bank, tuple(entry["shape"]), store.np_dtype(entry["dtype"]))
        store.read_bank(root, entry["path"], out, what=f"expert bank {bank!r}", threads=threads,
                        checksums=entry["checksums"] if verify else None,
                        algorithm=man["checksum_algorithm"], num_experts=cfg.num_experts, reader=reader)
        experts[bank] = out
    return experts


def verify_store(path: str | os.PathLike, threads: int | None = None) -> dict[str, Any]:
    """Full check: structure, then the checksum of every tensor and every expert chunk.

    Raises StoreError listing every corrupt tensor / expert chunk found; returns a summary otherwise.
    """
    threads = threads or default_threads()
    t0 = time.perf_counter()
    root, man, cfg = open_store(path)
    arrays = _check_arrays(root, man, cfg)
    algorithm = man["checksum_algorithm"]
    problems: list[str] = []
    nbytes = 0
    for name, entry in man["tensors"].items():
        try:
            nbytes += _read_tensor(root, arrays[name], entry, name, algorithm).nbytes
        except StoreError as e:
            problems.append(str(e))
    for bank in BANKS:
        entry = man["experts"]["banks"][bank]
        problems += store.verify_bank(root, entry["path"], entry["checksums"], algorithm,
                                      what=f"expert bank {bank!r}", threads=threads,
                                      num_experts=cfg.num_experts)
        nbytes += int(np.prod(entry["shape"])) * store.np_dtype(entry["dtype"]).itemsize
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise StoreError(f"{root}: {len(problems)} corrupt tensors/chunks:\n  {shown}{more}")
    seconds = time.perf_counter() - t0
    log.info("verified %s: %.2f GiB in %.2fs", root, nbytes / 2**30, seconds)
    return {"path": str(root), "tensors": len(man["tensors"]), "experts": cfg.num_layers * cfg.num_experts,
            "bytes": nbytes, "seconds": seconds}
