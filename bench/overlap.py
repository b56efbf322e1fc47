"""Can an expert fill run beside other GPU work inside one jitted step? (GPU machine)

At batch 1 a layer that misses one expert waits for one PCIe fill (6.3 MB, ~129 us on the H200) on its
critical path: every kernel of the step runs on XLA's one compute stream (bench/RESULTS.md, session 8).
This measures whether the fill can run beside independent GPU work of the same step, so a fill could be
hidden behind compute (a fill issued early, used later).

Per layer ``l`` of one jitted step of ``--layers`` layers:
- fill: the product's `expert_fill` FFI kernel copies ``--fill-experts`` experts (Qwen3.6 shape, bf16)
  from the pinned host pool into a staging bank, zero-copy over PCIe; fills chain through the staging
  bank only, never through the work;
- work: a chain of GPU compute of about a fill's length that does not touch the staging bank (a gather
  GEMV over 8 cached experts and ``--matmuls`` [B, H] x [H, H] matmuls, each layer's input the last
  layer's output).

Variants (each its own executable, same inputs): work only; fills only; both in program order on one
stream (XLA's default); both with every fill under ``compute_on('gpu_stream:1')`` (XLA's stream
annotation: the fill on a second stream, joined where its result is used); both with every fill forked
by the experimental FFI pair `cuda.expert_fill_fork` / `cuda.join_banks` (the fill kernel on a side stream
of ours after an event on XLA's stream, one join at the end; these two calls run outside command
buffers); "bg", the decode step's form of background fills (`cuda.background_wait` for each layer
inside the command buffer, one `cuda.background_fork` of every layer's fill after the last layer: the
fills of a step run beside the next step's work). ``overlap = (work + fill -
both) / min(work, fill)``: 0 means the two ran one after the other, 1 means the shorter one was hidden.
Layer l's fill is issued after layer l-1's work (a data dependency; without it XLA scheduled every
fork after all the work: serial, session 9), and for the fork layer l's work is issued after the fork.
Each fill variant runs once per ``--blocks`` value: the fill kernel's thread blocks in all (0: enough to
occupy every SM, as the decode step's fill does; session 9 found that such a fill leaves no SM to the
work beside it, whatever the stream).
``--profile DIR`` also traces 3 steps of each (``bench/trace_summary.py DIR --steps 3``: a busy union
below the kernel sum means kernels ran at the same time).

    python bench/overlap.py [--layers 40] [--fill-experts 1] [--matmuls 4] [--blocks 0 16 32 64 132]
                            [--profile /tmp/ov]
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

from ftjax.experts.interface import expert_mlp  # noqa: E402
from ftjax.host import cuda, measure  # noqa: E402


def make_steps(pool, args):
    """Executables keyed (mode, blocks): mode work / fill / both / side / fork; blocks = the fill kernel's
    thread blocks in all (0: as many as occupy the GPU), None for work."""
    L, F = args.layers, args.fill_experts
    n_pool = pool.n_experts

    def fill_with(fn, blocks):  # layer l fills experts l*F .. l*F+F-1 (mod the pool) into staging slots 0..F-1
        def fill(stage_gu, stage_dn, layer, after=None):
            ids = (jnp.arange(F, dtype=jnp.int32) + layer * F) % n_pool
            if after is not None:  # issued after the work before it (XLA may otherwise move it anywhere)
                ids, _ = jax.lax.optimization_barrier((ids, after))
            return fn(ids, jnp.arange(F, dtype=jnp.int32), jnp.int32(F), stage_gu, stage_dn, pool, blocks=blocks)
        return fill

    def work(x, gu, dn, w, layer):
        slots = (jnp.arange(8, dtype=jnp.int32) * 7 + layer) % gu.shape[0]
        y = expert_mlp(jnp.broadcast_to(x[:1], (8, x.shape[1])), gu[slots], dn[slots]).sum(0, keepdims=True)
        h = x + y.astype(x.dtype)
        for _ in range(args.matmuls):
            h = jnp.tanh(h @ w).astype(x.dtype)
        return h

    from jax.experimental.compute_on import compute_on

    def fills(mode, blocks):
        fill = fill_with(cuda.expert_fill, blocks)
        if mode == "side":
            return compute_on(compute_type="gpu_stream:1",
                              out_memory_spaces=(jax.memory.Space.Device, jax.memory.Space.Device))(
                lambda a, b, layer, after=None: fill(a, b, layer, after))
        return fill_with(cuda.expert_fill_fork, blocks) if mode == "fork" else fill

    def bg_step(blocks):
        """The decode step's form (OffloadExperts defer_fills): each layer waits for its own fill of the
        last step (inside the command buffer), one fork of every layer's fill after the last layer."""
        bg = cuda.create_background(L, F)

        def f(x, gu, dn, w, stage_gu, stage_dn):
            for layer in range(L):
                # ordered as in the decode step (where layer l reads the waited bank): the wait after layer
                # l-1's work, layer l's work after the wait. Unordered, XLA hoisted all 40 waits to the start
                # of the step, which then waited for the whole last fill (session 10: 7.86 ms, overlap 0.4)
                stage_gu, x = jax.lax.optimization_barrier((stage_gu, x))
                stage_gu, stage_dn = cuda.background_wait(stage_gu, stage_dn, bg, layer)
                x, stage_gu = jax.lax.optimization_barrier((x, stage_gu))
                x = work(x, gu, dn, w, layer)
            ids = (jnp.arange(L * F, dtype=jnp.int32).reshape(L, F)) % n_pool
            slots = jnp.broadcast_to(jnp.arange(F, dtype=jnp.int32), (L, F))
            ids, x = jax.lax.optimization_barrier((ids, x))
            stage_gu, stage_dn = cuda.background_fork(ids, slots, jnp.full((L,), F, jnp.int32), stage_gu, stage_dn,
                                                      pool, bg, blocks=blocks or 16)
            return x, stage_gu, stage_dn
        return jax.jit(f, donate_argnums=(4, 5))

    def step(mode, blocks):
        if mode == "bg":
            return bg_step(blocks)
        fill = fills(mode, blocks) if mode != "work" else None

        def f(x, gu, dn, w, stage_gu, stage_dn):
            for layer in range(L):
                if fill is not None:
                    stage_gu, stage_dn = fill(stage_gu, stage_dn, layer, None if mode == "fill" else x)
                if mode == "fork":  # the work after the fork is issued after it (its GPU work is not)
                    x, _ = jax.lax.optimization_barrier((x, stage_gu))
                if mode != "fill":
                    x = work(x, gu, dn, w, layer)
            if mode == "fork":  # the forked fills are read only through the join
                stage_gu, stage_dn = cuda.join_banks(stage_gu, stage_dn)
            return x, stage_gu, stage_dn
        return jax.jit(f, donate_argnums=(4, 5))

    steps = {("work", None): step("work", None)}
    for blocks in args.blocks:
        for mode in ("fill", "both", "side", "fork", "bg"):
            steps[(mode, blocks)] = step(mode, blocks)
    return steps


