"""HF safetensors checkpoint -> FTW store, streamed expert by expert.

The store is written into ``<out_dir>.tmp-<pid>`` and renamed into place at the end; on any error the
temporary directory is removed, so ``out_dir`` is either absent, untouched, or complete.
"""
from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import ftjax
from ftjax.ftw import store
from ftjax.ftw.manifest import (BANKS, DEFAULT_CHECKSUM, FORMAT, VERSION, StoreError, checksum,
                                write_manifest)

log = logging.getLogger(__name__)

DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
                 "f32": "float32", None: None}
WRITES_IN_FLIGHT = 8  # bounded, so memory stays a few experts however large the model


class ConvertError(StoreError):
    """The source checkpoint does not match what the model config says it should hold."""


def convert(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None = "bf16", *,
            progress: bool = True, overwrite: bool = False) -> Path:
    """Convert the HF checkpoint at ``hf_dir`` into an FTW store at ``out_dir``; returns ``out_dir``.

    ``dtype``: "bf16" | "fp32" | None (keep each tensor's source dtype). Refuses a non-empty
    ``out_dir`` unless ``overwrite``.
    """
    from ftjax.ftw.hf import HFCheckpoint

    _check_target(dtype, out_dir, overwrite)
    return write_store(HFCheckpoint(hf_dir), out_dir, dtype, progress=progress, overwrite=overwrite,
                       hf_dir=hf_dir)


def _check_target(dtype: str | None, out_dir: str | os.PathLike, overwrite: bool) -> None:
    if dtype not in DTYPE_ALIASES:
        raise ValueError(f"dtype {dtype!r} unknown; valid: 'bf16', 'fp32' or None (keep the source dtype)")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True to replace it")


def write_store(ckpt, out_dir: str | os.PathLike, dtype: str | None = "bf16", *, progress: bool = True,
                overwrite: bool = False, hf_dir: str | os.PathLike | None = None) -> Path:
    """Write any object with the HFCheckpoint interface (config, dense_tensors, expert,
    tokenizer_files, source) as an FTW store, atomically. ``hf_dir``: where config.json lives."""
    _check_target(dtype, out_dir, overwrite)
    target, out = DTYPE_ALIASES[dtype], Path(out_dir)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("converting %s -> %s (dtype %s)", hf_dir or type(ckpt).__name__, out, target or "as source")
    try:
        tmp.mkdir(parents=True)
        manifest = _write_store(ckpt, None if hf_dir is None else Path(hf_dir), tmp, target, progress)
        write_manifest(tmp, manifest)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s", out)
    return out


