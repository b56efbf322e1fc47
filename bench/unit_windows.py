"""The CPU expert call on a unit window: one 1-token expert of the Qwen3.6 shape (bf16, H 2048, I 512) computing
units [u, I) only (the unit split's CPU share), per unit start u: gate/up and down GB/s from the call's own
round times, against u = 0 and against a STREAM read with the same worker threads, in the same run.

    python bench/unit_windows.py [--starts 0 160 176 192 ...] [--calls 400] [--workers N]
                                 [--knob-variants down_rows=16 window_prefetch=off,tile_prefetch=on ...]
                                 [--down-layouts hi ih]

Each call takes a fresh expert of a pool larger than the caches (synthetic, no reuse: the DRAM-bound case);
the starts (and the CPU kernel knobs of --knob-variants, ftjax.host.kernel_knobs, against the defaults) run round
robin, call after call, so every case sees the same stretch of the machine.
--down-layouts runs each case on a pool of each down layout (HostPool down_layout: "ih" stores down transposed,
so the window is whole rows, read in round 1 with gate/up's; its round 2 sums the items' partials): compare the
call columns. The question: does a window starting mid cache line (u * 2 bytes not a multiple of 64: u = 176) read slower
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
from ftjax.host import expert_call_time_totals, kernel_knobs, knob_variants, measure, set_kernel_knobs  # noqa: E402
from ftjax.host.calibrate import QWEN36  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", nargs="+", type=int, default=[0, 64, 160, 176, 192, 200, 256, 384])
    ap.add_argument("--calls", type=int, default=400, help="calls per start")
    ap.add_argument("--window-gib", type=float, default=2.0, help="pool size (larger than the caches)")
    ap.add_argument("--workers", type=int, default=-1, help="worker threads (-1: the pool's default)")
    ap.add_argument("--knob-variants", nargs="+", default=[], metavar="KNOB=V[,KNOB=V]",
                    help="also run every start under these CPU kernel knobs (ftjax.host.kernel_knobs; the others at "
                         "their defaults), e.g. down_rows=16 window_prefetch=off tile_prefetch=on")
    ap.add_argument("--down-layouts", nargs="+", default=["hi"], choices=["hi", "ih"],
                    help="the pools' down layouts (one pool each, the same values)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "unit_windows.json"))
    args = ap.parse_args(argv)
    H, I = QWEN36.hidden, QWEN36.inter
    bad = [u for u in args.starts if not 0 <= u < I]
    if bad:
        ap.error(f"unit starts must lie in [0, {I}): {bad}")
    default = kernel_knobs()
    try:
        variants = {"default": default, **knob_variants(args.knob_variants)}  # every value checked before any work
    except ValueError as e:
        ap.error(f"--knob-variants {e}")
    if args.workers >= 0:
        _host.configure_workers(args.workers, 2000, True)
    pools = {d: measure.make_pool(QWEN36, "bf16", int(args.window_gib * 2**30), down_layout=d) for d in args.down_layouts}
    pool = pools[args.down_layouts[0]]
    stream = measure.stream_read_gbps(int(args.window_gib * 2**30))
    print(f"pools {'/'.join(pools)}: {pool.n_experts} experts ({pool.total_bytes / 2**30:.1f} GiB) each, workers "
          f"{_host.worker_info()['n_workers']}, STREAM read {stream:.1f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, H)).astype(np.float32)
    tok, w = np.zeros(1, np.int32), np.ones(1, np.float32)
    keys = ("total_us", "phase1_us", "phase1_wait_us", "phase2_us", "phase2_wait_us")
    cases = [(u, v, d) for d in pools for v in variants for u in args.starts]
    acc = {case: dict.fromkeys(keys, 0.0) for case in cases}
    order = rng.permutation(pool.n_experts)
    k = 0
    try:
        for c in range(-20, args.calls):  # 20 rounds of warm-up
            for u, v, d in cases:
                set_kernel_knobs(**variants[v])
                eid = np.array([order[k % pool.n_experts]], np.int32)
                k += 1
                t0 = expert_call_time_totals()
                _host.run_experts(pools[d]._h, x, tok, eid, w, 1, unit_start=np.array([u], np.int32))
                t1 = expert_call_time_totals()
                if c >= 0:
                    for key in keys:
                        acc[(u, v, d)][key] += (t1[key] - t0[key]) / args.calls
    finally:
        set_kernel_knobs(**default)
    rows = []
    width = max(len(v) for v in variants)
    print(f"{'down':4} {'knobs':{width}} {'u':>4} {'offset B':>8} {'gate/up us':>10} {'GB/s':>6} {'/STREAM':>7} {'down us':>8} {'GB/s':>6} "
          f"{'/STREAM':>7} {'/u=0':>5} {'call us':>8} {'GB/s':>6}")
    gu_row, dn_row = 2 * H * 2, I * 2  # bytes of a gate/up row, of a whole down row
    base = {}
    for u, v, d in cases:
        a = acc[(u, v, d)]
        gu_bytes, dn_bytes = 2 * (I - u) * gu_row // 2, H * (I - u) * 2
        if d == "ih":  # round 1 reads both (the fused pass); round 2 sums the partials (no weights: down GB/s = 0)
            gu_bytes, dn_bytes = gu_bytes + dn_bytes, 0
        gu, dn = gu_bytes / a["phase1_us"] / 1e3, dn_bytes / a["phase2_us"] / 1e3
        call = (gu_bytes + dn_bytes) / a["total_us"] / 1e3
        if u == 0:
            base[(v, d)] = dn
        rows.append({"u": u, "knobs": variants[v], "variant": v, "down_layout": d, "offset_bytes": u * 2 % 64, **a,
                     "gate_up_gbps": gu, "down_gbps": dn, "call_gbps": call})
        rel = dn / base[(v, d)] if base.get((v, d)) else float("nan")
        print(f"{d:4} {v:{width}} {u:4d} {u * 2 % 64:8d} {a['phase1_us']:10.1f} {gu:6.1f} {gu / stream:7.2f} {a['phase2_us']:8.1f} "
              f"{dn:6.1f} {dn / stream:7.2f} {rel:5.2f} {a['total_us']:8.1f} "
              f"{call:6.1f}")
    print("down ih: gate/up us is the fused round (its GB/s: gate/up and down bytes), down us the partials' sum")
    print(f"offset B: the down window's start within a 64-byte line (u * 2 mod 64); a down row is {dn_row} B; "
          f"GB/s: the window's weight bytes over the round's wall time (the call's own profile); knobs: default = "
          f"{default}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"stream_gbps": stream, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
