"""The decode call's in-step fills on the GPU, alone and beside a background fill (GPU machine).

A decode call of the unit split fills units [0, u) of the experts it splits (`cuda.expert_fill_units`: gate
rows, up rows and the first u columns of every down row), synchronously on XLA's stream, while the step's
background fills (whole experts, or units [u, I)) may still run on the side stream from the last step. This
measures, per fill form, the time of one in-step fill of one expert (Qwen3.6 shape, bf16):

- ``whole``: `cuda.expert_fill` of the whole expert (6.3 MB);
- ``u=N``: `cuda.expert_fill_units` with u = N (3 * H * u * 2 bytes); ``empty``: a call with no valid entry;

each (a) alone and (b) beside a background fill: `cuda.expert_fill_fork` of ``--bg-experts`` whole experts
with ``--bg-blocks`` thread blocks (the background's form) on the side stream, issued just before. A chain
of N and of 2N fills runs in one jitted call; the fill's time is (t(2N) - t(N)) / N (the call's dispatch
cancels out). The ceilings in the same run: pinned cudaMemcpy H2D of one expert's bytes, and the whole-expert
fill alone. The background alone is timed too: when the 2N chain beside it runs longer than the background,
part of the chain ran alone (the table says so).

    python bench/fill_units.py [--units 64 128 192 256 384 512] [--chain 12] [--bg-experts 96] [--bg-blocks 16]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftjax.host import cuda, measure  # noqa: E402

CHAIN_SLOTS = 8  # the chain's fills cycle over slots [0, 8); the background writes slots after them


def build(pool, form, n, bg_experts, bg_blocks):
    """A jitted chain of ``n`` one-expert fills of ``form`` (``whole``, ``empty`` or an int u), after a forked
    background fill of ``bg_experts`` experts (0: none)."""
    E = pool.n_experts

    def f(gu, dn):
        if bg_experts:
            ids = jnp.arange(bg_experts, dtype=jnp.int32) % E
            slots = CHAIN_SLOTS + jnp.arange(bg_experts, dtype=jnp.int32)
            gu, dn = cuda.expert_fill_fork(ids, slots, jnp.int32(bg_experts), gu, dn, pool, blocks=bg_blocks)
        for q in range(n):
            ids = jnp.full((1,), (bg_experts + 7 * q) % E, jnp.int32)
            slots = jnp.full((1,), q % CHAIN_SLOTS, jnp.int32)
            if form == "whole":
                gu, dn = cuda.expert_fill(ids, slots, jnp.int32(1), gu, dn, pool)
            else:
                units = 0 if form == "empty" else int(form)
                gu, dn = cuda.expert_fill_units(ids, slots, jnp.int32(0 if form == "empty" else 1), jnp.int32(units),
                                                gu, dn, pool)
        return gu, dn

    return jax.jit(f, donate_argnums=(0, 1))


def timed(fn, banks, reps):
    """Median ms of ``fn(*banks)`` (the chain on XLA's stream; a forked background is waited for after)."""
    times = []
    for r in range(reps + 2):
        t0 = time.perf_counter()
        banks = fn(*banks)
        jax.block_until_ready(banks)
        dt = time.perf_counter() - t0
        cuda.sync_fills()
        if r >= 2:
            times.append(dt)
    return float(np.median(times)) * 1e3, banks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, nargs="+", default=[64, 128, 192, 256, 384, 512])
    ap.add_argument("--chain", type=int, default=12, help="N: chains of N and 2N fills")
    ap.add_argument("--bg-experts", type=int, default=96, help="whole experts in the background fill")
    ap.add_argument("--bg-blocks", type=int, default=16, help="the background fill's thread blocks")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "fill_units.json")
    args = ap.parse_args(argv)
    if not cuda.available():
        print("needs the CUDA build of ftjax._host, a GPU and JAX's GPU backend", file=sys.stderr)
        return 2
    shape = measure.ExpertShape(2048, 512)
    H, I = shape.hidden, shape.inter
    if any(u <= 0 or u > I or u % 8 for u in args.units):
        ap.error(f"--units must be multiples of 8 in (0, {I}]")
    if args.chain < 1 or args.bg_experts < 1 or args.bg_blocks < 1:
        ap.error("--chain, --bg-experts and --bg-blocks must be >= 1")
    expert_bytes = shape.expert_bytes("bf16")
    pool = measure.make_pool(shape, "bf16", (args.bg_experts + 7 * 2 * args.chain + 8) * expert_bytes)
    pool.pin()
    S = CHAIN_SLOTS + args.bg_experts
    banks = (jnp.zeros((S, 2 * I, H), jnp.bfloat16), jnp.zeros((S, H, I), jnp.bfloat16))
    memcpy = cuda.memcpy_h2d_gbps(expert_bytes)

    bg_fn = build(pool, "empty", 1, args.bg_experts, args.bg_blocks)  # the background alone (and one empty fill)
    bg_times = []
    for r in range(args.reps + 1):
        t0 = time.perf_counter()
        banks = bg_fn(*banks)
        jax.block_until_ready(banks)
        cuda.sync_fills()
        if r:
            bg_times.append(time.perf_counter() - t0)
    bg_alone_ms = float(np.median(bg_times)) * 1e3
    print(f"pinned cudaMemcpy H2D of {expert_bytes / 1e6:.1f} MB: {memcpy:.1f} GB/s; background fill alone: "
          f"{args.bg_experts} experts, {args.bg_blocks} blocks, {bg_alone_ms:.2f} ms "
          f"({args.bg_experts * expert_bytes / bg_alone_ms / 1e6:.1f} GB/s)", flush=True)

    forms = ["whole", "empty"] + [str(u) for u in args.units]
    rows = []
    for form in forms:
        nbytes = expert_bytes if form == "whole" else 0 if form == "empty" else 3 * H * int(form) * 2
        row = {"form": form, "bytes": nbytes}
        for label, bg in (("alone", 0), ("beside_bg", args.bg_experts)):
            t1, banks = timed(build(pool, form, args.chain, bg, args.bg_blocks), banks, args.reps)
            t2, banks = timed(build(pool, form, 2 * args.chain, bg, args.bg_blocks), banks, args.reps)
            us = (t2 - t1) * 1e3 / args.chain
            row[label] = {"us": us, "gbps": nbytes / us / 1e3 if nbytes else 0.0, "chain_2n_ms": t2}
        row["bg_outlasted"] = row["beside_bg"]["chain_2n_ms"] <= bg_alone_ms
        rows.append(row)
        a, b = row["alone"], row["beside_bg"]
        print(f"  {form}: alone {a['us']:.1f} us, beside the background {b['us']:.1f} us", flush=True)

    whole = rows[0]["alone"]["gbps"]
    print(f"\n{'fill':8} {'MB':>6} {'alone us':>9} {'GB/s':>7} {'/memcpy':>8} {'/whole':>7} {'beside bg us':>13} "
          f"{'GB/s':>7} {'slowdown':>9}")
    for r in rows:
        a, b = r["alone"], r["beside_bg"]
        ratio = lambda x, y: f"{x / y:.2f}" if y else "-"  # noqa: E731
        print(f"{r['form']:8} {r['bytes'] / 1e6:6.2f} {a['us']:9.1f} {a['gbps']:7.1f} {ratio(a['gbps'], memcpy):>8} "
              f"{ratio(a['gbps'], whole):>7} {b['us']:13.1f} {b['gbps']:7.1f} {ratio(b['us'], a['us']):>9}"
              f"{'' if r['bg_outlasted'] else '  (the background ended first: partly alone)'}")
    print("fill: whole = one expert by expert_fill; u=N: expert_fill_units, units [0, N) of one expert; empty: no valid "
          "entry. Times per fill from chains of N and 2N in one jitted call; beside bg: after a forked background "
          f"fill of {args.bg_experts} whole experts with {args.bg_blocks} blocks.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"memcpy_gbps": memcpy, "bg_alone_ms": bg_alone_ms,
                                    "expert_bytes": expert_bytes, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
