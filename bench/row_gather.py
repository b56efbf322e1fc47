"""Can prefill kernel 1 gather its x rows itself? One TMA copy per row against one per tile (Hopper).

A probe for issue 5 (bench/RESULTS.md, session 10): at 8K tokens, Qwen shape, the XLA gather that
builds ``x_rows`` costs 249 us beside 0.8 ms of kernels. Hopper has no TMA gather (gather4 is
Blackwell only), and Mosaic GPU refuses a per-row slice of a tiled SMEM ref ("slice start and size
must be divisible by the tile size (8)"); a swizzle-only SMEM ref takes per-row copies but WGMMA's
layout inference refuses it as an operand. What lowers (checked on the CPU, session 10): a
``plgpu.RefUnion`` of a swizzle-only view (the per-row copies land there) and a tiled+swizzled view of
the same bytes (WGMMA's A operand). For a 64-element (128-byte) row the two layouts are the same
bytes, but Pallas does not promise that the union's views start at the same offset, and interpret
mode does not alias them: only a GPU run can say whether it computes the right thing, and how much
the 128 row copies per k-step cost against one tile copy.

Two kernels of the same structure: a persistent grid over 128-row tiles; per tile, K / 64 steps,
double-buffered (step k + 1's copies in flight while step k's WGMMA runs), then the fp32 tile out:
- ``dense``: the A tile is one TMA copy of 128 rows of ``x_rows`` (what kernel 1 reads today);
- ``rows``: the A tile is 128 TMA copies of one row of ``x`` each, rows picked by an index list.
Both checked against jnp; timed back to back; the table gives us per call, TFLOP/s, rows / dense.
Usage (GPU): ``python bench/row_gather.py [--tokens 8192]``.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

sys.path.insert(0, str(Path(__file__).parent))
from timing import time_back_to_back_ms  # noqa: E402  (bench/ sibling)

TM, TK = 128, 64
STAGES = 2


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def row_tile_matmul(idx, x, w, *, gather: bool, num_sms: int, interpret: bool = False):
    """``o[r] = x[idx[r]] @ w`` (gather) or ``x[r] @ w`` (dense; ``x`` is then ``x_rows``), fp32.
    ``idx [R]`` int32, ``x [T, K]`` bf16, ``w [K, N]`` bf16; R a multiple of 128, K of 64, N <= 256."""
    plgpu = _plgpu()
    R = idx.shape[0]
    K, N = w.shape
    k_steps, n_tiles = K // TK, R // TM
    swz = plgpu.find_swizzle(TK * 16)
    tiled = (plgpu.TilingTransform((8, swz * 8 // 16)), plgpu.SwizzleTransform(swz))
    w_tiled = (plgpu.TilingTransform((8, plgpu.find_swizzle(N * 16) * 8 // 16)),
               plgpu.SwizzleTransform(plgpu.find_swizzle(N * 16)))

    def kernel(idx_ref, x_gmem, w_gmem, o_gmem, a_union, b_smem, o_smem, a_bar, b_bar):
        a_rows, a_mma = a_union

        def issue(t, k, slot):
            if gather:
                for r in range(TM):
                    plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(idx_ref[t * TM + r], 1), pl.ds(k * TK, TK)],
                                            a_rows.at[slot, pl.ds(r, 1)], a_bar.at[slot])
            else:
                plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(t * TM, TM), pl.ds(k * TK, TK)], a_mma.at[slot],
                                        a_bar.at[slot])
            plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(k * TK, TK)], b_smem.at[slot], b_bar.at[slot])

        @plgpu.nd_loop((n_tiles,), collective_axes="sm")
        def _tile(info):
            (t,) = info.index

            @functools.partial(pl.run_scoped, acc=plgpu.ACC((TM, N), jnp.float32))
            def _acc(acc):
                issue(t, 0, 0)

                def step(k, carry):
                    slot = lax.rem(k, STAGES)

                    @pl.when(k + 1 < k_steps)
                    def _next():
                        issue(t, k + 1, lax.rem(k + 1, STAGES))

                    plgpu.barrier_wait(a_bar.at[slot])
                    plgpu.barrier_wait(b_bar.at[slot])
                    plgpu.wgmma(acc, a_mma.at[slot], b_smem.at[slot])
                    plgpu.wgmma_wait(0)  # before the slot is refilled two steps later
                    return carry

                lax.fori_loop(0, k_steps, step, None)
                plgpu.wait_smem_to_gmem(0)
                o_smem[...] = acc[...]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(t * TM, TM)])

        plgpu.wait_smem_to_gmem(0)

    union = plgpu.RefUnion(plgpu.SMEM((STAGES, TM, TK), x.dtype, transforms=(plgpu.SwizzleTransform(swz),)),
                           plgpu.SMEM((STAGES, TM, TK), x.dtype, transforms=tiled))
    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((R, N), jnp.float32), grid=(num_sms,), grid_names=("sm",),
        num_threads=1, thread_name="wg",
        scratch_types=dict(a_union=union, b_smem=plgpu.SMEM((STAGES, TK, N), w.dtype, transforms=w_tiled),
                           o_smem=plgpu.SMEM((TM, N), jnp.float32),
                           a_bar=plgpu.Barrier(num_arrivals=TM if gather else 1, num_barriers=STAGES),
                           b_bar=plgpu.Barrier(num_arrivals=1, num_barriers=STAGES)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    return call(idx, x, w)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048, help="K")
    ap.add_argument("--cols", type=int, default=128, help="N (the CTA's output columns)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "row_gather.json")
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("needs JAX's GPU backend (Hopper): interpret mode does not alias a RefUnion's views", file=sys.stderr)
        return 2
    T, K, N = args.tokens, args.hidden, args.cols
    R = T * args.top_k // TM * TM
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (T, K), jnp.bfloat16)
    w = (0.05 * jax.random.normal(ks[1], (K, N))).astype(jnp.bfloat16)
    idx = jax.random.randint(ks[2], (R,), 0, T, jnp.int32)
    x_rows = x[idx]
    want = np.asarray(jnp.dot(x_rows, w, preferred_element_type=jnp.float32))
    num_sms = jax.devices()[0].core_count
    flops = 2 * R * K * N
    rows = {}
    print(f"{jax.devices()[0]}: {R} rows x K {K} x N {N} ({T} tokens x top-{args.top_k}), {num_sms} CTAs")
    print(f"{'A tile':<22} {'us':>9} {'TFLOP/s':>8} {'max err':>9}")
    for name, gather, src in (("dense (one TMA/tile)", False, x_rows), ("rows (one TMA/row)", True, x)):
        fn = jax.jit(functools.partial(row_tile_matmul, gather=gather, num_sms=num_sms))
        try:
            got = np.asarray(fn(idx, src, w))
        except Exception as e:  # noqa: BLE001  (a probe: report what Mosaic GPU refused)
            print(f"{name:<22} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            rows[name] = dict(error=str(e)[:500])
            continue
        err = float(np.abs(got - want).max() / np.abs(want).max())
        us = 1e3 * time_back_to_back_ms(fn, idx, src, w, iters=args.iters)
        rows[name] = dict(us=us, tflops=flops / us / 1e6, rel_err=err)
        print(f"{name:<22} {us:>9.1f} {flops / us / 1e6:>8.1f} {err:>9.2e}")
    if all("us" in r for r in rows.values()):
        d, g = (rows[n]["us"] for n in rows)
        print(f"rows / dense time: {g / d:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(device=str(jax.devices()[0]), R=R, K=K, N=N, rows=rows), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
