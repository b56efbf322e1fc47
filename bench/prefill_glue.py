"""The prefill kernels' XLA glue alone: forms of the x-row gather and of the combine, against the copy ceiling.

At 8K tokens (Qwen shape) the two Mosaic GPU kernels take ~0.8 ms and the glue ~0.33 ms around them:
the row gather ``x_rows [R_pad, H]`` (249 us) and the weighted combine (81 us) (bench/RESULTS.md,
session 10). This times candidate forms of each in isolation, every one checked against the current
one on the rows the kernels read, so the next change to `ftjax.pallas.routing` can pick by measurement:

- gather ``select``: the padded rows, ``where(is_route, x[token], 0)`` (the form up to session 10);
- gather ``take``: ``x[token]`` with padding rows pointing at token 0 (no select; padding rows hold
  a real row instead of zeros: no route reads them, and they stay finite);
- gather ``take-u32``: the same on ``x`` viewed as uint32 words (2 bf16 per element: fewer, wider
  loads and stores for XLA's gather loop; uint64 needs jax_enable_x64);
- gather ``input-rows``: `routing.gather_input_rows`, the kernels' input: groups aligned to 8
  rows instead of padded to the row tile (kernel 1 reads tile m from ``plan.tile_row0[m]``), u32 take;
- gather ``input-tma``: the same rows by TMA row copies (`ftjax.pallas.row_gather`, the prefill's
  ``gather="tma"``);
- combine ``current``: `routing.combine_rows`;
- combine ``u32``: the routes' rows gathered as uint32 words (2 bf16), then widened and summed;
- sort ``sort-i32`` / ``sort-u16``: the route sort (stable argsort by expert) on int32 keys (the plan's)
  and on uint16 keys (us, and the ratio to int32).

Bytes per form: what it must move at least (the gather: its output rows written and the rows of x
read once; the combine: the T*k rows read, y written), per second, against a device copy (read +
write) measured in the same run. Usage (GPU): ``python bench/prefill_glue.py [--tokens 8192]``;
``--smoke`` runs tiny shapes on any backend.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.pallas import routing
from ftjax.pallas import row_gather

sys.path.insert(0, str(Path(__file__).parent))
from timing import time_back_to_back_ms, copy_ceiling_gbps  # noqa: E402  (bench/ sibling)


def _token_of_row(plan, num_tokens, k):
    is_route = plan.route_of_row < num_tokens * k
    return jnp.where(is_route, plan.route_of_row // k, 0)


def gather_select(x, plan, k):
    is_route = plan.route_of_row < x.shape[0] * k
    return jnp.where(is_route[:, None], x[_token_of_row(plan, x.shape[0], k)], jnp.zeros((), x.dtype))


def gather_take(x, plan, k):
    return x[_token_of_row(plan, x.shape[0], k)]


def gather_take_u32(x, plan, k):
    T, H = x.shape
    words = jax.lax.bitcast_convert_type(x.reshape(T, H // 2, 2), jnp.uint32)
    rows = words[_token_of_row(plan, T, k)]
    return jax.lax.bitcast_convert_type(rows, x.dtype).reshape(rows.shape[0], H)


def combine_current(rows, plan, w):
    return routing.combine_rows(rows, plan, w)


def combine_u32(rows, plan, w):
    T, k = w.shape
    R, H = rows.shape
    valid = plan.row_of_route < R
    words = jax.lax.bitcast_convert_type(rows.reshape(R, H // 2, 2), jnp.uint32)
    picked = words[jnp.where(valid, plan.row_of_route, 0)]
    picked = jax.lax.bitcast_convert_type(picked, rows.dtype).reshape(T * k, H).astype(jnp.float32)
    wv = jnp.where(valid, w.reshape(-1).astype(jnp.float32), 0.0)
    contrib = jnp.where(valid[:, None], picked * wv[:, None], 0.0)
    return contrib.reshape(T, k, H).sum(axis=1)


def gather_input(x, plan, k):
    return routing.gather_input_rows(x, plan)


def gather_input_tma(x, plan, k):
    """The same input rows by TMA row copies (`row_gather`, the prefill's ``gather="tma"``)."""
    num_sms = jax.devices()[0].core_count if jax.default_backend() == "gpu" else 2
    return row_gather.gather_rows(x, plan.token_of_input_row, num_sms=num_sms,
                                  interpret=jax.default_backend() != "gpu")


GATHERS = {"select": gather_select, "take": gather_take, "take-u32": gather_take_u32,
           "input-rows": gather_input, "input-tma": gather_input_tma}
COMBINES = {"current": combine_current, "u32": combine_u32}


def _timed_row(glue, name, f, args, nbytes, copy, iters):
    """Time ``f(*args)`` back to back, print its table row, return its record."""
    ms = time_back_to_back_ms(f, *args, iters=iters)
    gbps = nbytes / ms / 1e6
    print(f"{glue:<9} {name:<10} {ms * 1e3:>8.1f} {gbps:>7.0f} {gbps / copy:>6.2f}")
    return dict(us=ms * 1e3, gbps=gbps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tile-m", type=int, default=128, help="the prefill kernels' row tile (padding per group)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any backend")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "prefill_glue.json")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tokens, args.hidden, args.experts, args.iters = 64, 256, 16, 2
    T, H, E, k = args.tokens, args.hidden, args.experts, args.top_k
    if H % 2:
        ap.error("--hidden must be even (the uint32 views)")
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (T, H), jnp.bfloat16)
    ids = jnp.argsort(jax.random.uniform(ks[1], (T, E)), axis=1)[:, :k].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[2], (T, k)), axis=-1)
    plan = jax.jit(routing.plan_routes, static_argnums=(2, 3))(ids, jnp.ones((T,), bool), E, args.tile_m)
    R = plan.route_of_row.shape[0]
    route_rows = np.asarray(plan.route_of_row) < T * k  # the rows the kernels read
    copy = 1.0 if args.smoke else copy_ceiling_gbps()
    print(f"{jax.devices()[0]} | {T} tokens, H {H}, {E} experts, top-{k}, tile_m {args.tile_m}: {R} padded rows "
          f"({int(route_rows.sum())} routes) | device copy ceiling {copy:.0f} GB/s (read + write)")
    rows_out, out = {}, {}
    print(f"{'glue':<9} {'form':<10} {'us':>8} {'GB/s':>7} {'/copy':>6}")
    # where each padded row's token sits in the kernels' input rows (tile m from tile_row0[m] on)
    in_row = np.asarray(plan.tile_row0)[np.arange(R) // args.tile_m] + np.arange(R) % args.tile_m
    for name, fn in GATHERS.items():
        f = jax.jit(fn, static_argnums=2)
        got = np.asarray(f(x, plan, k))
        rows_out[name] = got
        mine = got[in_row[route_rows]] if name.startswith("input-") else got[route_rows]
        if name != "select" and not np.array_equal(mine, rows_out["select"][route_rows]):
            print(f"gather {name}: rows differ from select", file=sys.stderr)
            return 1
        gather_bytes = 2 * got.shape[0] * H * 2  # rows written + the same rows read (x's rows, repeated)
        out[f"gather/{name}"] = _timed_row("gather", name, f, (x, plan, k), gather_bytes, copy, args.iters)
        out[f"gather/{name}"]["rows"] = got.shape[0]
    rows = jnp.asarray(rows_out["select"])
    combine_bytes = T * k * H * 2 + T * H * 4
    want = None
    for name, fn in COMBINES.items():
        f = jax.jit(fn)
        got = np.asarray(f(rows, plan, w))
        if want is None:
            want = got
        elif not np.array_equal(got, want):
            print(f"combine {name}: differs from current", file=sys.stderr)
            return 1
        out[f"combine/{name}"] = _timed_row("combine", name, f, (rows, plan, w), combine_bytes, copy, args.iters)
    # the route sort's key width: int32 keys (the plan's) against uint16 (E + 1 < 2**16), same order
    key = jnp.where(jnp.ones((T * k,), bool), ids.reshape(-1), E)
    sort_us = {}
    for name, dtype in (("sort-i32", jnp.int32), ("sort-u16", jnp.uint16)):
        f = jax.jit(lambda kk, _d=dtype: jnp.argsort(kk.astype(_d), stable=True).astype(jnp.int32))
        if not np.array_equal(np.asarray(f(key)), np.asarray(jnp.argsort(key, stable=True))):
            print(f"{name}: order differs", file=sys.stderr)
            return 1
        sort_us[name] = time_back_to_back_ms(f, key, iters=args.iters) * 1e3
        print(f"{'sort':<9} {name:<10} {sort_us[name]:>8.1f} {'':>7} {sort_us[name] / sort_us['sort-i32']:>6.2f}"
              f"  (of sort-i32)")
        out[f"sort/{name}"] = dict(us=sort_us[name])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(device=str(jax.devices()[0]), tokens=T, hidden=H, experts=E, top_k=k,
                                        padded_rows=R, copy_gbps=copy, forms=out), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
