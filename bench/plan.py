"""The per-layer cost of the expert-cache plan (``ftjax.experts.plan``) on its own, per policy rule.

At batch 1 the offloaded decode step pays ~40-65 us per layer more than the resident step beyond its
expert transfers (bench/RESULTS.md, session 7); the plan runs on that critical path before every fill.
This times one jitted step of ``--layers`` chained plan calls (routing from the calibrated synthetic
trace, a warm cache) and prints us per layer for:

- ``resident``: the bookkeeping every policy pays (dedup, slot lookup, CPU route list, statistics);
  the floor the others are measured against (ratio = floor / row);
- ``lru-split`` / ``lru-fill``: the full plan with LRU victims, as the decode step runs it;
- the same with ``victims int32``: the LRU victims ranked by one int32 top-k (before session 7), which
  XLA:GPU lowers to a sort of every slot where the f32 age top-k of rounds of 16 is its own kernel;
- the same with ``victims rank`` (``plan_layer(victims_by="rank")``): ranked by counting over all slot
  pairs, two reduction kernels instead of the top-k kernels (16 us each per layer on the H200 at 3,788
  slots, session 8);
- every row in the three update forms of ``plan_layer(impl=...)``: ``scatter`` (the default: one XLA
  scatter per update), ``mixed`` (the call-sized parts as selects, the global maps by scatter) and
  ``dense`` (selects over whole arrays against the call's short id lists).

Runs on any backend (the figures mean something on the GPU).
    python bench/plan.py --slots 3788 1126 --batches 1 4
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.experts import plan as plan_mod
from ftjax.experts.cache import CacheGeometry, init_cache_state
from ftjax.experts.traces import synthetic_trace


def int32_victims(last_use, step, count):
    """The pre-session-7 ranking: one int32 top-k of -last_use (a sort of all slots on XLA:GPU)."""
    _, idx = jax.lax.top_k(-last_use, count)
    return idx.astype(jnp.int32), jnp.minimum(jnp.sum(last_use < step, dtype=jnp.int32), count)


def make_step(L, E, rule, update, impl, victims_by="topk"):
    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, ids):  # ids [L, T, k]
        out = jnp.zeros((), jnp.int32)
        for layer in range(L):
            p, cache = plan_mod.plan_layer(cache, layer, ids[layer], jnp.ones((ids.shape[1],), bool),
                                           num_experts=E, rule=rule, update=update, impl=impl,
                                           victims_by=victims_by)
            # consume the plan's outputs so none is dead code
            out = out + p.n_fill + p.n_cpu_routes + p.fill_slots.sum() + p.route_slot.sum() + p.cpu_routes[0]
        return out, cache

    return step


def time_variant(L, E, S, trace, rule, update, steps, warm, impl, victims_by="topk"):
    geom = CacheGeometry(L, E, S, hidden=1, inter=1)  # banks are not touched by the plan
    cache = init_cache_state(geom, jnp.float32, fill_fraction=0.35)
    n = trace.ids.shape[0]  # [n, L, B, k]
    feed = jax.block_until_ready([jnp.asarray(trace.ids[i % n]) for i in range(warm + steps)])  # on the device
    step = make_step(L, E, rule, update, impl, victims_by)
    for i in range(warm):  # fill the cache (the plan alone: every miss it fills takes a slot)
        _, cache = step(cache, feed[i])
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    for i in range(steps):
        out, cache = step(cache, feed[warm + i])
    jax.block_until_ready((out, cache))
    return (time.perf_counter() - t0) / steps / L * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--slots", type=int, nargs="+", default=[3788, 1126], help="cache sizes (37%%, 11%% of 40 x 256)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--impls", nargs="+", default=list(plan_mod.PLAN_IMPLS), choices=plan_mod.PLAN_IMPLS,
                    help="plan_layer update forms to time")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "plan.json"))
    args = ap.parse_args(argv)
    L, E, k = args.layers, args.experts, args.top_k
    if not all(1 <= S <= L * E for S in args.slots):
        ap.error(f"--slots must be in [1, layers x experts = {L * E}], got {args.slots}")
    print(f"backend {jax.default_backend()}; {L} layers x {E} experts, top-{k}; synthetic trace routing; "
          f"us per layer (one jitted step of {L} chained plans, {args.steps} steps, warm cache)")
    print(f"{'slots':>6} {'batch':>5} {'variant':35} {'us/layer':>9} {'floor/row':>9}")
    rows = []
    original = plan_mod.lru_victims
    for S in args.slots:
        for B in args.batches:
            trace = synthetic_trace(512, L, E, k, batch=B, seed=B)
            warm = -(-5 * S // (4 * L)) + 16
            floor = time_variant(L, E, S, trace, "none", False, args.steps, 8, "scatter")
            res = [("resident (floor)", floor)] + [
                (f"resident, {impl}", time_variant(L, E, S, trace, "none", False, args.steps, 8, impl))
                for impl in args.impls if impl != "scatter"]
            for impl in args.impls:
                for name, rule, victims, by in (
                        ("lru-split", "balance", original, "topk"), ("lru-fill", "all", original, "topk"),
                        ("lru-split, victims int32", "balance", int32_victims, "topk"),
                        ("lru-split, victims rank", "balance", original, "rank"),
                        ("lru-fill, victims rank", "all", original, "rank")):
                    plan_mod.VICTIM_METHODS["topk"] = victims
                    try:
                        us = time_variant(L, E, S, trace, rule, True, args.steps, warm, impl, by)
                    finally:
                        plan_mod.VICTIM_METHODS["topk"] = original
                    res.append((name + ("" if impl == "scatter" else f", {impl}"), us))
            for name, us in res:
                print(f"{S:6d} {B:5d} {name:35} {us:9.1f} {floor / us:9.2f}", flush=True)
                rows.append({"slots": S, "batch": B, "variant": name, "us_per_layer": us})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"backend": jax.default_backend(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
