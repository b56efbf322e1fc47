"""Zarr v3 arrays of an FTW store (through tensorstore) and the expert-bank reader.

Layout under the store root::

    ftw.json                   manifest (manifest.py)
    zarr.json                  root group
    params/<name>/             one zarr array per non-expert tensor (chunked along dim 0)
    experts/{gate_up,down}/    one zarr array per bank, one uncompressed chunk per flat expert id
    hf/                        config.json and tokenizer files of the source checkpoint

Bank chunks use only the ``bytes`` codec (little endian), so each chunk file is exactly the bytes of
one expert in the host-pool layout. ``read_bank`` therefore reads the files straight into the final
host buffer with ``readinto`` (one kernel copy, no intermediate array). Reading through tensorstore
(``ts.array(buf, copy=False).write(bank)``) is also correct but stages each chunk in its own buffer
and copies it: measured here ~2x slower hot-cache and ~300 MiB of extra peak memory for 1 GiB, so it
is kept only as the fallback for layouts that are not plain.
"""
from __future__ import annotations

import json
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import ml_dtypes
import numpy as np
import tensorstore as ts

from ftjax.ftw.manifest import StoreError, checksum

log = logging.getLogger(__name__)

ALIGN_BYTES = 2 << 20  # host pool buffers start on a 2 MiB (huge page) boundary
DENSE_CHUNK_BYTES = 64 << 20
_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
              "float16": np.dtype(np.float16)}
_BYTES_CODEC = [{"name": "bytes", "configuration": {"endian": "little"}}]


def np_dtype(name: str) -> np.dtype:
    if name not in _NP_DTYPES:
        raise StoreError(f"dtype {name!r} is not supported in FTW stores; valid: {sorted(_NP_DTYPES)}")
    return _NP_DTYPES[name]


def dtype_name(dtype) -> str:
    name = np.dtype(dtype).name
    np_dtype(name)  # validates
    return name


def write_group(path: Path, attributes: dict[str, Any] | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    meta = {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}
    (path / "zarr.json").write_text(json.dumps(meta, indent=1) + "\n")


def dense_chunk_shape(shape: Sequence[int], itemsize: int) -> list[int]:
    """Chunk along dim 0 so a chunk stays under DENSE_CHUNK_BYTES (any chunking is valid)."""
    if not shape:
        return []
    row_bytes = itemsize * math.prod(shape[1:])
    rows = max(1, min(shape[0], DENSE_CHUNK_BYTES // max(1, row_bytes)))
    return [rows, *shape[1:]]


def create_array(root: Path, rel: str, shape: Sequence[int], dtype: str,
                 chunk_shape: Sequence[int]) -> ts.TensorStore:
    metadata = {
        "shape": list(shape), "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": _BYTES_CODEC, "fill_value": 0,
    }
    # Every chunk gets a file, also an all-zero one (a zero-centred norm, a pruned expert): the loader
    # reads chunk files directly and treats a missing one as damage.
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root / rel)}, "metadata": metadata,
            "store_data_equal_to_fill_value": True}
    return ts.open(spec, create=True).result()


def open_array(root: Path, rel: str, what: str) -> ts.TensorStore:
    """Open an existing array; StoreError naming the path and tensor if it is missing or unreadable."""
    path = root / rel
    if not (path / "zarr.json").is_file():
        raise StoreError(f"{path}: array missing for {what} (no zarr.json)")
    try:
        return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}},
                       open=True, read=True).result()
    except Exception as e:  # tensorstore raises ValueError with its status text
        raise StoreError(f"{path}: cannot open the array of {what}: {e}") from e


def array_meta(root: Path, rel: str) -> dict[str, Any]:
    return json.loads((root / rel / "zarr.json").read_text())


