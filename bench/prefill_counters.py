"""One prefill layer call (8K tokens, random top-8 of 256) for Nsight Compute to count: is the
grouped kernel's weight traffic read from HBM once per expert, or once per row tile?

Run under ncu (the gpu_session step `prefill-ncu` does), e.g.
    ncu -k regex:mosaic_prefill -c 2 --section SpeedOfLight --metrics dram__bytes_read.sum \\
        python3 bench/prefill_counters.py --shape 4096x2048
It prints the bytes the kernels must read at least (each hit expert's weights once, the input rows
once), so the counters' DRAM bytes can be read against them.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from ftjax.pallas import prefill_gemm as pg
from ftjax.pallas import routing


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2048x512", help="HxI")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--one-expert", action="store_true", help="every route to expert 0")
    ap.add_argument("--gathers", nargs="+", default=["xla"], choices=("xla", "tma", "fused"),
                    help="prefill_experts(gather=...) forms to run, in order (one call each)")
    args = ap.parse_args()
    H, I = map(int, args.shape.split("x"))
    T, k, E = args.tokens, args.top_k, args.experts
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (T, H), jnp.bfloat16)
    ids = jnp.argsort(jax.random.uniform(ks[1], (T, E)), axis=1)[:, :k].astype(jnp.int32)
    if args.one_expert:
        ids = jnp.zeros_like(ids)
    w = jax.nn.softmax(jax.random.normal(ks[2], (T, k)), axis=-1)
    gate_up = (jax.random.normal(ks[3], (E, 2 * I, H), jnp.float32) * 0.02).astype(jnp.bfloat16)
    down = (jax.random.normal(ks[4], (E, H, I), jnp.float32) * 0.02).astype(jnp.bfloat16)
    slots = jnp.arange(E, dtype=jnp.int32)
    valid = jnp.ones((T,), bool)
    for gather in args.gathers:  # under ncu -c N the first N matching kernels are counted, in this order
        y = jax.block_until_ready(pg.prefill_experts(x, ids, w, valid, gate_up, down, slots, gather=gather))
    hit = int(jnp.unique(ids).size)
    plan = routing.plan_routes(ids, valid, E, 128)
    n_tiles = int(plan.n_tiles)
    print(f"H {H} I {I} T {T} top-{k} of {E}: {hit} experts hit, {n_tiles} row tiles of 128; "
          f"y finite: {bool(jnp.isfinite(y).all())}")
    print(f"  gate_up kernel must read: weights {hit * 2 * I * H * 2 / 1e9:.3f} GB "
          f"(x{n_tiles / hit:.2f} if every row tile read its expert's own), "
          f"x rows {T * k * H * 2 / 1e9:.3f} GB")
    print(f"  down kernel must read: weights {hit * H * I * 2 / 1e9:.3f} GB, "
          f"act rows {n_tiles * 128 * I * 2 / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
