"""Pallas expert kernels on the GPU: prefill grouped GEMM and decode grouped GEMV against ceilings.

Ceilings measured in the same run, fastest of their runs: a plain bf16 matmul ([8192, 8192] @ [8192,
8192], random data; TFLOP/s), a device-to-device copy (2 GiB, bytes read + written; GB/s) and a
device read (2 GiB summed; GB/s).

- prefill (``ftjax.pallas.prefill_gemm``): per (H, I), token count and weight type, the kernel's
  time, useful TFLOP/s (``prefill_flops``) and its ratio to the matmul ceiling; ``--ragged`` adds the
  ``lax.ragged_dot`` baseline (bf16). Routing: uniform random top-k over E experts per token, or
  (``--routing trace``) the synthetic routing trace's per-layer Zipf popularity, one trace step per token.
- decode (``ftjax.pallas.decode_gemv``): 1-8 tokens x top-k routes into a cache of S slots, the
  weight bytes actually read (``decode_bytes_read``) per second and the ratio to the copy ceiling;
  beside it the jnp gather path (gather the routed slots, einsum). Timed as ``--decode-calls`` calls
  on different slot lists inside one jitted scan (a per-call host sync would add ~50-100 us to
  kernels of tens of us).

GPU machine (Hopper). Writes bench/out/kernels.json.
    python bench/kernels.py                               # everything
    python bench/kernels.py --only decode --decode-tokens 1 8
    python bench/kernels.py --smoke                       # tiny shapes, Mosaic GPU interpret mode (CPU)
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp

from ftjax.experts.interface import expert_mlp
from ftjax.pallas import decode_gemv as dg
from ftjax.pallas import prefill_gemm as pg
from timing import (copy_ceiling_gbps, dense_ceiling_tflops, read_ceiling_gbps, time_ms,  # bench/ sibling
                    time_back_to_back_ms, time_steady_ms)


def _rand_bank(key, shape, kind):
    """A random bank [S, ...] generated one slot at a time (lax.map), so the generator's f32 / u32
    temporaries are one slot, not the whole bank (XLA asked 128 GiB for a 40 GiB bank in one go).
    kind: "normal" (bf16, std 0.02), "u8" (uniform bytes) or "scale" (bf16 in [0, 0.02))."""
    def one(k):
        if kind == "normal":
            return (jax.random.normal(k, shape[1:], jnp.float32) * 0.02).astype(jnp.bfloat16)
        if kind == "scale":
            return (jax.random.uniform(k, shape[1:]) * 0.02).astype(jnp.bfloat16)
        words = jax.random.bits(k, (*shape[1:-1], shape[-1] // 4), jnp.uint32)
        return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape[1:])
    return jax.jit(lambda keys: jax.lax.map(one, keys, batch_size=8))(jax.random.split(key, shape[0]))


def _decode_inputs(key, T, k, H, I, S, int4):
    ks = jax.random.split(key, 5)
    x = jax.random.normal(ks[0], (T, H), jnp.bfloat16)
    R = T * k
    slots = jax.random.choice(ks[1], S, (R,), replace=False).astype(jnp.int32)
    tokens = jnp.repeat(jnp.arange(T, dtype=jnp.int32), k)
    if int4:
        banks = (_rand_bank(ks[2], (S, 2 * I, H // 2), "u8"), _rand_bank(ks[3], (S, 2 * I, H // 32), "scale"),
                 _rand_bank(ks[4], (S, H, I // 2), "u8"), _rand_bank(ks[3], (S, H, I // 32), "scale"))
    else:
        banks = (_rand_bank(ks[2], (S, 2 * I, H), "normal"), _rand_bank(ks[4], (S, H, I), "normal"))
    return x, slots, tokens, banks


def time_per_call_us(fn, x, slot_sets, tokens, n, banks, iters, profile_dir=None):
    """Device time of one call: ``fn`` over ``len(slot_sets)`` different slot lists back to back inside
    one jitted scan (fresh experts each call, so no L2 reuse; no per-call dispatch or host sync).
    With ``profile_dir``, one more scan runs under the profiler (``bench/trace_summary.py DIR --steps
    1`` then lists the kernels of all the calls: their own time without the scan's loop)."""
    @jax.jit
    def many(x, slot_sets, tokens, n, *banks):
        def body(acc, slots):
            return acc + fn(x, slots, tokens, n, *banks)[0, 0], None
        return jax.lax.scan(body, jnp.float32(0), slot_sets)[0]

    us = 1e3 * time_ms(many, x, slot_sets, tokens, n, *banks, iters=iters) / slot_sets.shape[0]
    if profile_dir is not None:
        with jax.profiler.trace(str(profile_dir), create_perfetto_trace=True):
            jax.block_until_ready(many(x, slot_sets, tokens, n, *banks))
    return us


def gpu_kernel_us(profile_dir):
    """(Mosaic GPU kernels, every GPU kernel): summed device us in the profiler traces under the dir."""
    from trace_summary import gpu_kernels, load  # bench/ is the script's directory

    ks = [e for p in Path(profile_dir).rglob("perfetto_trace.json.gz") for e in gpu_kernels(load(p))]
    return sum(e["dur"] for e in ks if "mosaic" in e["name"]), sum(e["dur"] for e in ks)


def fresh_dir(path):
    """``path``, emptied: the kernel split sums every trace under a dir, and a warm machine keeps the
    dirs of earlier runs (session 21: a trace-routed run summed an earlier uniform run's kernels)."""
    shutil.rmtree(path, ignore_errors=True)
    return path


def prefill_kernel_us(profile_dir):
    """(gate+up kernel, down kernel) summed device us in the traces under the dir (0 if not named)."""
    from trace_summary import gpu_kernels, load

    ks = [e for p in Path(profile_dir).rglob("perfetto_trace.json.gz") for e in gpu_kernels(load(p))]
    return tuple(sum(e["dur"] for e in ks if tag in e["name"]) for tag in ("prefill_gate_up", "prefill_down"))


def mosaic_kernel_us(profile_dir, calls):
    """Mean device time of the Mosaic GPU kernel per call in a profiler trace (None if none found)."""
    us = gpu_kernel_us(profile_dir)[0]
    return us / calls if us else None


def gather_decode(x, slots, tokens, n_valid, gate_up, down):
    """Baseline: the jnp gather path (gather the routed slots' weights, batched GEMVs)."""
    y = expert_mlp(x[tokens], gate_up[slots], down[slots]).astype(jnp.float32)
    return jnp.where((jnp.arange(slots.shape[0]) < n_valid)[:, None], y, 0.0)


DECODE_SWEEP = dict(block_i=(32, 64), block_k=(128, 256, 512), num_stages=(2, 3, 4))
DECODE_SWEEP_INT4 = dict(block_i=(32, 64), block_k=(256, 512, 1024), num_stages=(2, 3, 4))


def bench_decode(args, copy_gbps, read_gbps, rows):
    print(f"\ndecode grouped GEMV: cache {args.slots_decode} slots, top-{args.top_k}; copy ceiling "
          f"{copy_gbps:.0f} GB/s (read + write), read ceiling {read_gbps:.0f} GB/s")
    print(f"{'H':>5} {'I':>5} {'T':>3} {'dtype':>5} {'us':>8} {'GB/s':>7} {'/copy':>6} {'/read':>6} "
          f"{'gather us':>10} {'err':>8}" + (f" {'kernel us':>9} {'/copy':>6}" if args.profile else "")
          + "  best of sweep")
    if args.profile:
        print("us: per call in a jitted scan (the kernel, its XLA glue - slot clamps, x operand, the sum over "
              "chunks - and the loop); kernel us: the Mosaic GPU kernel alone (profiler)")
    kw = dict(interpret=True) if args.smoke else {}
    for shape in args.shapes:
        H, I = map(int, shape.split("x"))
        for dtype in args.dtypes:
            int4 = dtype == "int4"
            S = args.slots_decode
            if not args.smoke:  # keep the cache under ~40 GiB
                S = min(S, int(40 * 2**30 // (3 * H * I * (0.53 if int4 else 2))))
            f = dg.decode_experts_int4 if int4 else dg.decode_experts
            for T in args.decode_tokens:
                x, slots, tokens, banks = _decode_inputs(jax.random.key(T), T, args.top_k, H, I, S, int4)
                R = slots.shape[0]
                n = jnp.int32(R)
                slot_sets = jnp.stack([jax.random.choice(jax.random.key(100 + i), S, (R,), replace=False)
                                       for i in range(args.decode_calls)]).astype(jnp.int32)
                nbytes = dg.decode_bytes_read(R, H, I, int4=int4)

                def timed(**cfg):
                    fn = jax.jit(lambda *a: f(*a, **kw, **cfg))
                    return fn, time_per_call_us(fn, x, slot_sets, tokens, n, banks, args.iters)

                fn, us = timed()
                kernel_us = None
                if args.profile:  # the kernel's own device time, beside the scan's per-call figure
                    pdir = args.profile / f"decode-{shape}-{dtype}-T{T}"
                    time_per_call_us(fn, x, slot_sets, tokens, n, banks, 1, profile_dir=pdir)
                    kernel_us = mosaic_kernel_us(pdir, args.decode_calls)
                got = fn(x, slots, tokens, n, *banks)
                ref_fn = dg.reference_decode_experts_int4 if int4 else dg.reference_decode_experts
                ref = jax.jit(ref_fn)(x, slots, tokens, n, *banks)
                err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
                gbps = nbytes / us / 1e3
                row = dict(kind="decode", H=H, I=I, T=T, routes=R, slots=S, dtype=dtype, us=us, gbps=gbps,
                           ratio=gbps / copy_gbps, read_ratio=gbps / read_gbps, rel_err=err,
                           copy_ceiling_gbps=copy_gbps, read_ceiling_gbps=read_gbps)
                if kernel_us:
                    row.update(kernel_us=kernel_us, kernel_ratio=nbytes / kernel_us / 1e3 / copy_gbps)
                if not int4:
                    row["gather_us"] = time_per_call_us(gather_decode, x, slot_sets, tokens, n, banks, args.iters)
                best = ""
                if args.tune_decode and shape in args.tune_shapes and T in args.tune_tokens:
                    sweep = DECODE_SWEEP_INT4 if int4 else DECODE_SWEEP
                    row["sweep"] = []
                    for bi in sweep["block_i"]:
                        for bk in sweep["block_k"]:
                            for ns in sweep["num_stages"]:
                                cfg = dict(block_i=bi, block_k=bk, num_stages=ns)
                                try:
                                    row["sweep"].append(dict(cfg, us=timed(**cfg)[1]))
                                except ValueError as e:  # tiles that do not fit this shape / SMEM
                                    row["sweep"].append(dict(cfg, error=str(e)[:120]))
                    ok = [r for r in row["sweep"] if "us" in r]
                    if ok:
                        b = min(ok, key=lambda r: r["us"])
                        best = (f"  {b['us']:.1f} us = {nbytes / b['us'] / 1e3 / copy_gbps:.2f} of copy "
                                f"(bi {b['block_i']}, bk {b['block_k']}, stages {b['num_stages']})")
                rows.append(row)
                kern = (f" {kernel_us:>9.1f} {row['kernel_ratio']:>6.2f}" if kernel_us else "") if args.profile else ""
                print(f"{H:>5} {I:>5} {T:>3} {dtype:>5} {us:>8.1f} {gbps:>7.0f} {row['ratio']:>6.2f} "
                      f"{row['read_ratio']:>6.2f} {row.get('gather_us', float('nan')):>10.1f} {err:>8.1e}" + kern
                      + best, flush=True)
                del banks


def bench_prefill_tiles(args, ceiling, rows):
    """Tile sweep of the prefill kernel at one shape and token count (bf16): which tiles to default to."""
    H, I = map(int, args.tune_prefill.split("x"))
    T = max(args.tokens)
    route, banks, slots = _inputs(jax.random.key(T), T, args.top_k, H, I, args.experts, args.slots, False,
                                  routing=args.routing)
    flops = pg.prefill_flops(T, args.top_k, H, I)
    print(f"\nprefill tile sweep: H {H}, I {I}, {T} tokens, bf16 (matmul ceiling {ceiling:.0f} TFLOP/s)")
    configs = [dict(tile_m=tm, tile_k=tk, tile_n_gate_up=tng, tile_n_down=tnd, stages=st)
               for tk in (64, 128) for tm in ((64, 128) if tk == 64 else (128,))
               for tng in (64, 128) for tnd in (64, 128) for st in ((3, 4) if tk == 64 else (2, 3))]
    for cfg in configs:
        tm, tk, tng, tnd, st = (cfg[key] for key in ("tile_m", "tile_k", "tile_n_gate_up", "tile_n_down", "stages"))
        try:
            fn = jax.jit(lambda *a, _c=cfg: pg.prefill_experts(*a, **_c))
            ms = time_back_to_back_ms(fn, *route, *banks, slots, iters=args.iters)
        except (ValueError, jax.errors.JaxRuntimeError) as e:
            rows.append(dict(kind="prefill_tile", H=H, I=I, T=T, **cfg, error=str(e)[:160]))
            print(f"  tile_m {tm:>3} tile_k {tk:>3} tile_n gate_up {tng:>3} down {tnd:>3} stages {st}: "
                  f"{type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        tf = flops / ms / 1e9
        rows.append(dict(kind="prefill_tile", H=H, I=I, T=T, **cfg, b2b_ms=ms, tflops=tf, ratio=tf / ceiling))
        print(f"  tile_m {tm:>3} tile_k {tk:>3} tile_n gate_up {tng:>3} down {tnd:>3} stages {st}: {ms:7.3f} ms "
              f"b2b {tf:7.1f} TFLOP/s {tf / ceiling:5.2f}", flush=True)


def kernel_split(row, kernel_us, flops, ceiling):
    """Record the gate+up and down kernels' own times (us, from `prefill_kernel_us`) and their ratios
    to the ceiling in ``row`` (gate+up does 2/3 of the FLOPs, down 1/3); return the text ("" if a
    kernel was not found in the trace)."""
    k1_us, k2_us = kernel_us
    if not (k1_us and k2_us):
        return ""
    row.update(gate_up_ms=k1_us / 1e3, down_ms=k2_us / 1e3,
               gate_up_ratio=flops * 2 / 3 / k1_us / 1e6 / ceiling,
               down_ratio=flops / 3 / k2_us / 1e6 / ceiling)
    return (f"  gate+up {k1_us / 1e3:.3f} ms = {row['gate_up_ratio']:.2f}, down "
            f"{k2_us / 1e3:.3f} ms = {row['down_ratio']:.2f}")


PIPELINE_CONFIGS = {  # (name, kwargs): the per-tile ring against a CTA's tiles as one pipeline
    # gate+up fused with the row gather where it can run (CUDA, sm_90; session 23), else per-tile 3 stages on XLA's
    # take; down cross-tile 4 (bf16; session 22); walk "auto", plan "auto"
    "default": {},
    "xla gather": dict(gather="xla"),  # the default before session 23: XLA's take, then the Mosaic gate+up kernel
    "jnp plan": dict(plan_impl="jnp"),  # the route tables by XLA (`routing.plan_routes`), not one CUDA call
    "per-tile s3": dict(stages=3, cross_tile=False, walk_band=None),  # the default before session 20
    "per-tile s3 tma-gather": dict(stages=3, cross_tile=False, gather="tma", walk_band=None),
    # kernel 1 as a CUDA call reading x through the tables (`gate_up_cuda`, sm_90): no x-row gather
    "fused gather": dict(gather="fused"),
    # the fused kernel 1's walk (expert bands of 2 row tiles), its epilogue stores and its sigmoid (session 24)
    "fused walk2": dict(gather="fused", walk_band=(2, None)),
    "fused smem": dict(gather="fused", fused_options=(("epilogue", "smem"),)),
    "fused tanh": dict(gather="fused", fused_options=(("silu", "tanh"),)),
    "fused walk2 smem tanh": dict(gather="fused", walk_band=(2, None),
                                  fused_options=(("epilogue", "smem"), ("silu", "tanh"))),
    # the tiles walked per expert band (neighbouring CTAs share a weight block, `routing.tile_walk`)
    "per-tile s3 walk2": dict(stages=3, cross_tile=False, walk_band=2),
    "per-tile s3 walk3": dict(stages=3, cross_tile=False, walk_band=3),
    "per-tile s3 walk4": dict(stages=3, cross_tile=False, walk_band=4),
    "per-tile s3 walk2/4": dict(stages=3, cross_tile=False, walk_band=(2, 4)),  # (gate+up, down)
    "cross s4 walk4": dict(stages=4, cross_tile=True, walk_band=4),
    # one pipeline per kernel: gate+up per-tile 3 stages, down (few k-steps at the Qwen shape) cross-tile 4
    "gu s3, down cross s4": dict(stages=(3, 4), cross_tile=(False, True)),
    "per-tile s4": dict(stages=4, cross_tile=False, walk_band=None),
    "cross s4": dict(stages=4, cross_tile=True, walk_band=None),
    "cross s2": dict(stages=2, cross_tile=True, walk_band=None),
    "cross k128 s2": dict(tile_k=128, stages=2, cross_tile=True, walk_band=None),
    # 256-row tiles (an expert of <= 256 routes in one row tile; n32 WGMMAs): measured slower
    "m256 s3": dict(tile_m=256, tile_n_gate_up=32, tile_n_down=64, stages=3, cross_tile=False, walk_band=None),
}


def chained_layers(fn, n_layers, num_experts):
    """``n_layers`` prefill layers in one jitted call, as a model's prefill step runs them: layer l
    routes to the experts ``(ids + 37 l) % E`` (the same group sizes, other experts) and takes the
    previous layer's output (cast to bf16) as its input. Returns the last layer's bf16 output."""
    def run(x, ids, w, valid, *banks_and_slots):
        for layer in range(n_layers):
            x = fn(x, (ids + 37 * layer) % num_experts, w, valid, *banks_and_slots).astype(jnp.bfloat16)
        return x
    return jax.jit(run)


def bench_prefill_pipeline(args, ceiling, rows):
    """The prefill configurations (`PIPELINE_CONFIGS`) at each --tokens, every --shapes / --dtypes: b2b and
    steady; with --profile also the gate+up and down kernels' own times (ratios to the same ceiling); with
    --chain N also per layer of N layers in one executable (`chained_layers`)."""
    for T in args.tokens:
        _prefill_pipeline_at(args, T, ceiling, rows)


def _prefill_pipeline_at(args, T, ceiling, rows):
    print(f"\nprefill pipelines, {T} tokens, routing: {routing_label(args)}"
          + f" (matmul ceiling {ceiling:.0f} TFLOP/s; b2b = per call of {args.iters} calls back to back; steady = "
          + f"per call, rounds of {2 * args.iters} less rounds of {args.iters} calls"
          + (f"; in-step = per layer of {args.chain} layers in one jitted call, each layer's output its "
             f"next input, b2b and steady" if args.chain else "") + ")")
    for shape in args.shapes:
        H, I = map(int, shape.split("x"))
        flops = pg.prefill_flops(T, args.top_k, H, I)
        for dtype in args.dtypes:
            int4 = dtype == "int4"
            route, banks, slots = _inputs(jax.random.key(T), T, args.top_k, H, I, args.experts,
                                          args.slots, int4, args.one_expert, args.routing)
            base = pg.prefill_experts_int4 if int4 else pg.prefill_experts
            first_out = None  # each configuration's output against the first's (printed, not asserted)
            for name, cfg in PIPELINE_CONFIGS.items():
                if args.configs and name not in args.configs:
                    continue
                row = dict(kind="prefill_pipeline", H=H, I=I, T=T, dtype=dtype, config=name, routing=args.routing,
                           **cfg)
                try:
                    fn = jax.jit(lambda *a, _c={**args.smoke_tiles, **cfg}: base(*a, **_c))
                    ms = time_back_to_back_ms(fn, *route, *banks, slots, iters=args.iters)
                except (ValueError, jax.errors.JaxRuntimeError) as e:
                    rows.append(dict(row, error=str(e)[:160]))
                    print(f"  {shape} {dtype} {name:>14}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                    continue
                row.update(b2b_ms=ms, ratio=flops / ms / 1e9 / ceiling)
                out = fn(*route, *banks, slots)
                if first_out is None:
                    first_out = out
                row["max_abs_diff_vs_first"] = float(jnp.max(jnp.abs(out - first_out)))
                del out
                steady = time_steady_ms(fn, *route, *banks, slots, iters=args.iters)
                row.update(steady_ms=steady, steady_ratio=flops / steady / 1e9 / ceiling)
                split = f"  steady {steady:7.3f} ms {row['steady_ratio']:5.2f}  diff {row['max_abs_diff_vs_first']:.1e}"
                if args.chain:
                    chain = chained_layers(lambda *a, _c={**args.smoke_tiles, **cfg}: base(*a, **_c), args.chain,
                                           args.experts)
                    step_ms = time_back_to_back_ms(chain, *route, *banks, slots, iters=max(2, args.iters // 2))
                    chain_steady = time_steady_ms(chain, *route, *banks, slots, iters=max(2, args.iters // 2))
                    row.update(in_step_ms=step_ms / args.chain,
                               in_step_ratio=flops * args.chain / step_ms / 1e9 / ceiling,
                               in_step_steady_ms=chain_steady / args.chain,
                               in_step_steady_ratio=flops * args.chain / chain_steady / 1e9 / ceiling)
                    split += (f"  in-step {row['in_step_ms']:7.3f} ms {row['in_step_ratio']:5.2f}"
                              f" (steady {row['in_step_steady_ms']:7.3f} ms {row['in_step_steady_ratio']:5.2f})")
                if args.profile:
                    pdir = fresh_dir(args.profile / f"pipeline-{shape}-{dtype}-T{T}-{args.routing}-"
                                                    f"{name.replace(' ', '_')}")
                    with jax.profiler.trace(str(pdir), create_perfetto_trace=True):
                        jax.block_until_ready(fn(*route, *banks, slots))
                    split += kernel_split(row, prefill_kernel_us(pdir), flops, ceiling)
                rows.append(row)
                print(f"  {shape} {dtype} {name:>14}: b2b {ms:7.3f} ms {row['ratio']:5.2f}" + split,
                      flush=True)
            del banks


def routing_label(args):
    """What the prefill rows route by, for the tables' headers."""
    if args.one_expert:
        return "every route to expert 0"
    if args.routing == "trace":
        return (f"the synthetic trace (ftjax.experts.traces: per-layer Zipf popularity over {args.experts} experts, "
                f"top-{args.top_k}; token t = step t)")
    return f"uniform random top-{args.top_k} of {args.experts} experts (synthetic, no popularity skew)"


def _inputs(key, T, k, H, I, E, S, int4, one_expert=False, routing="uniform"):
    ks = jax.random.split(key, 6)
    x = jax.random.normal(ks[0], (T, H), jnp.bfloat16)
    if routing == "trace":  # a sequence's tokens routed like the decode benchmarks' trace steps (skewed)
        from ftjax.experts.traces import synthetic_trace

        trace = synthetic_trace(T, 1, E, k, seed=T)
        ids, w = jnp.asarray(trace.ids[:, 0, 0]), jnp.asarray(trace.weights[:, 0, 0])
    else:
        ids = jnp.argsort(jax.random.uniform(ks[1], (T, E)), axis=1)[:, :k].astype(jnp.int32)
        w = jax.nn.softmax(jax.random.normal(ks[2], (T, k)), axis=-1)
    if one_expert:  # every route to expert 0: one group, a plain GEMM through the grouped kernels
        ids = jnp.zeros_like(ids)
    valid = jnp.ones((T,), bool)
    slots = jax.random.permutation(ks[3], S)[:E].astype(jnp.int32)
    if int4:
        banks = (_rand_bank(ks[4], (S, 2 * I, H // 2), "u8"), jnp.full((S, 2 * I, H // 32), 0.01, jnp.bfloat16),
                 _rand_bank(ks[5], (S, H, I // 2), "u8"), jnp.full((S, H, I // 32), 0.01, jnp.bfloat16))
    else:
        banks = (_rand_bank(ks[4], (S, 2 * I, H), "normal"), _rand_bank(ks[5], (S, H, I), "normal"))
    return (x, ids, w, valid), banks, slots


def ragged_dot_moe(x, ids, w, valid, gate_up, down, slots):
    """Baseline: the same layer with lax.ragged_dot over expert-sorted routes (no slot skipping)."""
    T, k = ids.shape
    inter = down.shape[-1]
    order = jnp.argsort(ids.reshape(-1))
    xs = jnp.repeat(x, k, axis=0)[order]
    sizes = jnp.bincount(ids.reshape(-1), length=slots.shape[0]).astype(jnp.int32)
    gu = jax.lax.ragged_dot(xs, jnp.swapaxes(gate_up[slots], 1, 2), sizes)
    act = (jax.nn.silu(gu[:, :inter].astype(jnp.float32)) * gu[:, inter:]).astype(x.dtype)
    out = jax.lax.ragged_dot(act, jnp.swapaxes(down[slots], 1, 2), sizes)
    y = jnp.zeros((T * k, x.shape[1]), jnp.float32).at[order].set(out.astype(jnp.float32))
    return jnp.where(valid[:, None], (y.reshape(T, k, -1) * w[..., None]).sum(1), 0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--shapes", nargs="+", default=["2048x512", "4096x2048"], help="HxI")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "int4"])
    ap.add_argument("--tile-m", type=int, default=128)
    ap.add_argument("--stages", type=int, default=None,
                    help="both prefill kernels' SMEM ring depth (default: each kernel's own, bf16 3 / 4, int4 3 / 3)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ragged", action="store_true", help="also time the lax.ragged_dot baseline")
    ap.add_argument("--routing", choices=["uniform", "trace"], default="uniform",
                    help="prefill: uniform random top-k per token, or the synthetic routing trace's skewed "
                         "popularity (ftjax.experts.traces, one step per token)")
    ap.add_argument("--one-expert", action="store_true",
                    help="prefill: every route to one expert (a plain GEMM through the grouped kernels)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, CPU")
    ap.add_argument("--only", choices=["prefill", "decode"], help="one section only")
    ap.add_argument("--decode-tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--slots-decode", type=int, default=2000, help="decode cache slots (capped at ~40 GiB)")
    ap.add_argument("--decode-calls", type=int, default=64,
                    help="decode calls per timed scan, each on a different slot list")
    ap.add_argument("--tune-decode", action="store_true", help="also sweep the decode kernel's block sizes")
    ap.add_argument("--tune-shapes", nargs="+", default=["2048x512"], help="shapes the decode sweep covers")
    ap.add_argument("--tune-tokens", type=int, nargs="+", default=[1, 8], help="token counts the sweep covers")
    ap.add_argument("--tune-prefill", metavar="HxI", help="sweep the prefill tiles at this shape, max(--tokens)")
    ap.add_argument("--pipelines", action="store_true",
                    help="the prefill configurations (--configs) at each --tokens, then stop")
    ap.add_argument("--configs", nargs="+", choices=list(PIPELINE_CONFIGS), metavar="NAME",
                    help="with --pipelines: only these configurations (default: all; names in PIPELINE_CONFIGS)")
    ap.add_argument("--chain", type=int, default=0, metavar="N",
                    help="with --pipelines: also time N layers in one jitted call (per layer; each layer's "
                         "output the next one's input, as in a model's prefill step)")
    ap.add_argument("--cross-tile", choices=["auto", "on", "off"], default="auto",
                    help="the prefill kernels' cross-tile pipeline (auto: where the stages divide the steps)")
    ap.add_argument("--profile-b2b", type=int, default=0, metavar="N",
                    help="with --profile: also trace N prefill calls dispatched back to back (DIR/b2b-*)")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="also trace one scan of each default decode kernel and one call of each prefill "
                         "(bench/trace_summary.py DIR): the kernels' own time beside the per-call figures")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "kernels.json")
    args = ap.parse_args()

    cross = {"auto": None, "on": True, "off": False}[args.cross_tile]
    kw = dict(tile_m=args.tile_m, cross_tile=cross, **({} if args.stages is None else {"stages": args.stages}))
    args.smoke_tiles = {}  # --pipelines: the configurations' own tiles on the GPU; interpreted small ones in --smoke
    if args.smoke:
        args.tokens, args.shapes, args.experts, args.slots, args.iters = [40], ["256x256"], 8, 8, 1
        args.decode_tokens, args.slots_decode, args.decode_calls = [1], 16, 2
        kw = dict(tile_m=64, tile_n_gate_up=64, tile_n_down=64, stages=2, num_sms=2,
                  interpret=True, cross_tile=cross)
        args.smoke_tiles = {k: v for k, v in kw.items() if k != "cross_tile"}
    ceiling = 1.0 if args.smoke else dense_ceiling_tflops()
    copy_gbps = 1.0 if args.smoke else copy_ceiling_gbps()
    read_gbps = 1.0 if args.smoke else read_ceiling_gbps()
    print(f"ceilings: dense bf16 matmul {ceiling:.0f} TFLOP/s, device copy {copy_gbps:.0f} GB/s, "
          f"device read {read_gbps:.0f} GB/s")
    rows = []
    if args.only != "prefill":
        bench_decode(args, copy_gbps, read_gbps, rows)
    if args.tune_prefill and args.only != "decode":
        bench_prefill_tiles(args, ceiling, rows)
    if args.pipelines:
        bench_prefill_pipeline(args, ceiling, rows)
        args.shapes = []
    if args.only == "decode":
        args.shapes = []
    else:
        print(f"\nprefill grouped expert MLP, routing: {routing_label(args)}")
    print(f"{'H':>5} {'I':>5} {'T':>6} {'dtype':>5} {'ms':>8} {'TFLOP/s':>8} {'ratio':>6} "
          f"{'GB/s':>7} {'b2b ms':>8} {'ratio':>6}   (ms: one call, the host waiting for it; b2b: calls "
          f"dispatched back to back)")
    for shape in args.shapes:
        H, I = map(int, shape.split("x"))
        for dtype in args.dtypes:
            int4 = dtype == "int4"
            fn = jax.jit(lambda *a, _f=(pg.prefill_experts_int4 if int4 else pg.prefill_experts):
                         _f(*a, **kw))
            for T in args.tokens:
                route, banks, slots = _inputs(jax.random.key(T), T, args.top_k, H, I,
                                              args.experts, args.slots, int4, args.one_expert, args.routing)
                ms = time_ms(fn, *route, *banks, slots, iters=args.iters)
                b2b = time_back_to_back_ms(fn, *route, *banks, slots,
                                            iters=1 if args.smoke else max(args.iters, 8))
                split = ""
                if args.profile:  # the Mosaic GPU kernels alone vs every GPU kernel of the call
                    pdir = fresh_dir(args.profile / f"prefill-{shape}-{dtype}-T{T}-{args.routing}")
                    with jax.profiler.trace(str(pdir), create_perfetto_trace=True):
                        jax.block_until_ready(fn(*route, *banks, slots))
                    kern_us, all_us = gpu_kernel_us(pdir)
                    k1_us, k2_us = prefill_kernel_us(pdir)
                    if args.profile_b2b:  # calls back to back under the profiler: the GPU's idle between them
                        with jax.profiler.trace(str(args.profile / f"b2b-{shape}-{dtype}-T{T}"),
                                                create_perfetto_trace=True):
                            jax.block_until_ready([fn(*route, *banks, slots) for _ in range(args.profile_b2b)])
                hit = int(jnp.unique(route[1]).size)
                flops = pg.prefill_flops(T, args.top_k, H, I)
                nbytes = pg.prefill_bytes(T, args.top_k, H, I, hit, int4=int4)
                row = dict(kind="prefill", H=H, I=I, T=T, dtype=dtype, one_expert=args.one_expert, routing=args.routing, ms=ms,
                           tflops=flops / ms / 1e9,
                           ratio=flops / ms / 1e9 / ceiling, gbps=nbytes / ms / 1e6, b2b_ms=b2b,
                           b2b_ratio=flops / b2b / 1e9 / ceiling,
                           experts_hit=hit, ceiling_tflops=ceiling, **{k: v for k, v in kw.items()
                                                                        if k != "interpret"})
                ragged = ""
                if args.ragged and not int4:
                    try:
                        rms = time_ms(jax.jit(ragged_dot_moe), *route, *banks, slots,
                                       iters=args.iters)
                        row["ragged_dot_tflops"] = flops / rms / 1e9
                        ragged = f"  ragged_dot {row['ragged_dot_tflops']:.1f} TFLOP/s"
                    except jax.errors.JaxRuntimeError as e:  # XLA's dense lowering can ask for > HBM
                        row["ragged_dot_error"] = str(e).splitlines()[0][:200]
                        ragged = "  ragged_dot failed: " + row["ragged_dot_error"][:80]
                if args.profile and kern_us:
                    row.update(kernel_ms=kern_us / 1e3, gpu_ms=all_us / 1e3,
                               kernel_ratio=flops / kern_us / 1e6 / ceiling)
                    split = (f"  kernels alone {kern_us / 1e3:.3f} ms = {row['kernel_ratio']:.2f}, all GPU work "
                             f"{all_us / 1e3:.3f} ms")
                    if k1_us and k2_us:
                        split += " (" + kernel_split(row, (k1_us, k2_us), flops, ceiling).strip() + ")"
                rows.append(row)
                print(f"{H:>5} {I:>5} {T:>6} {dtype:>5} {ms:>8.3f} {row['tflops']:>8.1f} "
                      f"{row['ratio']:>6.2f} {row['gbps']:>7.0f} {b2b:>8.3f} {row['b2b_ratio']:>6.2f}"
                      + ragged + split, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(device=str(jax.devices()[0]), matmul_tflops=ceiling,
                                        copy_gbps=copy_gbps, read_gbps=read_gbps, rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