def check_array(arr: ts.TensorStore, entry: dict[str, Any], path: Path, what: str) -> None:
    """The array on disk must have the manifest's shape and dtype."""
    shape, dtype = list(arr.shape), arr.dtype.numpy_dtype.name
    if shape != list(entry["shape"]) or dtype != entry["dtype"]:
        raise StoreError(f"{path}: {what} is {dtype}{shape} on disk but the manifest says "
                         f"{entry['dtype']}{list(entry['shape'])}")


def is_plain_bank(meta: dict[str, Any]) -> bool:
    """One uncompressed little-endian chunk per flat expert id: readable straight from the files."""
    grid = meta.get("chunk_grid", {})
    chunk = grid.get("configuration", {}).get("chunk_shape", [])
    codecs = meta.get("codecs", [])
    return (grid.get("name") == "regular" and chunk == [1, *meta["shape"][1:]]
            and len(codecs) == 1 and codecs[0].get("name") == "bytes"
            and codecs[0].get("configuration", {}).get("endian", "little") == "little"
            and meta.get("chunk_key_encoding", {}).get("name") in ("default", "v2"))


def chunk_path(root: Path, rel: str, meta: dict[str, Any], index: Sequence[int]) -> Path:
    enc = meta.get("chunk_key_encoding", {"name": "default"})
    sep = enc.get("configuration", {}).get("separator")
    if enc["name"] == "default":
        key = "/".join(["c", *map(str, index)]) if sep in (None, "/") else sep.join(["c", *map(str, index)])
    elif enc["name"] == "v2":
        key = (sep or ".").join(map(str, index)) if index else "0"
    else:
        raise StoreError(f"{root / rel}: chunk_key_encoding {enc['name']!r} unsupported; valid: default, v2")
    return root / rel / key


def chunk_nbytes(meta: dict[str, Any]) -> int:
    chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
    return math.prod(chunk) * np_dtype(meta["data_type"]).itemsize