def time_step(fn, inputs, reps):
    x, gu, dn, w, sgu, sdn = inputs
    for _ in range(3):
        x_out, sgu, sdn = fn(x, gu, dn, w, sgu, sdn)
    jax.block_until_ready((x_out, sgu, sdn))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x_out, sgu, sdn = fn(x, gu, dn, w, sgu, sdn)
        jax.block_until_ready((x_out, sgu, sdn))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3, (x, gu, dn, w, sgu, sdn)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--fill-experts", type=int, default=1, help="experts filled per layer")
    ap.add_argument("--matmuls", type=int, default=4, help="[B, H] x [H, H] matmuls per layer of work")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--slots", type=int, default=256, help="cached experts the work's GEMV reads")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--blocks", type=int, nargs="+", default=[0, 16, 32, 64, 132],
                    help="fill kernel thread blocks in all, one set of variants each (0: occupy the GPU)")
    ap.add_argument("--profile", type=Path, metavar="DIR")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "overlap.json")
    args = ap.parse_args(argv)
    if not cuda.available():
        print("needs the CUDA build of ftjax._host, a GPU and JAX's GPU backend", file=sys.stderr)
        return 2
    shape = measure.ExpertShape(2048, 512)
    H, I, F = shape.hidden, shape.inter, args.fill_experts
    pool = measure.make_pool(shape, "bf16", 2 * args.layers * F * shape.expert_bytes("bf16"))
    pool.pin()
    key = jax.random.key(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    inputs = (jax.random.normal(k1, (args.batch, H), jnp.bfloat16),
              (0.02 * jax.random.normal(k2, (args.slots, 2 * I, H))).astype(jnp.bfloat16),
              (0.02 * jax.random.normal(k3, (args.slots, H, I))).astype(jnp.bfloat16),
              (0.02 * jax.random.normal(k4, (H, H))).astype(jnp.bfloat16),
              jnp.zeros((F, 2 * I, H), jnp.bfloat16), jnp.zeros((F, H, I), jnp.bfloat16))
    if any(b < 0 for b in args.blocks):
        ap.error("--blocks must be >= 0")
    steps = make_steps(pool, args)
    last = ((args.layers - 1) * F) % pool.n_experts  # staging slot 0 holds this expert after a step
    want = pool.raw("gate_up").view(np.uint16).reshape(pool.n_experts, -1)[last, :4096]

    def filled(stage_gu):
        return bool(np.array_equal(np.asarray(jax.lax.bitcast_convert_type(stage_gu[0], jnp.uint16)).ravel()[:4096],
                                   want))

    ms, errors, ok = {}, {}, {}
    for key, fn in steps.items():
        mode, blocks = key
        try:
            ms[key], inputs = time_step(fn, inputs, args.reps)
            if mode != "work":
                if mode == "bg":  # its last fills are still running beside nothing
                    cuda.sync_fills()
                ok[key] = filled(inputs[4])
                inputs = inputs[:4] + (jnp.zeros((F, 2 * I, H), jnp.bfloat16), jnp.zeros((F, H, I), jnp.bfloat16))
        except Exception as e:  # noqa: BLE001  (an experiment: report what XLA refused, go on)
            errors[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            inputs = inputs[:4] + (jnp.zeros((F, 2 * I, H), jnp.bfloat16), jnp.zeros((F, H, I), jnp.bfloat16))
            continue
        if args.profile and blocks in (None, args.blocks[0], args.blocks[-1]):
            x, gu, dn, w, sgu, sdn = inputs
            with jax.profiler.trace(str(args.profile / f"{mode}-b{blocks}"), create_perfetto_trace=True):
                for _ in range(3):
                    x_out, sgu, sdn = fn(x, gu, dn, w, sgu, sdn)
                jax.block_until_ready((x_out, sgu, sdn))
            inputs = (x, gu, dn, w, sgu, sdn)
    expert_mb = shape.expert_bytes("bf16") / 1e6
    print(f"{args.layers} layers; per layer: fill {F} x {expert_mb:.1f} MB (expert_fill, pinned pool, zero-copy), "
          f"work = 8-expert gather GEMV + {args.matmuls} matmuls [{args.batch}, {H}] x [{H}, {H}]; every "
          "variant checked: after its steps the staging bank holds the last layer's expert")
    print("blocks: the fill kernel's thread blocks in all (0 = as many as occupy the GPU); overlap = "
          "(work + fill - both) / min(work, fill): 0 = serial, 1 = the shorter one hidden")
    names = {"both": "one stream", "side": "compute_on gpu_stream:1", "fork": "forked (FFI)",
             "bg": "per-step fork, waits"}
    work = ms.get(("work", None))
    print(f"work only: {work:.3f} ms/step, {work * 1e3 / args.layers:.1f} us/layer" if work else
          f"work only failed: {errors.get(('work', None))}")
    print(f"{'blocks':>6} {'fill ms':>8} {'GB/s':>6} " + " ".join(f"{names[m]:>25} {'overlap':>7}" for m in names))
    result = {"ms": {f"{m}@{b}": v for (m, b), v in ms.items()}, "errors": {f"{m}@{b}": v for (m, b), v in errors.items()},
              "filled": {f"{m}@{b}": v for (m, b), v in ok.items()}, "overlap": {},
              "args": {k: str(v) for k, v in vars(args).items()}}
    for blocks in args.blocks:
        fill = ms.get(("fill", blocks))
        gbps = F * args.layers * shape.expert_bytes("bf16") / (fill * 1e-3) / 1e9 if fill else float("nan")
        row = f"{blocks:6d} {fill if fill else float('nan'):8.3f} {gbps:6.1f} "
        for mode in names:
            t = ms.get((mode, blocks))
            if t is None:
                row += f"{'failed':>24} {'':>7} "
                continue
            bad = "" if ok.get((mode, blocks), True) else " WRONG"
            ov = (work + fill - t) / min(work, fill) if work and fill else float("nan")
            result["overlap"][f"{mode}@{blocks}"] = ov
            row += f"{t:17.3f} ms{bad:>5} {ov:7.2f} "
        print(row)
    for key, err in errors.items():
        print(f"{key[0]} @ blocks {key[1]} failed: {err}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(ok.values()) and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
