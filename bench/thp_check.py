"""Transparent huge pages on this host: the OS setting, and how the expert pool (2 MiB-aligned mmap +
MADV_HUGEPAGE) and the STREAM ceiling's buffer (numpy, which advises large allocations itself) are
backed after their first touch, with STREAM read on that buffer.

    python bench/thp_check.py [--gib 2]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from ftjax import _host
from ftjax.host import measure, worker_info
from ftjax.host.pool import smaps_backing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="pool and buffer size")
    args = ap.parse_args(argv)
    for f in ("enabled", "defrag", "shmem_enabled"):
        try:
            print(f"transparent_hugepage/{f}: {open(f'/sys/kernel/mm/transparent_hugepage/{f}').read().strip()}")
        except OSError as e:
            print(f"transparent_hugepage/{f}: {e}")
    nbytes = int(args.gib * 2**30)
    t0 = time.perf_counter()
    pool = measure.make_pool(measure.ExpertShape(2048, 512, 8), "bf16", nbytes)
    b = pool.page_backing()
    print(f"expert pool {pool.total_bytes / 2**30:.2f} GiB (filled in {time.perf_counter() - t0:.1f} s): "
          f"resident {b['resident'] / 2**30:.2f} GiB, on huge pages {b['huge'] / max(b['resident'], 1):.0%}")
    buf = np.empty(nbytes, np.uint8)
    measure._fill_random(buf, np.random.default_rng(1))
    b = smaps_backing([(buf.ctypes.data, buf.ctypes.data + nbytes)])
    gbps = nbytes / _host.stream_read_seconds(buf, 3) / 1e9
    print(f"STREAM buffer (np.empty): on huge pages {b['huge'] / max(b['resident'], 1):.0%}; read {gbps:.1f} GB/s "
          f"({worker_info()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
