"""Decode grouped GEMV over expert cache slots (Mosaic GPU), beside its jnp reference.

One route r is (token ``tokens[r]``, cache slot ``slots[r]``). For every valid route
(``r < n_valid``, ``n_valid`` a device scalar) it computes the SwiGLU expert output

    y_r = down[s] @ (silu(gate[s] @ x_t) * (up[s] @ x_t))        s = slots[r], t = tokens[r]

with the bank layout of docs/internals.md: ``gate_up [S, 2I, H]`` (rows 0..I-1 gate,
I..2I-1 up), ``down [S, H, I]``, torch [out, in] orientation. Output ``[R, H]`` fp32, zero for
invalid routes. The caller applies the router weights and sums over routes.

Kernel layout: grid ``(R, n_split)``; block (r, p) streams I-blocks ``p*nb .. (p+1)*nb`` of
route r's expert: ``bi`` gate rows, ``bi`` up rows and the ``[H, bi]`` down columns, each
a TMA copy GMEM -> SMEM, then GEMV in registers with fp32 accumulation, and writes a partial
``[H]`` sum; the wrapper sums the ``n_split`` partials. Blocks of invalid routes issue no copy
(``pl.when``) and their uninitialised partials are masked out; ``n_valid == 0`` skips the kernel
entirely (``lax.cond``) because Mosaic GPU hung once on an all-empty launch. A last partial
I-block is read at the clamped start ``I - bi`` with the already-covered rows masked, so no
copy goes out of bounds and the cache is never padded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def reference_decode_experts(x, slots, tokens, n_valid, gate_up, down):
    """Plain jnp reference: per-route SwiGLU expert outputs [R, H] fp32, zeros for r >= n_valid."""
    inter = down.shape[-1]
    xf = x.astype(jnp.float32)[tokens]  # [R, H]
    w_gu = gate_up[slots].astype(jnp.float32)  # [R, 2I, H]
    w_d = down[slots].astype(jnp.float32)  # [R, H, I]
    hi = lax.Precision.HIGHEST
    gu = jnp.einsum("rih,rh->ri", w_gu, xf, precision=hi)
    act = jax.nn.silu(gu[:, :inter]) * gu[:, inter:]
    y = jnp.einsum("rhi,ri->rh", w_d, act, precision=hi)
    valid = jnp.arange(slots.shape[0]) < n_valid
    return jnp.where(valid[:, None], y, 0.0)


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def _kernel_body(n_blocks, nb_per_split, bi, inter):
    from jax.experimental import pallas as pl

    plgpu = _plgpu()

    def body(n_ref, slots_ref, tokens_ref, x_ref, gu_ref, down_ref, o_ref,
             x_smem, g_smem, u_smem, d_smem, o_smem, bars):
        r = lax.axis_index("r")
        p = lax.axis_index("p")

        @pl.when(r < n_ref[0])
        def _():
            slot = slots_ref[r]
            tok = tokens_ref[r]
            plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(tok, 1)], x_smem, bars.at[0])
            plgpu.barrier_wait(bars.at[0])
            xv = x_smem[...].astype(jnp.float32)  # [1, H]

            def step(j, acc):
                # Clamp the last partial block back inside [0, I); mask rows already done.
                start = jnp.minimum(j * bi, inter - bi)
                plgpu.copy_gmem_to_smem(gu_ref.at[slot, pl.ds(start, bi)], g_smem, bars.at[1])
                plgpu.copy_gmem_to_smem(
                    gu_ref.at[slot, pl.ds(inter + start, bi)], u_smem, bars.at[2])
                plgpu.copy_gmem_to_smem(down_ref.at[slot, :, pl.ds(start, bi)], d_smem, bars.at[3])
                plgpu.barrier_wait(bars.at[1])
                plgpu.barrier_wait(bars.at[2])
                g = jnp.sum(g_smem[...].astype(jnp.float32) * xv, axis=1)  # [bi]
                u = jnp.sum(u_smem[...].astype(jnp.float32) * xv, axis=1)
                rows = start + lax.broadcasted_iota(jnp.int32, (bi,), 0)
                a = jnp.where(rows >= j * bi, jax.nn.silu(g) * u, 0.0)
                plgpu.barrier_wait(bars.at[3])
                return acc + jnp.sum(d_smem[...].astype(jnp.float32) * a[None, :], axis=1)

            j0 = p * nb_per_split
            j1 = jnp.minimum(j0 + nb_per_split, n_blocks)
            acc = lax.fori_loop(j0, j1, step, jnp.zeros(o_smem.shape[-1], jnp.float32))
            o_smem[...] = acc[None, :]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[r, pl.ds(p, 1)])
            plgpu.wait_smem_to_gmem(0)

    return body


@functools.partial(jax.jit, static_argnames=("block_i", "n_split", "interpret"))
def decode_experts(x, slots, tokens, n_valid, gate_up, down, *, block_i=8, n_split=2,
                   interpret=False):
    """Mosaic GPU decode grouped GEMV; same contract as `reference_decode_experts`.

    x [T, H] bf16/f32; slots, tokens [R] i32; n_valid i32 scalar (device); gate_up [S, 2I, H],
    down [S, H, I] bf16. Returns [R, H] fp32. `interpret=True` runs Mosaic GPU interpret mode
    (CPU). `block_i` gate/up rows per step (clamped to I); `n_split` splits each route's I range
    over that many grid blocks whose fp32 partials the wrapper sums.
    """
    plgpu = _plgpu()
    num_routes = slots.shape[0]
    hidden = x.shape[1]
    inter = down.shape[-1]
    if gate_up.shape[1:] != (2 * inter, hidden) or down.shape[1] != hidden:
        raise ValueError(f"bank shapes {gate_up.shape}, {down.shape} do not match x {x.shape}")
    bi = min(block_i, inter)
    n_blocks = -(-inter // bi)
    n_split = max(1, min(n_split, n_blocks))
    nb_per_split = -(-n_blocks // n_split)
    n_valid = jnp.asarray(n_valid, jnp.int32).reshape(1)

    kernel = plgpu.kernel(
        _kernel_body(n_blocks, nb_per_split, bi, inter),
        out_type=jax.ShapeDtypeStruct((num_routes, n_split, hidden), jnp.float32),
        scratch_types=[
            plgpu.SMEM((1, hidden), x.dtype),
            plgpu.SMEM((bi, hidden), gate_up.dtype),
            plgpu.SMEM((bi, hidden), gate_up.dtype),
            plgpu.SMEM((hidden, bi), down.dtype),
            plgpu.SMEM((1, hidden), jnp.float32),
            plgpu.Barrier(num_barriers=4),
        ],
        grid=(num_routes, n_split),
        grid_names=("r", "p"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )

    def run(_):
        return kernel(n_valid, slots.astype(jnp.int32), tokens.astype(jnp.int32), x, gate_up,
                      down).sum(axis=1)

    y = lax.cond(n_valid[0] > 0, run,
                 lambda _: jnp.zeros((num_routes, hidden), jnp.float32), None)
    valid = jnp.arange(num_routes) < n_valid[0]
    return jnp.where(valid[:, None], y, 0.0)
