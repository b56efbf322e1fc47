"""CPU worker pool: call latency of a small expert call (p50 / p99 / mean) with a busy thread beside it.

The CPU branch of a decode step is a chain of short calls (one per MoE layer); a call that waits for a
worker which is asleep or descheduled (another thread on its core: JAX's dispatch thread, XLA's own
pools) stalls the whole step. The baseline is the caller alone (0 workers: no join at all); each row
reports its mean over that baseline. Run with more workers than free cores to see the stalls.

    python bench/worker_tail.py                       # configurations for this machine
    python bench/worker_tail.py --configs 0:100 3:100 3:2000 --calls 3000
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ftjax import _host
from ftjax.host import HostPool


def time_calls(pool, calls: int, n_workers: int, spin_us: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, pool.hidden)).astype(np.float32)
    tok, eid, w = np.zeros(2, np.int32), np.array([1, 5], np.int32), np.ones(2, np.float32)
    _host.configure_workers(n_workers, spin_us, True)
    stop = threading.Event()

    def busy():  # another runnable thread, as a serving process always has
        while not stop.is_set():
            sum(range(1000))

    th = threading.Thread(target=busy)
    th.start()
    try:
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            _host.run_experts(pool._h, x, tok, eid, w, 2, x_bf16=False)
            ts.append(time.perf_counter() - t0)
    finally:
        stop.set()
        th.join()
        _host.configure_workers(-1, 100, True)
    return np.asarray(ts[calls // 10:]) * 1e6  # drop the warm-up tenth


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ncores = _host.worker_info()["physical_cores"]
    ap.add_argument("--configs", nargs="+", metavar="N:SPIN_US",
                    default=["0:100", f"{max(1, ncores - 2)}:100", f"{ncores + 1}:100", f"{ncores + 1}:2000"])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "worker_tail.json"))
    args = ap.parse_args(argv)
    n = 8
    rng = np.random.default_rng(1)
    pool = HostPool(n, 512, 256, "f32").fill({"gate_up": rng.standard_normal((n, 512, 512)).astype(np.float32),
                                              "down": rng.standard_normal((n, 512, 256)).astype(np.float32)})
    rows = []
    for cfg in args.configs:
        workers, spin = (int(v) for v in cfg.split(":"))
        ts = time_calls(pool, args.calls, workers, spin)
        rows.append({"workers": workers, "spin_us": spin, "p50_us": float(np.percentile(ts, 50)),
                     "p99_us": float(np.percentile(ts, 99)), "max_us": float(ts.max()), "mean_us": float(ts.mean())})
    base = next((r["mean_us"] for r in rows if r["workers"] == 0), rows[0]["mean_us"])
    print(f"{_host.cpu_brand()}: {ncores} physical cores; 2 experts of H512/I256 f32, 1 token; a busy thread beside")
    print(f"{'workers':>7} {'spin us':>8} {'p50 us':>8} {'p99 us':>9} {'max us':>9} {'mean us':>8} {'mean / 0 workers':>17}")
    for r in rows:
        print(f"{r['workers']:>7} {r['spin_us']:>8} {r['p50_us']:8.0f} {r['p99_us']:9.0f} {r['max_us']:9.0f} "
              f"{r['mean_us']:8.0f} {r['mean_us'] / base:17.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": _host.cpu_brand(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