def _chunk_indices(meta: dict[str, Any]):
    shape, chunk = meta["shape"], meta["chunk_grid"]["configuration"]["chunk_shape"]
    counts = [max(1, -(-s // c)) for s, c in zip(shape, chunk)]
    return np.ndindex(*counts)


def expert_label(flat_id: int, num_experts: int | None) -> str:
    if num_experts:
        return f"expert flat id {flat_id} (layer {flat_id // num_experts}, expert {flat_id % num_experts})"
    return f"expert flat id {flat_id}"


def check_chunk_files(root: Path, rel: str, meta: dict[str, Any], what: str,
                      num_experts: int | None = None, bank: bool = False) -> None:
    """Cheap size check: every chunk file exists with exactly the uncompressed chunk size.

    Zarr reads a missing chunk as the fill value, so without this a deleted file would load as zeros.
    """
    if not is_plain_bank(meta) and meta.get("codecs") != _BYTES_CODEC:
        return  # compressed chunks have no fixed size; checksums cover them
    want = chunk_nbytes(meta)
    for index in _chunk_indices(meta):
        path = chunk_path(root, rel, meta, index)
        who = f"{what}, {expert_label(index[0], num_experts)}" if bank else what
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise StoreError(f"{path}: chunk file missing for {who}") from None
        if size != want:
            raise StoreError(f"{path}: chunk file of {who} is {size} bytes, expected {want} "
                             "(truncated or damaged)")


def alloc_aligned(shape: Sequence[int], dtype, align: int = ALIGN_BYTES) -> np.ndarray:
    """An uninitialised array whose data starts on an ``align`` boundary (a view into a uint8 buffer)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset:offset + nbytes].view(dtype).reshape(tuple(shape))


READERS = ("auto", "odirect", "buffered", "tensorstore")
DIRECT_IO_ALIGN = 4096  # O_DIRECT needs block-aligned buffers, offsets and lengths


def _odirect_ok(path: Path, chunk_bytes: int, buffer: np.ndarray) -> bool:
    """O_DIRECT is usable: the OS has it, the filesystem accepts it, the sizes are block-aligned."""
    if not hasattr(os, "O_DIRECT") or chunk_bytes % DIRECT_IO_ALIGN or buffer.ctypes.data % DIRECT_IO_ALIGN:
        return False
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:  # EINVAL on filesystems without direct I/O (tmpfs); a missing file reads buffered
        return False
    return True


def _in_page_cache(paths: Sequence[Path]) -> bool:
    """Whether the first page of every file is cached: a 4 KiB non-blocking read (RWF_NOWAIT)
    returns EAGAIN instead of waiting for the disk. Probing only a page keeps the readahead it may
    start small."""
    if not hasattr(os, "RWF_NOWAIT"):
        return False
    probe = bytearray(DIRECT_IO_ALIGN)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [probe], 0, os.RWF_NOWAIT)
        except (BlockingIOError, OSError):
            return False
        finally:
            os.close(fd)
    return True


def _read_file_into(path: Path, dst: memoryview, who: str, odirect: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if odirect else 0))
    except FileNotFoundError:
        raise StoreError(f"{path}: chunk file missing for {who}") from None
    try:
        pos = 0
        while pos < len(dst):
            n = os.readv(fd, [dst[pos:]])
            if not n or (odirect and n % DIRECT_IO_ALIGN):  # O_DIRECT is short only at end of file
                raise StoreError(f"{path}: chunk file of {who} ended after {pos + n} bytes, "
                                 f"expected {len(dst)} (truncated)")
            pos += n
    finally:
        os.close(fd)


def _split(n: int, threads: int) -> list[tuple[int, int]]:
    threads = max(1, min(threads, n))
    return [(n * k // threads, n * (k + 1) // threads) for k in range(threads)]


def _run_parallel(work, ranges, name: str) -> list:
    with ThreadPoolExecutor(len(ranges), thread_name_prefix=name) as pool:
        futures = [pool.submit(work, lo, hi) for lo, hi in ranges]
        return [f.result() for f in futures]


def _choose_reader(root: Path, rel: str, meta: dict[str, Any], out: np.ndarray, reader: str, what: str) -> str:
    n, zeros = out.shape[0], (0,) * (out.ndim - 1)
    plain = is_plain_bank(meta) and out.flags.c_contiguous and out.nbytes == n * chunk_nbytes(meta)
    if reader in ("odirect", "buffered") and not plain:
        raise StoreError(f"{root / rel}: {what} is not a plain one-chunk-per-expert array; "
                         "use reader='tensorstore'")
    if reader != "auto":
        return reader
    if not plain or not n:
        return "tensorstore" if not plain else "buffered"
    probes = [chunk_path(root, rel, meta, (i, *zeros)) for i in sorted({0, n // 2, n - 1})]
    if _odirect_ok(probes[0], chunk_nbytes(meta), out) and not _in_page_cache(probes):
        return "odirect"
    return "buffered"


def read_bank(root: Path, rel: str, out: np.ndarray, *, what: str, threads: int,
              checksums: Sequence[str] | None = None, algorithm: str | None = None,
              num_experts: int | None = None, reader: str = "auto") -> str:
    """Fill ``out`` [N, ...] with the bank at ``root/rel``, splitting the flat-id range over threads.

    Readers: "odirect" reads each chunk file straight into ``out`` with O_DIRECT (no page cache: the
    fastest cold read, and a 60 GiB pool is not cached twice); "buffered" the same through the page
    cache (fastest when the files are already cached); "tensorstore" any zarr layout, with a staging
    copy. "auto" picks buffered if sampled chunks are in the page cache, else odirect if the chunks
    are block-aligned, else buffered; tensorstore for other layouts. With ``checksums`` every chunk is
    hashed after it lands and a mismatch names the expert. Returns the reader used.

    ``out`` may also be the ``swapaxes(-1, -2)`` view of a C-contiguous array (a host pool's transposed
    down bank, ``HostPool(down_layout="ih")``): each chunk then lands in a per-thread aligned scratch
    buffer (checked there) and is copied transposed into its expert's rows.
    """
    if reader not in READERS:
        raise ValueError(f"reader {reader!r} unknown; valid: {', '.join(READERS)}")
    meta = array_meta(root, rel)
    n = out.shape[0]
    zeros = (0,) * (out.ndim - 1)
    transposed = not out.flags.c_contiguous
    if transposed and (out.ndim < 3 or not out.swapaxes(-1, -2).flags.c_contiguous):
        raise ValueError("read_bank writes into a C-contiguous array or the swapaxes(-1, -2) view of one")
    reader = _choose_reader(root, rel, meta, out.swapaxes(-1, -2) if transposed else out, reader, what)
    arr = open_array(root, rel, what) if reader == "tensorstore" else None

    def work(lo: int, hi: int) -> None:
        if reader == "tensorstore" and not transposed:
            try:
                ts.array(out[lo:hi], copy=False, write=True).write(arr[lo:hi]).result()
            except Exception as e:
                raise StoreError(f"{root / rel}: reading {what} experts {lo}..{hi - 1} failed: {e}") from e
        # a transposed view: each chunk lands in this thread's scratch (checked there), then goes into its rows
        scratch = alloc_aligned(out.shape[1:], out.dtype, DIRECT_IO_ALIGN) if transposed else None
        for i in range(lo, hi):
            label = f"{what}, {expert_label(i, num_experts)}"
            path = chunk_path(root, rel, meta, (i, *zeros))
            dst = scratch if transposed else out[i]
            if reader != "tensorstore":
                _read_file_into(path, memoryview(dst.reshape(-1).view(np.uint8)), label, odirect=reader == "odirect")
            elif transposed:
                try:
                    ts.array(scratch, copy=False, write=True).write(arr[i]).result()
                except Exception as e:
                    raise StoreError(f"{root / rel}: reading {label} failed: {e}") from e
            if checksums is not None and checksum(dst, algorithm) != checksums[i]:
                raise StoreError(f"{path}: checksum mismatch in {label} (corrupt chunk)")
            if transposed:
                out[i] = scratch

    _run_parallel(work, _split(n, threads), "ftw-read")
    return reader


def verify_bank(root: Path, rel: str, checksums: Sequence[str], algorithm: str, *, what: str,
                threads: int, num_experts: int | None = None) -> list[str]:
    """Checksum every chunk of a bank through a one-chunk scratch buffer per thread.

    Returns one message per bad chunk (path, bank, flat id), so a report names every corrupt expert.
    """
    meta = array_meta(root, rel)
    shape, dtype = meta["shape"], np_dtype(meta["data_type"])
    zeros = (0,) * (len(shape) - 1)
    plain = is_plain_bank(meta)
    arr = None if plain else open_array(root, rel, what)

    def work(lo: int, hi: int) -> list[str]:
        scratch = alloc_aligned(shape[1:], dtype, DIRECT_IO_ALIGN)
        flat = memoryview(scratch.reshape(-1).view(np.uint8))
        first = chunk_path(root, rel, meta, (lo, *zeros))
        odirect = plain and hi > lo and _odirect_ok(first, len(flat), scratch)
        bad = []
        for i in range(lo, hi):
            path = chunk_path(root, rel, meta, (i, *zeros))
            who = f"{what}, {expert_label(i, num_experts)}"
            try:
                if plain:
                    _read_file_into(path, flat, who, odirect=odirect)
                else:
                    scratch[...] = arr[i].read().result()
            except (StoreError, OSError, ValueError) as e:
                bad.append(str(e) if isinstance(e, StoreError) else f"{path}: reading {who} failed: {e}")
                continue
            if checksum(scratch, algorithm) != checksums[i]:
                bad.append(f"{path}: checksum mismatch in {who} (corrupt chunk)")
        return bad

    return [msg for part in _run_parallel(work, _split(shape[0], threads), "ftw-verify") for msg in part]
