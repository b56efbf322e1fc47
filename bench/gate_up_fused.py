"""The prefill's kernel 1 (gate+up with SwiGLU) alone: the Mosaic GPU kernel on the gathered x rows (XLA's
take + `prefill_gemm._grouped_matmul`) against the CUDA kernel that reads x through the tables
(`gate_up_cuda`, the prefill's ``gather="fused"``): its defaults, several ``x_keep`` (the fraction of x-row reads
marked L2 evict_last), L2 promotions, 3 stages, the rows read in order, and every walk (``--bands``, plus output
blocks fastest) x epilogue (``--epilogues``) x sigmoid (``--silus``). Needs an sm_90 GPU.

Prints per shape and token count: per call back to back (ms) and the ratio of kernel 1's FLOPs (``4 T k H I``)
per second to the dense bf16 matmul ceiling measured in the same run; the route tables are built once, outside
the timed calls (both forms read the same tables). Routing: uniform random top-k (synthetic, no skew) or
the synthetic trace (``--routing trace``), as `bench/kernels.py`.

    python bench/gate_up_fused.py --shapes 2048x512 4096x2048 --tokens 8192 16384 --keep 0 0.5 1
    ncu -k regex:prefill_gate_up --metrics dram__bytes_read.sum python bench/gate_up_fused.py --shapes 2048x512 \
        --tokens 8192 --once
"""
from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

