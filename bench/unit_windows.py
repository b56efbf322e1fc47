"""The CPU expert call on a unit window: one 1-token expert of the Qwen3.6 shape (bf16, H 2048, I 512) computing
units [u, I) only (the unit split's CPU share), per unit start u: gate/up and down GB/s from the call's own
round times, against u = 0 and against a STREAM read with the same worker threads, in the same run.

    python bench/unit_windows.py [--starts 0 160 176 192 ...] [--calls 400] [--workers N] [--down-rows 16 32]
                                 [--window-prefetch on off]

Each call takes a fresh expert of a pool larger than the caches (synthetic, no reuse: the DRAM-bound case);
the starts run round robin (call k uses start k mod n), so every start sees the same stretch of the machine.
The question: does a window starting mid cache line (u * 2 bytes not a multiple of 64: u = 176) read slower
than one on a line (160, 192)? (OffloadExperts' unit_granule.) Prints a table; writes bench/out/unit_windows.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftjax import _host  # noqa: E402
from ftjax.host import expert_call_time_totals, measure  # noqa: E402
from ftjax.host.calibrate import QWEN36  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", nargs="+", type=int, default=[0, 64, 160, 176, 192, 200, 256, 384])
    ap.add_argument("--calls", type=int, default=400, help="calls per start")
    ap.add_argument("--window-gib", type=float, default=2.0, help="pool size (larger than the caches)")
    ap.add_argument("--workers", type=int, default=-1, help="worker threads (-1: the pool's default)")
    ap.add_argument("--down-rows", nargs="+", type=int, default=None,
                    help="down's rows per work item to compare (_host.set_down_item_rows; each start runs under each; "
                         "default: the built-in)")
    ap.add_argument("--window-prefetch", nargs="+", choices=["on", "off"], default=["on"],
                    help="column windows' prefetch stops at the window's end (on, the default) or runs on as whole "
                         "rows' does (off, the earlier kernels): _host.set_window_prefetch; each case runs under each")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "unit_windows.json"))
    args = ap.parse_args(argv)
    H, I = QWEN36.hidden, QWEN36.inter
    bad = [u for u in args.starts if not 0 <= u < I]
    if bad:
        ap.error(f"unit starts must lie in [0, {I}): {bad}")
    if args.workers >= 0:
        _host.configure_workers(args.workers, 2000, True)
    pool = measure.make_pool(QWEN36, "bf16", int(args.window_gib * 2**30))
    stream = measure.stream_read_gbps(int(args.window_gib * 2**30))
    print(f"pool {pool.n_experts} experts ({pool.total_bytes / 2**30:.1f} GiB), workers {_host.worker_info()['n_workers']}, "
          f"STREAM read {stream:.1f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, H)).astype(np.float32)
    tok, w = np.zeros(1, np.int32), np.ones(1, np.float32)
    keys = ("total_us", "phase1_us", "phase1_wait_us", "phase2_us", "phase2_wait_us")
    args.down_rows = args.down_rows or [_host.down_item_rows()]
    cases = [(u, dr, wp) for wp in args.window_prefetch for dr in args.down_rows for u in args.starts]
    acc = {case: dict.fromkeys(keys, 0.0) for case in cases}
    order = rng.permutation(pool.n_experts)
    k = 0
    default_rows, default_wp = _host.down_item_rows(), _host.window_prefetch()
    try:
        for c in range(-20, args.calls):  # 20 rounds of warm-up
            for u, dr, wp in cases:
                _host.set_down_item_rows(dr)
                _host.set_window_prefetch(wp == "on")
                eid = np.array([order[k % pool.n_experts]], np.int32)
                k += 1
                t0 = expert_call_time_totals()
                _host.run_experts(pool._h, x, tok, eid, w, 1, unit_start=np.array([u], np.int32))
                t1 = expert_call_time_totals()
                if c >= 0:
                    for key in keys:
                        acc[(u, dr, wp)][key] += (t1[key] - t0[key]) / args.calls
    finally:
        _host.set_down_item_rows(default_rows)
        _host.set_window_prefetch(default_wp)
    rows = []
    print(f"{'u':>4} {'rows2':>5} {'wpf':>3} {'offset B':>8} {'gate/up us':>10} {'GB/s':>6} {'/STREAM':>7} {'down us':>8} {'GB/s':>6} "
          f"{'/STREAM':>7} {'/u=0':>5} {'call us':>8} {'GB/s':>6}")
    gu_row, dn_row = 2 * H * 2, I * 2  # bytes of a gate/up row, of a whole down row
    base = {}
    for u, dr, wp in cases:
        a = acc[(u, dr, wp)]
        gu_bytes, dn_bytes = 2 * (I - u) * gu_row // 2, H * (I - u) * 2
        gu, dn = gu_bytes / a["phase1_us"] / 1e3, dn_bytes / a["phase2_us"] / 1e3
        call = (gu_bytes + dn_bytes) / a["total_us"] / 1e3
        if u == 0:
            base[(dr, wp)] = dn
        rows.append({"u": u, "down_item_rows": dr, "window_prefetch": wp, "offset_bytes": u * 2 % 64, **a, "gate_up_gbps": gu,
                     "down_gbps": dn, "call_gbps": call})
        print(f"{u:4d} {dr:5d} {wp:>3} {u * 2 % 64:8d} {a['phase1_us']:10.1f} {gu:6.1f} {gu / stream:7.2f} {a['phase2_us']:8.1f} "
              f"{dn:6.1f} {dn / stream:7.2f} {dn / base[(dr, wp)] if (dr, wp) in base else float('nan'):5.2f} {a['total_us']:8.1f} "
              f"{call:6.1f}")
    print(f"offset B: the down window's start within a 64-byte line (u * 2 mod 64); a down row is {dn_row} B; "
          f"GB/s: the window's weight bytes over the round's wall time (the call's own profile); rows2: down's rows per "
          f"work item asked (halved while a round would have < 4 items per thread); wpf: the window's prefetch stops at its "
          f"end (on) or runs past it (off)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"stream_gbps": stream, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
