"""Is every part of a decode-sized expert pool read equally fast? The all-thread read and the CPU expert kernel
(one token, top-8, bf16) region by region of a Qwen3.6-shaped pool as large as `bench/decode.py` makes (60 GiB by
default), against the all-thread read of a fresh buffer (what `bench/decode.py` takes as B_DRAM), with the
host's NUMA nodes and the pool's pages per node (/proc/self/numa_maps).

Why: the in-step CPU job's rate moves 64-94 GB/s between processes on one H200 machine while B_DRAM, read on a
fresh buffer, moves much less (bench/RESULTS.md sessions 31, 33). If the pool's own memory reads slower than the
fresh buffer, the roofline's B_DRAM is not the ceiling of the bytes the misses actually read.

    python bench/pool_read.py [--gib 60] [--region-gib 2] [--calls 8] [--pin]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time

import numpy as np

from ftjax import _host
from ftjax.host import measure, worker_info
from ftjax.host.pool import HostPool


def numa_nodes() -> list[str]:
    """One line per NUMA node of the host: its CPUs and memory (empty where sysfs has none)."""
    out = []
    for node in sorted(glob.glob("/sys/devices/system/node/node[0-9]*")):
        try:
            cpus = open(f"{node}/cpulist").read().strip()
            mem = next(line for line in open(f"{node}/meminfo") if "MemTotal" in line).split()[-2]
            out.append(f"{os.path.basename(node)}: cpus {cpus}, {int(mem) / 2**20:.1f} GiB")
        except (OSError, StopIteration, ValueError) as e:
            out.append(f"{os.path.basename(node)}: {e}")
    return out


def pages_per_node(ranges, numa_maps: str = "/proc/self/numa_maps") -> dict[str, int]:
    """Bytes per NUMA node of the mappings overlapping `ranges` [(lo, hi)] ("N<k>=pages" with the mapping's
    kernelpagesize_kB); {} where numa_maps cannot be read."""
    total: dict[str, int] = {}
    try:
        lines = open(numa_maps).read().splitlines()
    except OSError:
        return total
    for line in lines:
        parts = line.split()
        start = int(parts[0], 16)
        if not any(lo <= start < hi for lo, hi in ranges):
            continue
        page_kb = 4
        for p in parts:
            if p.startswith("kernelpagesize_kB="):
                page_kb = int(p.split("=")[1])
        for p in parts:
            if p.startswith("N") and "=" in p:
                node, pages = p.split("=")
                total[node] = total.get(node, 0) + int(pages) * page_kb * 1024
    return total


def kernel_gbps(pool: HostPool, e0: int, e1: int, calls: int, rng: np.random.Generator) -> float:
    """Median GB/s of `calls` 1-token top-8 bf16 calls, each on 8 experts of [e0, e1) not read before in it."""
    hidden = pool.hidden
    x = (rng.standard_normal((1, hidden)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    tok = np.zeros(8, np.int32)
    w = np.full(8, 0.125, np.float32)
    order = rng.permutation(np.arange(e0, e1))
    nbytes = 8 * (pool.expert_bytes("gate_up") + pool.expert_bytes("down"))
    rates = []
    for c in range(min(calls, (e1 - e0) // 8)):
        eid = np.sort(order[8 * c:8 * c + 8]).astype(np.int32)
        t0 = time.perf_counter()
        _host.run_experts(pool._h, x, tok, eid, w, 8, x_bf16=True)
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=60.0, help="pool size (Qwen3.6 bf16 experts, hidden 2048, expert 512)")
    ap.add_argument("--region-gib", type=float, default=2.0, help="size of each region read")
    ap.add_argument("--calls", type=int, default=8, help="kernel calls per region (median)")
    ap.add_argument("--reps", type=int, default=2, help="reads per region (best)")
    ap.add_argument("--pin", action="store_true", help="pin the pool as bench/decode.py does (needs CUDA)")
    ap.add_argument("--out", help="write the per-region figures as JSON")
    args = ap.parse_args(argv)
    if args.gib <= 0 or args.region_gib <= 0 or args.calls < 1 or args.reps < 1:
        ap.error("--gib and --region-gib must be > 0, --calls and --reps >= 1")
    threads = measure.host_threads()
    for line in numa_nodes() or ["no NUMA nodes in sysfs"]:
        print(line)
    shape = measure.ExpertShape(2048, 512, 8)
    fresh_before = measure.stream_read_gbps(4 << 30, threads=threads)
    t0 = time.perf_counter()
    pool = measure.make_pool(shape, "bf16", int(args.gib * 2**30))
    fill_s = time.perf_counter() - t0
    pinned = pool.pin_if_cuda() if args.pin else False
    fresh_after = measure.stream_read_gbps(4 << 30, threads=threads)
    banks = {b: pool.raw(b).reshape(-1) for b in ("gate_up", "down")}
    ranges = [(v.ctypes.data, v.ctypes.data + v.nbytes) for v in banks.values()]
    backing = pool.page_backing()
    print(f"pool {pool.total_bytes / 2**30:.1f} GiB ({pool.n_experts} experts), made in {fill_s:.0f} s, pinned {pinned}, "
          f"huge pages {backing['huge'] / max(backing['resident'], 1):.0%}; per NUMA node: "
          + (", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in sorted(pages_per_node(ranges).items())) or "n/a"))
    print(f"fresh 4 GiB buffer, {threads} threads: {fresh_before:.1f} GB/s before the pool, {fresh_after:.1f} after")
    per_expert = pool.expert_bytes("gate_up") + pool.expert_bytes("down")
    n_regions = max(1, int(pool.total_bytes // int(args.region_gib * 2**30)))
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'region':>6} {'experts':>13} {'read GB/s':>9} {'/fresh':>6} {'kernel GB/s':>11} {'/fresh':>6}")
    for k in range(n_regions):
        e0, e1 = k * pool.n_experts // n_regions, (k + 1) * pool.n_experts // n_regions
        secs = []
        for name, view in banks.items():  # the region's experts in both banks, read as one
            eb = pool.expert_bytes(name)
            secs.append(_host.stream_read_seconds(view[e0 * eb:e1 * eb], args.reps, threads))
        read = (e1 - e0) * per_expert / sum(secs) / 1e9
        kern = kernel_gbps(pool, e0, e1, args.calls, rng)
        rows.append({"region": k, "experts": [e0, e1], "read_gbps": read, "kernel_gbps": kern})
        print(f"{k:>6} {f'[{e0}, {e1})':>13} {read:>9.1f} {read / fresh_after:>6.2f} {kern:>11.1f} "
              f"{kern / fresh_after:>6.2f}")
    reads = [r["read_gbps"] for r in rows]
    kerns = [r["kernel_gbps"] for r in rows]
    fresh_end = measure.stream_read_gbps(4 << 30, threads=threads)
    print(f"regions' read: min {min(reads):.1f} / median {statistics.median(reads):.1f} / max {max(reads):.1f} GB/s; "
          f"kernel (1 x 8, {worker_info()['n_threads']} threads): "
          f"min {min(kerns):.1f} / median {statistics.median(kerns):.1f} / max {max(kerns):.1f}; "
          f"fresh buffer at the end {fresh_end:.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"fresh_gbps": [fresh_before, fresh_after, fresh_end], "threads": threads, "pinned": pinned,
                       "regions": rows, "numa": numa_nodes(), "pages_per_node": pages_per_node(ranges)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
