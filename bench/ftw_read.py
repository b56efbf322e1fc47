"""FTW expert-bank read rate: our loader vs ``dd`` on the same bytes, in the same run.

Builds a synthetic store (Qwen3.5-35B-A3B-sized experts: H=2048, I=512, bf16, ~6 MiB per expert;
default ~1 GiB of banks) or takes one with --store, then measures:

* ours: ``read_banks`` (parallel reads of the chunk files into 2 MiB-aligned host buffers) with each
  reader (odirect, buffered: see ftjax.ftw.store.read_bank) and --threads value, and the
  tensorstore reader for reference;
* dd: ``dd if=<all bank chunk files concatenated into one file> of=/dev/null bs=16M`` (the ratio
  column), and the same with ``iflag=direct``.

Two cache states: "hot" (files in the page cache) and "evicted" (pages dropped with
posix_fadvise(DONTNEED) before each run: needs no root, but a hypervisor or disk cache below may
still serve them, so it is an upper bound on a truly cold read). Prints a table, writes JSON.

    PYTHONPATH=. python bench/ftw_read.py [--gib 1] [--store DIR] [--threads 1,2,4] [--json PATH (default bench/out/ftw_read.json)]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from ftjax.config import parse_hf_config
from ftjax.ftw.convert import write_store
from ftjax.ftw.load import default_threads, open_store, read_banks
from ftjax.ftw.store import array_meta, chunk_path, read_bank

EXPERT_BYTES = 3 * 512 * 2048 * 2  # gate_up + down of one bf16 expert, H=2048, I=512


class SyntheticCheckpoint:
    """HFCheckpoint interface over random weights (finite bf16 bit patterns), generated per expert."""

    def __init__(self, layers: int, experts: int):
        self.config = parse_hf_config({
            "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": layers,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 1024,
            "num_experts": experts, "num_experts_per_tok": min(8, experts), "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "layer_types": ["linear_attention"] * (layers - 1) + ["full_attention"],
        }, where="synthetic")
        self.tokenizer_files, self.source = [], {"synthetic": True}
        self._rng = np.random.default_rng(0)

    def _rand(self, shape) -> np.ndarray:
        bits = self._rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) & 0xBFFF  # never inf/nan
        return bits.view(ml_dtypes.bfloat16)

    def dense_tensors(self):
        from ftjax.models.params import param_shapes

        for name, shape in param_shapes(self.config).items():
            yield name, self._rand(shape)

    def expert(self, layer: int, e: int):
        H, I = self.config.hidden_size, self.config.moe_intermediate_size
        return {"gate_up": self._rand((2 * I, H)), "down": self._rand((H, I))}


def bank_files(root: Path) -> list[Path]:
    _, man, _ = open_store(root)
    files = []
    for entry in man["experts"]["banks"].values():
        meta = array_meta(root, entry["path"])
        files += [chunk_path(root, entry["path"], meta, (i, 0, 0)) for i in range(entry["shape"][0])]
    return files


def evict(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def time_ours(root: Path, threads: int, reader: str) -> tuple[float, int]:
    root_, man, cfg = open_store(root)
    t0 = time.perf_counter()
    banks = read_banks(root_, man, cfg, threads=threads, reader=reader)
    seconds = time.perf_counter() - t0
    return seconds, sum(b.nbytes for b in banks.values())


def time_ours_reused(root: Path, threads: int) -> tuple[float, int]:
    """Buffered reads into banks that were already filled once: no first-touch page faults, like
    dd's reused 16 MiB buffer. Separates the cost of faulting in a fresh host pool from the copy."""
    root_, man, _ = open_store(root)
    banks = read_banks(root_, man, open_store(root)[2], threads=threads, reader="buffered")
    t0 = time.perf_counter()
    for name, out in banks.items():
        read_bank(root_, man["experts"]["banks"][name]["path"], out, what=name, threads=threads, reader="buffered")
    return time.perf_counter() - t0, sum(b.nbytes for b in banks.values())


