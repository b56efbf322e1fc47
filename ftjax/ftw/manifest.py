"""The FTW manifest (``ftw.json``): what a store holds, and how to check it.

The manifest names every array of the store with its shape, dtype and checksum (one per expert
chunk for the banks, so a corrupt expert is named), the model config, the expert quantisation
format and where the weights came from. ``read_manifest`` rejects anything this version cannot
read; ``check_against_config`` compares it with the shapes the model code expects.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Mapping

import numpy as np

log = logging.getLogger(__name__)

FORMAT = "ftw"
VERSION = 1
MANIFEST_NAME = "ftw.json"
BANKS = ("gate_up", "down")
EXPERT_QUANTS = ("none",)  # int4 banks come later
DTYPES = ("float32", "bfloat16", "float16")

try:  # xxh3 is ~10x faster than blake2b; either is fine, the manifest records which one it used
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

DEFAULT_CHECKSUM = "xxh3_64" if xxhash is not None else "blake2b_128"
CHECKSUMS = ("xxh3_64", "blake2b_128")


class StoreError(Exception):
    """An FTW store that cannot be written or read as it is: the message names the file, the
    tensor and, for expert chunks, the flat expert id."""


def checksum(data, algorithm: str = DEFAULT_CHECKSUM) -> str:
    """Hex checksum of a C-contiguous array's bytes (or any bytes-like object)."""
    if isinstance(data, np.ndarray):  # bytes of any dtype, bfloat16 included
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    view = memoryview(data)
    if algorithm == "xxh3_64":
        if xxhash is None:
            raise StoreError("this store uses checksum 'xxh3_64' but the xxhash package is not installed")
        return xxhash.xxh3_64_hexdigest(view)
    if algorithm == "blake2b_128":
        return hashlib.blake2b(view, digest_size=16).hexdigest()
    raise StoreError(f"unknown checksum algorithm {algorithm!r}; known: {list(CHECKSUMS)}")


def write_manifest(root: Path, manifest: Mapping[str, Any]) -> Path:
    path = Path(root) / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    return path


def read_manifest(root: str | Path) -> dict[str, Any]:
    """Read and structurally validate ``<root>/ftw.json``; StoreError names what is wrong."""
    path = Path(root) / MANIFEST_NAME
    if not Path(root).is_dir():
        raise StoreError(f"{root}: not a directory (expected an FTW store)")
    if not path.is_file():
        raise StoreError(f"{path}: manifest missing; {root} is not an FTW store (run `ftjax convert`)")
    try:
        man = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"{path}: manifest is not valid JSON ({e})") from e
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        got = man.get("format") if isinstance(man, dict) else type(man).__name__
        raise StoreError(f"{path}: format {got!r} is not {FORMAT!r}")
    if man.get("version") != VERSION:
        raise StoreError(
            f"{path}: unknown FTW format version {man.get('version')!r}; this ftjax reads version {VERSION}"
        )
    for key in ("config", "tensors", "experts", "checksum_algorithm"):
        if key not in man:
            raise StoreError(f"{path}: manifest lacks the required field {key!r}")
    if man["checksum_algorithm"] not in CHECKSUMS:
        raise StoreError(f"{path}: unknown checksum_algorithm {man['checksum_algorithm']!r}; known: {list(CHECKSUMS)}")
    _check_entries(path, man)
    return man


def _check_entries(path: Path, man: dict[str, Any]) -> None:
    experts = man["experts"]
    if experts.get("quant") not in EXPERT_QUANTS:
        raise StoreError(f"{path}: expert quant format {experts.get('quant')!r} unknown; known: {list(EXPERT_QUANTS)}")
    banks = experts.get("banks", {})
    if sorted(banks) != sorted(BANKS):
        raise StoreError(f"{path}: expert banks {sorted(banks)} in the manifest, expected {sorted(BANKS)}")
    entries = [(f"tensor {n!r}", e) for n, e in man["tensors"].items()]
    entries += [(f"expert bank {n!r}", e) for n, e in banks.items()]
    for what, e in entries:
        for key in ("path", "shape", "dtype"):
            if key not in e:
                raise StoreError(f"{path}: {what} lacks field {key!r}")
        if e["dtype"] not in DTYPES:
            raise StoreError(f"{path}: {what} has dtype {e['dtype']!r}; valid: {list(DTYPES)}")
    for name, bank in banks.items():
        n_chunks = bank["shape"][0]
        if len(bank.get("checksums", ())) != n_chunks:
            raise StoreError(
                f"{path}: expert bank {name!r} lists {len(bank.get('checksums', ()))} chunk checksums "
                f"for {n_chunks} experts"
            )


def check_against_config(
    man: Mapping[str, Any],
    param_shapes: Mapping[str, tuple[int, ...]],
    bank_shapes: Mapping[str, tuple[int, ...]],
    where: str | Path,
) -> None:
    """The manifest must list exactly the tensors the model expects, with the expected shapes."""
    listed, expected = set(man["tensors"]), set(param_shapes)
    if listed != expected:
        missing, extra = sorted(expected - listed), sorted(listed - expected)
        raise StoreError(
            f"{where}: manifest tensors disagree with the model config: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {extra[:8]}{'...' if len(extra) > 8 else ''}"
        )
    for name, shape in param_shapes.items():
        got = tuple(man["tensors"][name]["shape"])
        if got != tuple(shape):
            raise StoreError(
                f"{where}: tensor {name!r} has shape {list(got)} in the manifest but the model config "
                f"gives {list(shape)}"
            )
    banks = man["experts"]["banks"]
    for name, shape in bank_shapes.items():
        got = tuple(banks[name]["shape"])
        if got != tuple(shape):
            raise StoreError(
                f"{where}: expert bank {name!r} has shape {list(got)} in the manifest but the model "
                f"config gives {list(shape)}"
            )
        if banks[name]["dtype"] != man["experts"].get("dtype", banks[name]["dtype"]):
            raise StoreError(
                f"{where}: expert bank {name!r} dtype {banks[name]['dtype']!r} differs from the "
                f"expert dtype {man['experts']['dtype']!r}"
            )
