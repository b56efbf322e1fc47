"""Row gather ``out[i] = x[idx[i]]`` on Mosaic GPU: one TMA load and one TMA store per row, beside its
jnp reference. The prefill's ``gather="tma"`` (not its default: see the measurement below).

The prefill kernels read their input rows in expert order (`routing.gather_input_rows`): ~T*k rows of
``x`` copied into a new buffer, the one XLA glue op of the prefill call that ran well below the device
copy bandwidth on the H200 (XLA's gather fusion: 0.31 GB in 117 us at 8K tokens, 0.60 GB in 255 us at
16K, 0.66-0.74 of a device copy; bench/RESULTS.md, session 16). Here each row is one TMA box: ``x`` is
viewed as ``[T, C, B]`` (``B = min(H, 256)`` elements, ``C = H / B``; a box dimension holds at most 256
elements), so a row of 4-8 KiB moves in one load and one store, with no swizzle and no registers.

Layout: a persistent grid of ``num_sms`` CTAs, one warpgroup each; CTA c takes the contiguous rows
``[c * per, (c + 1) * per)``. It first copies its slice of ``idx`` into SMEM (one TMA copy; the row
numbers are then read from SMEM, not one GMEM round trip per row), then runs a ring of ``slots`` row
buffers: step i issues the load of row i and the store of row ``i - ahead`` (after its load's
barrier), and before reusing a slot waits until the store that last read it has (``wait_smem_to_gmem``
with ``slots - ahead - 1`` stores left in flight). Rows past ``N`` are neither loaded nor stored.

Measured on the H200 (session 16, bench/RESULTS.md): bit-exact; the prefill's input rows at 8K tokens
(67,456 rows of 4 KiB) in 137 us alone (1.11 of the device copy, counting rows written and read)
against 279 us for XLA's take in the same glue benchmark, but inside the prefill call XLA's take
ran 117 us and the call came out 1-3% slower with this kernel: the prefill keeps XLA's take.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_BOX = 256  # elements per dimension of one TMA box
_IDX_LANES = 128  # idx slice copied as [P, 128] int32
_RING_BYTES = 128 * 1024  # SMEM for the row ring


def reference_gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """``x[idx]``: the plain jnp form."""
    return x[idx]


def row_layout(hidden: int, itemsize: int) -> tuple[int, int] | None:
    """``(C, B)`` with ``C * B = hidden`` for the TMA box ``[1, C, B]``, or None where a row cannot
    be one box (``B * itemsize`` a multiple of 16 bytes, ``C <= 256``)."""
    b = min(hidden, _BOX)
    if hidden % b or (b * itemsize) % 16 or hidden // b > _BOX:
        return None
    return hidden // b, b


def supported(x_shape, dtype, num_rows: int, num_sms: int) -> bool:
    """Whether `gather_rows` takes these sizes (else use `reference_gather_rows`)."""
    _, hidden = x_shape
    layout = row_layout(hidden, jnp.dtype(dtype).itemsize)
    per = -(-num_rows // max(num_sms, 1))
    return (layout is not None and num_rows > 0 and x_shape[0] > 0
            and -(-per // _IDX_LANES) <= _BOX and hidden * jnp.dtype(dtype).itemsize * 2 <= _RING_BYTES)


@functools.partial(jax.jit, static_argnames=("num_sms", "interpret"))
def gather_rows(x: jax.Array, idx: jax.Array, *, num_sms: int = 132, interpret: bool = False) -> jax.Array:
    """``x [T, H]``, ``idx [N]`` int32 in ``0..T-1`` -> ``x[idx]`` ``[N, H]``, by TMA row copies.

    Needs `supported` (ValueError otherwise). Indices outside ``0..T-1`` are clamped (a TMA box
    past the end would read zeros; the jnp take clamps too). ``interpret=True`` runs Mosaic GPU
    interpret mode on the CPU.
    """
    num_tokens, hidden = x.shape
    (n,) = idx.shape
    if not supported(x.shape, x.dtype, n, num_sms):
        raise ValueError(f"gather_rows: x {x.shape} {x.dtype} with {n} rows over {num_sms} CTAs is "
                         f"not one TMA box per row (H = C * B, B <= 256 elements of 16-byte multiples, "
                         f"C <= 256) or has no rows; use reference_gather_rows")
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    chunks, box = row_layout(hidden, x.dtype.itemsize)
    per = -(-n // num_sms)
    lanes = -(-per // _IDX_LANES)
    row_bytes = hidden * x.dtype.itemsize
    slots = max(2, min(32, _RING_BYTES // row_bytes))
    ahead = slots // 2
    idx = jnp.clip(idx.astype(jnp.int32), 0, num_tokens - 1)
    idx3 = jnp.pad(jnp.pad(idx, (0, num_sms * per - n)).reshape(num_sms, per),
                   ((0, 0), (0, lanes * _IDX_LANES - per))).reshape(num_sms, lanes, _IDX_LANES)
    x3 = x.reshape(num_tokens, chunks, box)

    def kernel(idx_gmem, x_gmem, o_gmem, idx_smem, ring, idx_bar, row_bar):
        sm = lax.axis_index("sm")
        first = sm * per
        mine = jnp.clip(n - first, 0, per)
        plgpu.copy_gmem_to_smem(idx_gmem.at[pl.ds(sm, 1)], idx_smem, idx_bar.at[0])
        plgpu.barrier_wait(idx_bar.at[0])

        def step(i, carry):
            @pl.when(i < mine)
            def _load():
                # the store that last read this slot (row i - slots) has finished reading it
                plgpu.wait_smem_to_gmem(slots - ahead - 1, wait_read_only=True)
                row = idx_smem[0, i // _IDX_LANES, i % _IDX_LANES]
                slot = lax.rem(i, slots)
                plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(row, 1)], ring.at[slot], row_bar.at[slot])

            @pl.when((i >= ahead) & (i - ahead < mine))
            def _store():
                j = i - ahead
                slot = lax.rem(j, slots)
                plgpu.barrier_wait(row_bar.at[slot])
                plgpu.copy_smem_to_gmem(ring.at[slot], o_gmem.at[pl.ds(first + j, 1)])
            return carry

        lax.fori_loop(0, mine + ahead, step, None)
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((n, chunks, box), x.dtype),
        grid=(num_sms,), grid_names=("sm",), num_threads=1, thread_name="wg",
        kernel_name="mosaic_row_gather",
        scratch_types=dict(
            idx_smem=plgpu.SMEM((1, lanes, _IDX_LANES), jnp.int32),
            ring=plgpu.SMEM((slots, 1, chunks, box), x.dtype),
            idx_bar=plgpu.Barrier(num_arrivals=1, num_barriers=1),
            row_bar=plgpu.Barrier(num_arrivals=1, num_barriers=slots)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return call(idx3, x3).reshape(n, hidden)