def _replace(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; a previous ``out`` is moved aside first and removed afterwards."""
    old = None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    elif out.is_dir():
        out.rmdir()
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def _write_store(ckpt, hf_dir: Path | None, root: Path, target: str | None, progress: bool) -> dict[str, Any]:
    from ftjax.models.params import expert_bank_shapes, param_shapes

    cfg = ckpt.config
    shapes, bank_shapes = param_shapes(cfg), expert_bank_shapes(cfg)
    store.write_group(root, {"ftw_version": VERSION})
    store.write_group(root / "params")
    store.write_group(root / "experts")
    n_flat = cfg.num_layers * cfg.num_experts
    with tqdm(total=len(shapes) + n_flat, desc="convert", unit="tensor", disable=not progress,
              dynamic_ncols=True) as bar:
        tensors = _write_dense(ckpt, root, shapes, target, bar)
        experts = _write_banks(ckpt, cfg, root, bank_shapes, target, bar)
    return {
        "format": FORMAT,
        "version": VERSION,
        "ftjax_version": ftjax.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": cfg.to_dict(),
        "checksum_algorithm": DEFAULT_CHECKSUM,
        "experts": experts,
        "tensors": tensors,
        "files": _copy_hf_files(ckpt, hf_dir, root),
        "source": _source(ckpt, hf_dir),
    }


def _cast(x: np.ndarray, target: str | None) -> np.ndarray:
    x = np.asarray(x)
    if target is not None and x.dtype != store.np_dtype(target):
        x = x.astype(store.np_dtype(target))
    store.dtype_name(x.dtype)  # rejects dtypes a store cannot hold
    return np.ascontiguousarray(x)


def _write_dense(ckpt, root: Path, shapes: dict, target: str | None, bar) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for name, x in ckpt.dense_tensors():
        if name not in shapes:
            raise ConvertError(f"checkpoint tensor {name!r} is not a parameter of this model config")
        if name in tensors:
            raise ConvertError(f"checkpoint yields tensor {name!r} twice")
        if tuple(x.shape) != tuple(shapes[name]):
            raise ConvertError(f"tensor {name!r} has shape {list(x.shape)}, the config expects {list(shapes[name])}")
        x = _cast(x, target)
        rel = f"params/{name}"
        arr = store.create_array(root, rel, x.shape, store.dtype_name(x.dtype),
                                 store.dense_chunk_shape(x.shape, x.dtype.itemsize))
        arr.write(x).result()
        tensors[name] = {"path": rel, "shape": list(x.shape), "dtype": store.dtype_name(x.dtype),
                         "checksum": checksum(x)}
        bar.update(1)
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise ConvertError(f"checkpoint lacks {len(missing)} tensors the config needs, e.g. {missing[:8]}")
    return tensors


def _write_banks(ckpt, cfg, root: Path, bank_shapes: dict, target: str | None, bar) -> dict[str, Any]:
    """Write expert by expert; each (bank, flat id) is one chunk with its own checksum."""
    arrays: dict[str, Any] = {}
    sums: dict[str, list[str]] = {b: [] for b in BANKS}
    pending: collections.deque = collections.deque()
    dtype = target
    for layer in range(cfg.num_layers):
        for e in range(cfg.num_experts):
            flat_id = layer * cfg.num_experts + e
            weights = ckpt.expert(layer, e)
            if dtype is None:  # keep-source: the first expert fixes the bank dtype
                dtype = store.dtype_name(np.asarray(weights["gate_up"]).dtype)
            if not arrays:
                arrays = {b: store.create_array(root, f"experts/{b}", bank_shapes[b], dtype,
                                                [1, *bank_shapes[b][1:]]) for b in BANKS}
            for b in BANKS:
                x = _cast(weights[b], dtype)
                if tuple(x.shape) != tuple(bank_shapes[b][1:]):
                    raise ConvertError(f"expert {b!r} of layer {layer}, expert {e} has shape {list(x.shape)}; "
                                       f"the config expects {list(bank_shapes[b][1:])}")
                sums[b].append(checksum(x))
                pending.append(arrays[b][flat_id].write(x))
            while len(pending) > WRITES_IN_FLIGHT:
                pending.popleft().result()
            bar.update(1)
    while pending:
        pending.popleft().result()
    banks = {b: {"path": f"experts/{b}", "shape": list(bank_shapes[b]), "dtype": dtype,
                 "chunk_shape": [1, *bank_shapes[b][1:]], "checksums": sums[b]} for b in BANKS}
    return {"quant": "none", "dtype": dtype, "banks": banks}


def _copy_hf_files(ckpt, hf_dir: Path | None, root: Path) -> list[str]:
    """config.json and the tokenizer files, so the store is self-contained."""
    dst = root / "hf"
    dst.mkdir()
    copied = []
    sources = [] if hf_dir is None else [hf_dir / "config.json"]
    for src in [*sources, *map(Path, getattr(ckpt, "tokenizer_files", ()))]:
        if src.is_file() and not (dst / src.name).exists():
            shutil.copy2(src, dst / src.name)
            copied.append(f"hf/{src.name}")
    return copied


def _source(ckpt, hf_dir: Path | None) -> dict[str, Any]:
    src = dict(getattr(ckpt, "source", None) or {})  # the reader's extra facts, under our keys
    src["model_type"] = ckpt.config.model_type
    if hf_dir is not None:
        files = sorted(p for p in hf_dir.iterdir()
                       if p.suffix == ".safetensors" or p.name.endswith(".index.json"))
        src.update({"dir": str(hf_dir.resolve()),
                    "files": [{"name": p.name, "bytes": p.stat().st_size} for p in files]})
    return json.loads(json.dumps(src, default=str))  # Paths etc. become strings