def time_dd(path: Path, direct: bool = False) -> tuple[float, int]:
    cmd = ["dd", f"if={path}", "of=/dev/null", "bs=16M"] + (["iflag=direct"] if direct else [])
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - t0
    m = re.search(r"(\d+) bytes", res.stderr)
    return seconds, int(m.group(1)) if m else path.stat().st_size


def measure(fn, reps: int, before=None) -> dict:
    runs = []
    for _ in range(reps):
        if before:
            before()
        seconds, nbytes = fn()
        runs.append(nbytes / seconds / 1e9)
    return {"gbps": max(runs), "runs_gbps": runs, "bytes": nbytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, help="an existing FTW store (default: build a synthetic one)")
    ap.add_argument("--gib", type=float, default=1.0, help="bank size of the synthetic store (GiB)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", default=None, help="comma list of loader thread counts")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "out" / "ftw_read.json",
                    help="result file (default: bench/out/ftw_read.json)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic store and the dd file")
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, 2, default_threads()})

    work = Path(tempfile.mkdtemp(prefix="ftw_read_", dir=os.environ.get("TMPDIR", "/tmp")))
    root = args.store
    if root is None:
        experts = max(1, round(args.gib * 2**30 / EXPERT_BYTES / args.layers))
        root = work / "store"
        print(f"building a synthetic store: {args.layers} layers x {experts} experts, "
              f"{args.layers * experts * EXPERT_BYTES / 2**30:.2f} GiB of banks -> {root}", file=sys.stderr)
        t0 = time.perf_counter()
        write_store(SyntheticCheckpoint(args.layers, experts), root, "bf16", progress=True)
        print(f"built in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    files = bank_files(root)
    concat = work / "banks_concat.bin"
    with open(concat, "wb") as out:
        for p in files:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
    total = concat.stat().st_size

    results: dict = {"store": str(root), "bank_bytes": total, "chunk_files": len(files),
                     "cpus": os.cpu_count(), "threads": threads,
                     "dd": "dd if=<bank chunk files concatenated> of=/dev/null bs=16M",
                     "note": "hot = page cache; evicted = posix_fadvise(DONTNEED) before each run, "
                             "no root cache drop (a cache below the VM may still serve reads)"}
    rows = []
    for state, before in (("hot", None), ("evicted", lambda: evict([*files, concat]))):
        time_ours(root, threads[-1], "buffered")  # warm the code paths (and the cache for "hot")
        time_dd(concat)
        dd = measure(lambda: time_dd(concat), args.reps, before)
        dd_direct = measure(lambda: time_dd(concat, direct=True), args.reps, before)
        results[state] = {"dd": dd, "dd_iflag_direct": dd_direct}
        for reader in ("auto", "odirect", "buffered", "tensorstore"):
            for t in threads if reader in ("odirect", "buffered") else threads[-1:]:
                ours = measure(lambda: time_ours(root, t, reader), args.reps, before)
                results[state][f"ours_{reader}_t{t}"] = ours
                rows.append((state, f"{reader}, {t} thr", ours["gbps"], dd["gbps"], dd_direct["gbps"]))
        if state == "hot":
            reused = measure(lambda: time_ours_reused(root, threads[-1]), args.reps)
            results[state][f"ours_buffered_reused_buffer_t{threads[-1]}"] = reused
            rows.append((state, f"buffered, reused buf, {threads[-1]} thr", reused["gbps"], dd["gbps"],
                         dd_direct["gbps"]))

    print(f"\nFTW expert-bank read, {total / 2**30:.2f} GiB in {len(files)} chunk files, {os.cpu_count()} CPUs, "
          f"best of {args.reps}")
    print(f"{'cache':8} {'ours: reader':30} {'ours GB/s':>10} {'dd GB/s':>9} {'ours/dd':>8} {'dd iflag=direct':>16}")
    for state, name, ours, dd, ddd in rows:
        print(f"{state:8} {name:30} {ours:10.2f} {dd:9.2f} {ours / dd:8.2f} {ddd:16.2f}")
    print(f"({results['note']}; 'auto' is load_store's default: buffered when sampled chunks are "
          f"cached, else odirect)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.json}")
    if args.keep:
        print(f"kept {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