from kernels import _inputs, routing_label
from timing import dense_ceiling_tflops, time_back_to_back_ms, time_steady_ms
from ftjax.pallas import gate_up_cuda
from ftjax.pallas import prefill_gemm as pg
from ftjax.pallas import prefill_options
from ftjax.pallas import route_tables
from ftjax.pallas import routing


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["2048x512", "4096x2048"], help="HxI")
    ap.add_argument("--tokens", nargs="+", type=int, default=[8192, 16384])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--keep", nargs="*", type=float, default=[0.0, 1.0],
                    help="x_keep values of the fused kernel (its default is also run)")
    ap.add_argument("--promotions", nargs="*", default=["none", "128"], choices=tuple(gate_up_cuda.W_PROMOTIONS),
                    help="weights' TMA L2 promotions to run beside the default")
    ap.add_argument("--bands", nargs="*", type=int, default=[2],
                    help="walk bands of the fused kernel's tiles to run beside the output-blocks-fastest walk")
    ap.add_argument("--epilogues", nargs="+", default=list(gate_up_cuda.EPILOGUES), choices=gate_up_cuda.EPILOGUES,
                    help="the epilogue forms timed at every walk (--bands and the output-blocks-fastest walk)")
    ap.add_argument("--silus", nargs="+", default=list(gate_up_cuda.SILUS), choices=gate_up_cuda.SILUS,
                    help="the epilogue's sigmoid forms timed at every walk and epilogue")
    ap.add_argument("--routing", choices=("uniform", "trace"), default="uniform")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--once", action="store_true",
                    help="run each form once, untimed (under ncu -k regex:prefill_gate_up: one kernel 1 per form, "
                         "the Mosaic forms' first; the ceiling is still measured)")
    ap.add_argument("--out", default=None, help="JSON rows")
    ap.set_defaults(one_expert=False)
    args = ap.parse_args()
    if not gate_up_cuda.available():
        raise SystemExit("needs the sm_90a CUDA part of ftjax._host and an sm_90 GPU on JAX's GPU backend")
    ceiling = dense_ceiling_tflops()
    num_sms = prefill_options.default_num_sms()
    print(f"ceiling: dense bf16 matmul {ceiling:.0f} TFLOP/s; routing: {routing_label(args)}; {num_sms} SMs")
    print("kernel 1 (gate+up, SwiGLU) per call back to back, ms (ratio to the ceiling); steady = rounds of "
          f"{2 * args.iters} less rounds of {args.iters}")
    rows = []
    for shape in args.shapes:
        hidden, inter = map(int, shape.split("x"))
        for T in args.tokens:
            (x, ids, _, valid), (gate_up, _), slots = _inputs(jax.random.key(T), T, args.top_k, hidden, inter,
                                                              args.experts, args.experts, False,
                                                              routing=args.routing)

            def tables_walked(band):  # the route tables with kernel 1's tiles walked in expert bands of `band`
                return jax.block_until_ready(route_tables.route_tables(
                    ids, valid, slots, n_slots=gate_up.shape[0], tile=128,
                    walks=((inter // 128, band), (hidden // 256, None)),
                    impl=route_tables.resolve_impl("auto", args.experts)))

            # each kernel with the prefill's "auto" walk: the Mosaic kernel's by its output blocks, the fused one's
            mosaic_band = prefill_options.walk_bands("auto", (inter // 128, hidden // 256))[0]
            fused_band = prefill_options.walk_bands("auto", (inter // 128, hidden // 256), fused=True)[0]
            tables, fused_tables = tables_walked(mosaic_band), tables_walked(fused_band)
            flops = 4 * T * args.top_k * hidden * inter

            def mosaic_no_gather(x_rows, tables, w):  # the prefill's kernel 1 with its defaults (bf16)
                return pg._grouped_matmul(x_rows, tables.tile_slot, tables.tile_row0, tables.tile_rows,
                                          tables.n_launch, (w,), n_out=inter, swiglu=True, tile_m=128, tile_n=64,
                                          tile_k=64, stages=3, num_sms=num_sms, interpret=False,
                                          cross_tile=False, walk=tables.walks[0])

            def mosaic(x, tables, w):
                return mosaic_no_gather(routing.gather_input_rows(x, tables), tables, w)

            x_rows = jax.block_until_ready(jax.jit(routing.gather_input_rows)(x, tables))
            forms = [("mosaic (take + kernel)", jax.jit(mosaic), (x, tables, gate_up)),
                     ("mosaic kernel alone", jax.jit(mosaic_no_gather), (x_rows, tables, gate_up))]
            for keep in [None] + list(args.keep):
                shown = f"default {gate_up_cuda.default_x_keep(x.shape):.3f}" if keep is None else keep
                name = f"fused x_keep {shown}"
                fn = jax.jit(functools.partial(gate_up_cuda.gate_up, num_sms=num_sms, x_keep=keep))
                forms.append((name, fn, (x, fused_tables, gate_up)))
            for promo in args.promotions:
                forms.append((f"fused, weights L2 promotion {promo}", jax.jit(functools.partial(
                    gate_up_cuda.gate_up, num_sms=num_sms, w_promotion=promo)), (x, fused_tables, gate_up)))
            forms.append(("fused, 3 stages", jax.jit(functools.partial(gate_up_cuda.gate_up, num_sms=num_sms,
                                                                       stages=3)), (x, fused_tables, gate_up)))
            # the same kernel on the gathered rows read in order (token of input row i = i): what the row
            # gather itself costs the kernel
            in_order = fused_tables._replace(token_of_input_row=jnp.arange(x_rows.shape[0], dtype=jnp.int32))
            forms.append(("fused on x_rows in order", jax.jit(functools.partial(gate_up_cuda.gate_up, num_sms=num_sms,
                                                                                x_keep=0.0)),
                          (x_rows, in_order, gate_up)))
            # the tiles walked per expert band (`routing.tile_walk`: same tiles, other order; 0: output blocks
            # fastest) x the epilogue's stores x its sigmoid, less the fused default form (already above)
            for band in [0] + list(args.bands):
                walked = tables_walked(band or None)
                for epilogue in args.epilogues:
                    for silu in args.silus:
                        if (band or None) == fused_band and epilogue == "smem" and silu == "exp":
                            continue
                        name = f"fused, walk {band or 'rows'}, {epilogue}, {silu}"
                        forms.append((name, jax.jit(functools.partial(gate_up_cuda.gate_up, num_sms=num_sms,
                                                                      epilogue=epilogue, silu=silu)),
                                      (x, walked, gate_up)))
            rows_of = jnp.arange(tables.tile_rows.shape[0] * 128)
            live = (rows_of % 128 < tables.tile_rows[rows_of // 128]) & (rows_of // 128 < tables.n_launch[0])
            ref = None
            for name, fn, fargs in forms:
                out = jax.block_until_ready(fn(*fargs))
                if ref is None:
                    ref = out
                # rows past a tile's routes are undefined in both kernels: compare the rows that hold routes
                diff = float(jnp.max(jnp.where(live[:, None], jnp.abs(out.astype(jnp.float32)
                                                                      - ref.astype(jnp.float32)), 0.0)))
                if args.once:  # one call per form (already made above), in this order, for a profiler to count
                    print(f"  {shape:>10} T {T:>6}  {name:<30} ran once; max diff vs the first {diff:.2e}", flush=True)
                    continue
                b2b = time_back_to_back_ms(fn, *fargs, iters=args.iters)
                steady = time_steady_ms(fn, *fargs, iters=args.iters)
                r_b2b, r_st = flops / b2b / 1e9 / ceiling, flops / steady / 1e9 / ceiling
                print(f"  {shape:>10} T {T:>6}  {name:<30} b2b {b2b:7.3f} ms {r_b2b:5.2f}  steady {steady:7.3f} ms "
                      f"{r_st:5.2f}  max diff vs the first (rows with routes) {diff:.2e}", flush=True)
                rows.append(dict(shape=shape, tokens=T, form=name, b2b_ms=b2b, steady_ms=steady, b2b_ratio=r_b2b,
                                 steady_ratio=r_st, ceiling_tflops=ceiling, diff=diff))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
