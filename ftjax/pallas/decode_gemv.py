"""Decode grouped GEMV over expert cache slots (Mosaic GPU, Hopper), bf16 and int4, beside its
jnp references.

One route r is (token ``tokens[r]``, cache slot ``slots[r]``). For every valid route
(``r < n_valid``, ``n_valid`` a device scalar) it computes the SwiGLU expert output

    y_r = down[s] @ (silu(gate[s] @ x_t) * (up[s] @ x_t))        s = slots[r], t = tokens[r]

with the bank layout of docs/internals.md: ``gate_up [S, 2I, H]`` (rows 0..I-1 gate,
I..2I-1 up), ``down [S, H, I]``, torch [out, in] orientation. Output ``[R, H]`` fp32, zero for
invalid routes. The caller applies the router weights and sums over routes. The int4 banks use
the host pool layout (`ftjax.host.quant`): ``packed uint8 [rows, cols/2]`` (column 2j in the low
nibble of byte j) and ``scales bf16 [rows, cols/32]``, value ``(q - 8) * scale``.

Design (memory bound: what matters is bytes in flight per SM)
--------------------------------------------------------------
Grid ``(C, R)`` with ``C = I / block_i``: block (c, r) owns rows ``c*bi .. c*bi+bi`` of route
r's gate and up matrices and the matching ``bi`` columns of down, and writes a partial ``[H]``
fp32 output that the wrapper sums over c (4 H bytes per block, ~2% of its weight bytes).
``block_i`` is chosen from R: 32 while ``R * I / 64`` blocks would not fill two waves of 132
SMs, else 64; so R = 8 routes of I = 512 already make 128 blocks, R = 64 makes 512.

The GEMVs run on the tensor cores with the weights as the wgmma A operand (M = 2*bi rows) and
the token as an N = 8 column B operand (x in column 0), so nothing is reduced over H in
registers:

- gate/up phase: a stage is the ``[2bi, bk]`` tile (bi gate rows above bi up rows) plus the
  ``[8, bk]`` x operand; ``acc[2bi, 8] += W @ X^T``.
- int4: the packed tile is dequantized into registers (low nibbles = even columns, high
  nibbles masked in place = 16x the odd columns, against even / odd halves of x, the odd half
  pre-divided by 16; both exact in bf16). Scales are per 32 columns, so x is spread over the 8
  B columns by group (column n holds the x entries of groups g = n mod 8): after each
  256-column sub-step ``acc[:, n]`` is one group's partial sum and ``sum_n acc * scales`` is
  exact. Gate/up rows are fetched as [even | odd] rows (a free ``[S, I, 2, X]`` view), so the
  activation comes out split by parity, as the nibble split of down needs.
- activation: ``gu[2bi]`` goes through SMEM from the row to the column layout, and
  ``a = silu(g) * u`` is written as the transposed ``[8, bi]`` B operand of the down phase
  (int4: in the column of its scale group mod 8).
- down phase: a stage is a ``[bh, bi]`` column tile of down (int4: packed, plus the ``[bh, 8]``
  window of scales holding its groups); ``acc[bh, 8] = D @ A`` in 256-row wgmmas, reduced over
  the 8 columns (int4: after the scale multiply) and stored.

Pipeline: one warpgroup, two SMEM rings of ``num_stages`` stages (gate/up and down) with one
mbarrier per stage. The prologue issues the first stages of both rings, so the first down tiles
are resident when the gate phase ends; each consumed stage is refilled at once (after a
warpgroup barrier) with the step ``num_stages`` ahead. Defaults for the H200, per block:

====== ==== ===================================== ============================== ========
dtype   bi  gate/up stage                         down stage                     SMEM
====== ==== ===================================== ============================== ========
bf16    32  32 KiB weights + 4 KiB x (bk = 256)   32 KiB (bh = 512)              211 KiB
bf16    64  32 KiB weights + 2 KiB x (bk = 128)   32 KiB (bh = 256)              209 KiB
int4    32  16 + 2 KiB weights + 8 KiB x (512)    16 + 16 KiB scales (1024)      181 KiB
====== ==== ===================================== ============================== ========

with ``num_stages = 3``: one block per SM, ~200 KiB in flight right after the prologue, then
2-3 stages (bf16: 64-108 KiB; int4: 52-96 KiB, of which the x operand and most of the scale
window come from L2) against ~30 GB/s x ~1.5 us = ~45 KiB needed per SM for 4 TB/s over 132
SMs. Besides the weights each block reads its x operand (16 H bytes) and, for int4, an
8-group scale window per down row (8x the down scales it needs); both are L2-resident (x is
tiny, a window is shared by the 8 neighbouring chunks launched together). int4 dequantization
is plain CUDA-core work (mask, convert, subtract) by one warpgroup and may bound it before HBM.

Blocks of invalid routes issue no copy (``pl.when``) and their partials are masked out; so do the
blocks past a route's intermediate units when ``units`` is given (the offload unit split: a slot
whose units ``[u, I)`` are still being filled), and the units past ``u`` inside a block are zeroed
in the activation operand. The
kernel is launched with at least one valid route (``max(n_valid, 1)``, slot ids clamped into the
cache), so no launch is all-empty (Mosaic GPU hung once on one) and no ``lax.cond`` is needed
(XLA:GPU runs a conditional outside a command buffer by copying its predicate to the host and
waiting: a stream sync per call; whether it does so inside this step's graph was not measured).
``n_valid == 0`` costs one expert's reads.
Sizes: bf16 needs ``H % 64 == 0`` and ``I % 32 == 0``; int4 needs ``H % 256 == 0`` and
``I % 256 == 0`` (8 groups of scales = 16 bytes, the smallest TMA row).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from ftjax.pallas.int4 import GROUP, dequantize_int4
NUM_SMS = 132  # H100 / H200
SMEM_BYTES = 227 * 1024  # per block on sm_90
_SMEM_OVERHEAD = 4096  # Mosaic GPU alignment padding and barriers (measured ~2.9 KiB)
_NX = 8  # wgmma N of the x operand: 8 columns, int4 column n = groups g with g % 8 == n
_SUB_H = 256  # down rows per wgmma (accumulator [256, 8] fp32: 16 registers per thread)
_SUB_K4 = 256  # int4 gate columns per dequantized sub-step (8 scale groups)


# ---------------------------------------------------------------------------------------------
# references

def reference_decode_experts(x, slots, tokens, n_valid, gate_up, down, units=None):
    """Plain jnp reference: per-route SwiGLU expert outputs [R, H] fp32, zeros for r >= n_valid.
    ``units [R]`` (optional): route r sums only the intermediate units ``[0, units[r])``."""
    inter = down.shape[-1]
    xf = x.astype(jnp.float32)[tokens]  # [R, H]
    w_gu = gate_up[slots].astype(jnp.float32)  # [R, 2I, H]
    w_d = down[slots].astype(jnp.float32)  # [R, H, I]
    hi = lax.Precision.HIGHEST
    gu = jnp.einsum("rih,rh->ri", w_gu, xf, precision=hi)
    act = jax.nn.silu(gu[:, :inter]) * gu[:, inter:]
    if units is not None:
        act = jnp.where(jnp.arange(inter)[None, :] < units[:, None], act, 0.0)
    y = jnp.einsum("rhi,ri->rh", w_d, act, precision=hi)
    valid = jnp.arange(slots.shape[0]) < n_valid
    return jnp.where(valid[:, None], y, 0.0)


def reference_decode_experts_int4(x, slots, tokens, n_valid, gate_up_packed, gate_up_scales,
                                  down_packed, down_scales, units=None):
    """jnp reference for int4 banks: dequantizes the routed slots, then the bf16 reference math."""
    gate_up = dequantize_int4(gate_up_packed[slots], gate_up_scales[slots])
    down = dequantize_int4(down_packed[slots], down_scales[slots])
    r = jnp.arange(slots.shape[0], dtype=jnp.int32)
    return reference_decode_experts(x, r, tokens, n_valid, gate_up, down, units)


def decode_bytes_read(n_valid, hidden, inter, *, int4=False):
    """Weight bytes a launch with ``n_valid`` valid routes reads (routes sharing a slot count
    twice, as the kernel reads them twice): gate, up and down of each valid route; int4 adds its
    scales. Excludes the x operand and the int4 down scale window over-read (both L2-resident).
    """
    n_weights = 3 * hidden * inter
    per_route = n_weights // 2 + (n_weights // GROUP) * 2 if int4 else n_weights * 2
    return int(n_valid) * per_route


# ---------------------------------------------------------------------------------------------
# plan: block sizes and validation

@dataclasses.dataclass(frozen=True)
class _Plan:
    int4: bool
    hidden: int
    inter: int
    block_i: int  # gate rows (and up rows, and down columns) per block
    block_k: int  # gate/up columns per stage
    block_h: int  # down rows per stage
    num_stages: int

    @property
    def n_chunks(self):
        return self.inter // self.block_i

    @property
    def n_gate_steps(self):
        return self.hidden // self.block_k

    @property
    def n_down_steps(self):
        return self.hidden // self.block_h

    def smem_bytes(self):
        bi, bk, bh = self.block_i, self.block_k, self.block_h
        if self.int4:
            gate = 2 * bi * bk // 2 + 2 * bi * (bk // GROUP) * 2 + 2 * _NX * (bk // 2) * 2
            down = bh * bi // 2 + bh * _NX * 2
        else:
            gate = 2 * bi * bk * 2 + _NX * bk * 2
            down = bh * bi * 2
        fixed = 2 * bi * 4 + 64 * bi * 2 + _SMEM_OVERHEAD  # gu, act operand
        return self.num_stages * (gate + down) + fixed


def _largest_divisor(n, start, granule):
    """Largest ``start / 2**k`` that is a multiple of ``granule`` and divides ``n``."""
    b = start
    while b > granule and n % b:
        b //= 2
    return b


def _plan(num_routes, hidden, inter, *, int4, block_i, block_k, block_h, num_stages):
    h_granule, i_granule = (256, 256) if int4 else (64, 32)
    if hidden % h_granule:
        raise ValueError(f"decode GEMV ({'int4' if int4 else 'bf16'}) needs the hidden size to "
                         f"be a multiple of {h_granule}, got H={hidden}")
    if inter % i_granule:
        raise ValueError(f"decode GEMV ({'int4' if int4 else 'bf16'}) needs the intermediate size "
                         f"to be a multiple of {i_granule}, got I={inter}")
    if block_i is None:
        block_i = 64 if inter % 64 == 0 and num_routes * inter // 64 >= 2 * NUM_SMS else 32
    if block_i not in (32, 64) or inter % block_i:
        raise ValueError(f"block_i must be 32 or 64 and divide I={inter}, got {block_i}")
    if block_k is None:
        block_k = _largest_divisor(hidden, (512 if int4 else 256) * 32 // block_i, h_granule)
    if block_k % h_granule or hidden % block_k:
        raise ValueError(f"block_k must be a multiple of {h_granule} dividing H={hidden}, "
                         f"got {block_k}")
    if block_h is None:
        block_h = _largest_divisor(hidden, (1024 if int4 else 512) * 32 // block_i, 64)
    if block_h % 64 or hidden % block_h or (block_h > _SUB_H and block_h % _SUB_H):
        raise ValueError(f"block_h must be a multiple of 64 (of {_SUB_H} above it) dividing "
                         f"H={hidden}, got {block_h}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    plan = _Plan(int4, hidden, inter, block_i, block_k, block_h, num_stages)
    if plan.smem_bytes() > SMEM_BYTES:
        raise ValueError(f"decode GEMV tiles need {plan.smem_bytes()} bytes of SMEM, more than "
                         f"{SMEM_BYTES}: lower num_stages ({num_stages}), block_k ({block_k}) "
                         f"or block_h ({block_h})")
    return plan


# ---------------------------------------------------------------------------------------------
# kernel

def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def _tiled(minor_bytes, itemsize):
    """SMEM transforms for a tile whose rows are ``minor_bytes`` long: 8-row tiles, the widest
    swizzle that fits (wgmma operands need >= 32 bytes; 16 means unswizzled)."""
    plgpu = _plgpu()
    swizzle = next(s for s in (128, 64, 32, 16) if minor_bytes % s == 0)
    tiling = plgpu.TilingTransform((8, swizzle // itemsize))
    return (tiling,) if swizzle == 16 else (tiling, plgpu.SwizzleTransform(swizzle))


def _scratch(plan, interpret):
    plgpu = _plgpu()
    bi, bk, bh, ns = plan.block_i, plan.block_k, plan.block_h, plan.num_stages
    bf16, u8 = jnp.bfloat16, jnp.uint8
    if plan.int4:
        gate = dict(
            g_w=plgpu.SMEM((ns, 2 * bi, bk // 2), u8, transforms=_tiled(_SUB_K4 // 2, 1)),
            g_s=plgpu.SMEM((ns, 2 * bi, bk // GROUP), bf16, transforms=_tiled(16, 2)),
            g_x=plgpu.SMEM((ns, 2, _NX, bk // 2), bf16, transforms=_tiled(_SUB_K4, 2)),
        )
        down = dict(
            d_w=plgpu.SMEM((ns, bh, bi // 2), u8, transforms=_tiled(bi // 2, 1)),
            d_s=plgpu.SMEM((ns, bh, _NX), bf16, transforms=_tiled(16, 2)),
        )
        n_gate, n_down = 9, 2
        act = plgpu.SMEM((2, 64, bi // 2), bf16, transforms=_tiled(bi, 2))
        if interpret:
            # Interpret mode takes wgmma A operands only from SMEM: stage the dequantized tiles.
            sub_h = min(bh, _SUB_H)
            down["stage_g"] = plgpu.SMEM((2, 2 * bi, _SUB_K4 // 2), bf16,
                                         transforms=_tiled(_SUB_K4, 2))
            down["stage_d"] = plgpu.SMEM((2, sub_h, bi // 2), bf16, transforms=_tiled(bi, 2))
    else:
        gate = dict(
            g_w=plgpu.SMEM((ns, 2 * bi, bk), bf16, transforms=_tiled(2 * bk, 2)),
            g_x=plgpu.SMEM((ns, _NX, bk), bf16, transforms=_tiled(2 * bk, 2)),
        )
        down = dict(d_w=plgpu.SMEM((ns, bh, bi), bf16, transforms=_tiled(2 * bi, 2)))
        n_gate, n_down = 3, 1
        act = plgpu.SMEM((64, bi), bf16, transforms=_tiled(2 * bi, 2))
    return dict(
        **gate, **down,
        gu=plgpu.SMEM((2 * bi,), jnp.float32),
        act=act,
        g_bar=plgpu.Barrier(num_arrivals=n_gate, num_barriers=ns),
        d_bar=plgpu.Barrier(num_arrivals=n_down, num_barriers=ns),
    )


def _dequant(packed):
    """uint8 [m, k] -> bf16 ``(q_lo - 8, 16 * (q_hi - 8))``, both exact. The high nibble is
    masked in place (Mosaic GPU has no 8-bit shifts), so its B operand is pre-divided by 16."""
    lo = (packed & 0x0F).astype(jnp.bfloat16) - 8.0
    hi = (packed & 0xF0).astype(jnp.bfloat16) - 128.0
    return lo.astype(jnp.bfloat16), hi.astype(jnp.bfloat16)


def _wgmma_pair(acc, lo, hi, b_lo, b_hi, staging):
    """``acc += lo @ b_lo + hi @ b_hi`` with lo, hi dequantized bf16 tiles in registers.
    ``staging`` (interpret mode only): an SMEM [2, m, k] buffer to pass them through."""
    plgpu = _plgpu()
    if staging is not None:
        staging[0] = lo
        staging[1] = hi
        plgpu.commit_smem()
        lo, hi = staging.at[0], staging.at[1]
    plgpu.wgmma(acc, lo, b_lo)
    plgpu.wgmma(acc, hi, b_hi)
    return acc[...]


def _ds(start, size):
    """``pl.ds`` whose dynamic start is declared a multiple of ``size``: Mosaic GPU layout
    inference needs it for TMA slices of tiled SMEM."""
    from jax.experimental import pallas as pl

    if isinstance(start, jax.Array):
        start = pl.multiple_of(start, size)
    return pl.ds(start, size)


def _release():
    """Before one thread issues the TMA that refills a consumed stage: every warp must be past
    its reads of it (plain loads of int4 tiles and scales, its share of the wgmma), and those
    reads ordered before the async proxy's writes. One warpgroup barrier + proxy fence."""
    _plgpu().commit_smem()


def _body(plan, with_units, n_ref, slots_ref, tokens_ref, *refs, **scratch):
    from jax.experimental import pallas as pl

    plgpu = _plgpu()
    wgmma_layout = plgpu.Layout.WGMMA
    bi, bk, bh, ns = plan.block_i, plan.block_k, plan.block_h, plan.num_stages
    inter = plan.inter
    units_ref, x_ref, *refs = refs if with_units else (None, *refs)
    if plan.int4:
        gw_ref, gs_ref, dw_ref, ds_ref, o_ref = refs
    else:
        gw_ref, dw_ref, o_ref = refs
    s = scratch
    c = lax.axis_index("c")
    r = lax.axis_index("r")

    live = r < n_ref[0]
    if with_units:  # a block past the route's units issues nothing (block (0, 0) always runs: no empty launch)
        unit_end = units_ref[r]
        live = live & ((c * bi < unit_end) | ((r == 0) & (c == 0)))

    @pl.when(live)
    def _():
        slot = slots_ref[r]
        tok = tokens_ref[r]

        def issue_gate(j, stage):
            bar = s["g_bar"].at[stage]
            if plan.int4:
                # [S, I, 2, X] view: row 2m + p. Tile rows: gate even | gate odd | up even | up odd.
                kp, ks, half = j * (bk // 2), j * (bk // GROUP), bi // 2
                for t, (m0, par) in enumerate(((0, 0), (0, 1), (inter // 2, 0), (inter // 2, 1))):
                    rows = _ds(m0 + c * half, half)
                    dst = pl.ds(t * half, half)
                    plgpu.copy_gmem_to_smem(gw_ref.at[slot, rows, par, _ds(kp, bk // 2)],
                                            s["g_w"].at[stage, dst], bar)
                    plgpu.copy_gmem_to_smem(gs_ref.at[slot, rows, par, _ds(ks, bk // GROUP)],
                                            s["g_s"].at[stage, dst], bar)
                plgpu.copy_gmem_to_smem(x_ref.at[tok, :, :, _ds(kp, bk // 2)],
                                        s["g_x"].at[stage], bar)
            else:
                cols = _ds(j * bk, bk)
                plgpu.copy_gmem_to_smem(gw_ref.at[slot, _ds(c * bi, bi), cols],
                                        s["g_w"].at[stage, pl.ds(0, bi)], bar)
                plgpu.copy_gmem_to_smem(gw_ref.at[slot, _ds(inter + c * bi, bi), cols],
                                        s["g_w"].at[stage, pl.ds(bi, bi)], bar)
                plgpu.copy_gmem_to_smem(x_ref.at[tok, :, cols], s["g_x"].at[stage], bar)

        def issue_down(j, stage):
            bar = s["d_bar"].at[stage]
            rows = _ds(j * bh, bh)
            if plan.int4:
                window = (c * bi // GROUP) // _NX * _NX
                plgpu.copy_gmem_to_smem(dw_ref.at[slot, rows, _ds(c * (bi // 2), bi // 2)],
                                        s["d_w"].at[stage], bar)
                plgpu.copy_gmem_to_smem(ds_ref.at[slot, rows, _ds(window, _NX)],
                                        s["d_s"].at[stage], bar)
            else:
                plgpu.copy_gmem_to_smem(dw_ref.at[slot, rows, _ds(c * bi, bi)],
                                        s["d_w"].at[stage], bar)

        for j in range(min(ns, plan.n_gate_steps)):
            issue_gate(j, j)
        for j in range(min(ns, plan.n_down_steps)):
            issue_down(j, j)

        # gate/up phase: run[2bi, 8] fp32, summed over its 8 columns at the end.
        def gate_step(j, run):
            stage = lax.rem(j, ns)
            plgpu.barrier_wait(s["g_bar"].at[stage])
            if plan.int4:
                for q in range(bk // _SUB_K4):
                    cols = pl.ds(q * (_SUB_K4 // 2), _SUB_K4 // 2)
                    lo, hi = _dequant(plgpu.load(s["g_w"].at[stage, :, cols], layout=wgmma_layout))
                    mma = functools.partial(_wgmma_pair, lo=lo, hi=hi,
                                            b_lo=s["g_x"].at[stage, 0, :, cols].T,
                                            b_hi=s["g_x"].at[stage, 1, :, cols].T,
                                            staging=s.get("stage_g"))
                    part = pl.run_scoped(mma, plgpu.ACC((2 * bi, _NX)))
                    scale = plgpu.load(s["g_s"].at[stage, :, pl.ds(q * _NX, _NX)],
                                       layout=wgmma_layout)
                    run = run + part * scale.astype(jnp.float32)
            else:
                def mma(acc):
                    plgpu.wgmma(acc, s["g_w"].at[stage], s["g_x"].at[stage].T)
                    return acc[...]

                run = run + pl.run_scoped(mma, plgpu.ACC((2 * bi, _NX)))

            @pl.when(j + ns < plan.n_gate_steps)
            def _():
                _release()
                issue_gate(j + ns, stage)

            return run

        run0 = plgpu.layout_cast(jnp.zeros((2 * bi, _NX), jnp.float32), wgmma_layout)
        gu = lax.fori_loop(0, plan.n_gate_steps, gate_step, run0).sum(axis=1)  # [2bi]

        # activation, written as the transposed B operand of the down wgmma: act[n, i] holds a_i
        # in row n = its column (int4: its scale group mod 8; bf16: 0), zero elsewhere. The gu
        # vector goes through SMEM to change from the row layout to the column layout.
        s["gu"][...] = gu
        col_layout = plgpu.Layout.WGMMA.reduce(0)
        parts = ((0, bi // 2, s["act"].at[0]), (bi // 2, bi // 2, s["act"].at[1])) if plan.int4 \
            else ((0, bi, s["act"]),)
        for start, size, dst in parts:
            g = plgpu.load(s["gu"].at[pl.ds(start, size)], layout=col_layout)
            u = plgpu.load(s["gu"].at[pl.ds(bi + start, size)], layout=col_layout)
            # int4 odd rows meet the high nibbles, which _dequant leaves scaled by 16.
            a = jax.nn.silu(g) * u * (1 / 16 if plan.int4 and start else 1.0)
            act = lax.broadcast_in_dim(a, (64, size), [1])
            n = plgpu.broadcasted_iota(jnp.int32, (64, size), 0, layout=wgmma_layout)
            if plan.int4 or with_units:
                i = plgpu.broadcasted_iota(jnp.int32, (64, size), 1, layout=wgmma_layout)
            if plan.int4:
                # int4 act rows are [even i | odd i]; both halves span the same groups.
                column = lax.rem((c * size + i) // (GROUP // 2), _NX)
            else:
                column = jnp.zeros_like(n)
            keep = n == column
            if with_units:  # units past the route's end are stale rows of the slot: zero, not multiplied
                unit = 2 * (c * size + i) + (1 if start else 0) if plan.int4 else c * bi + i  # column i's unit
                keep = keep & (unit < unit_end)
            dst[...] = jnp.where(keep, act, 0.0).astype(jnp.bfloat16)
        plgpu.commit_smem()

        # down phase: partial y over this block's bi columns of down.
        def down_step(j, carry):
            stage = lax.rem(j, ns)
            plgpu.barrier_wait(s["d_bar"].at[stage])
            for m in range(bh // min(bh, _SUB_H)):
                sub = min(bh, _SUB_H)
                rows_m = pl.ds(m * sub, sub)
                if plan.int4:
                    lo, hi = _dequant(plgpu.load(s["d_w"].at[stage, rows_m], layout=wgmma_layout))
                    mma = functools.partial(_wgmma_pair, lo=lo, hi=hi,
                                            b_lo=s["act"].at[0, pl.ds(0, _NX)].T,
                                            b_hi=s["act"].at[1, pl.ds(0, _NX)].T,
                                            staging=s.get("stage_d"))
                    part = pl.run_scoped(mma, plgpu.ACC((sub, _NX)))
                    scale = plgpu.load(s["d_s"].at[stage, rows_m], layout=wgmma_layout)
                    y = (part * scale.astype(jnp.float32)).sum(axis=1)
                else:
                    def mma(acc, rows_m=rows_m):
                        plgpu.wgmma(acc, s["d_w"].at[stage, rows_m], s["act"].at[pl.ds(0, _NX)].T)
                        return acc[...]

                    y = pl.run_scoped(mma, plgpu.ACC((sub, _NX))).sum(axis=1)
                o_ref[r, c, _ds(j * bh + m * sub, sub)] = y

            @pl.when(j + ns < plan.n_down_steps)
            def _():
                _release()
                issue_down(j + ns, stage)

            return carry

        lax.fori_loop(0, plan.n_down_steps, down_step, None)

    return None


def _x_operand(x, int4):
    """The x operand per token, bf16: ``[T, 8, H]`` with x in row 0 (bf16), or for int4
    ``[T, 2, 8, H/2]``: even / odd columns of x (odd ones divided by 16, see `_dequant`), row n
    keeping the groups g with g % 8 == n."""
    xb = x.astype(jnp.bfloat16)
    if not int4:
        return jnp.zeros((x.shape[0], _NX, x.shape[1]), jnp.bfloat16).at[:, 0].set(xb)
    half = xb.reshape(x.shape[0], -1, 2).transpose(0, 2, 1) * jnp.array([[1.0], [1 / 16]], xb.dtype)
    group = jnp.arange(half.shape[-1]) // (GROUP // 2)
    mask = (group[None, :] % _NX) == jnp.arange(_NX)[:, None]  # [8, H/2]
    return jnp.where(mask[None, None], half[:, :, None, :], 0).astype(jnp.bfloat16)


def _launch(plan, x, slots, tokens, n_valid, banks, interpret, units=None):
    num_routes = slots.shape[0]
    if units is not None and units.shape != (num_routes,):
        raise ValueError(f"units must have one entry per route ({num_routes}), got shape {units.shape}")
    plgpu = _plgpu()
    n_valid = jnp.asarray(n_valid, jnp.int32).reshape(1)
    kernel = plgpu.kernel(
        functools.partial(_body, plan, units is not None),
        out_type=jax.ShapeDtypeStruct((num_routes, plan.n_chunks, plan.hidden), jnp.float32),
        scratch_types=_scratch(plan, interpret),
        grid=(plan.n_chunks, num_routes),
        grid_names=("c", "r"),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                   else plgpu.InterpretGPUParams() if interpret else None),
    )
    num_slots = banks[0].shape[0]
    slots = jnp.clip(slots.astype(jnp.int32), 0, num_slots - 1)  # entries past n_valid may be -1
    tokens = jnp.clip(tokens.astype(jnp.int32), 0, x.shape[0] - 1)
    n_launch = jnp.maximum(n_valid, 1)
    if units is None:
        y = kernel(n_launch, slots, tokens, _x_operand(x, plan.int4), *banks).sum(axis=1)
    else:  # the partials of the blocks past a route's units were never written
        units = jnp.clip(units.astype(jnp.int32), 0, plan.inter)
        part = kernel(n_launch, slots, tokens, units, _x_operand(x, plan.int4), *banks)
        live = jnp.arange(plan.n_chunks)[None, :] * plan.block_i < units[:, None]
        y = jnp.where(live[:, :, None], part, 0.0).sum(axis=1)
    valid = jnp.arange(num_routes) < n_valid[0]
    return jnp.where(valid[:, None], y, 0.0)


def _check_dtypes(**arrays):
    for name, (a, dtype) in arrays.items():
        if a.dtype != dtype:
            raise ValueError(f"{name} must be {jnp.dtype(dtype).name}, got {a.dtype}")


_TUNABLES = ("block_i", "block_k", "block_h", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_TUNABLES)
def decode_experts(x, slots, tokens, n_valid, gate_up, down, units=None, *, block_i=None, block_k=None,
                   block_h=None, num_stages=3, interpret=False):
    """Mosaic GPU decode grouped GEMV; same contract as `reference_decode_experts`.

    ``units [R]`` i32 (optional, the offload unit split's routes): route r sums only the intermediate
    units ``[0, units[r])`` of its slot (the rest may be stale rows: zeroed, never multiplied); its
    blocks past them read nothing.

    x [T, H] (cast to bf16); slots, tokens [R] i32; n_valid i32 scalar (device); gate_up
    [S, 2I, H], down [S, H, I] bf16. Returns [R, H] fp32. Tunables (None = chosen from the
    shapes, see the module docstring): ``block_i`` rows of gate/up per block (32 or 64),
    ``block_k`` gate/up columns per stage, ``block_h`` down rows per stage, ``num_stages`` SMEM
    stages per ring. ``interpret=True`` (or a ``plgpu.InterpretGPUParams``, e.g. with
    ``detect_races=True``) runs Mosaic GPU interpret mode (CPU); there the int4 dequantized
    tiles reach the wgmma through SMEM, as interpret mode takes A operands only from SMEM.
    """
    hidden, inter = x.shape[1], down.shape[-1]
    if gate_up.shape[1:] != (2 * inter, hidden) or down.shape[1] != hidden:
        raise ValueError(f"bank shapes {gate_up.shape}, {down.shape} do not match x {x.shape}")
    # A cast here would copy the whole cache on every call.
    _check_dtypes(gate_up=(gate_up, jnp.bfloat16), down=(down, jnp.bfloat16))
    plan = _plan(slots.shape[0], hidden, inter, int4=False, block_i=block_i, block_k=block_k,
                 block_h=block_h, num_stages=num_stages)
    return _launch(plan, x, slots, tokens, n_valid, (gate_up, down), interpret, units)


@functools.partial(jax.jit, static_argnames=_TUNABLES)
def decode_experts_int4(x, slots, tokens, n_valid, gate_up_packed, gate_up_scales, down_packed,
                        down_scales, units=None, *, block_i=None, block_k=None, block_h=None, num_stages=3,
                        interpret=False):
    """`decode_experts` over int4 banks (layout of `ftjax.host.quant`), dequantized in the kernel.

    gate_up_packed uint8 [S, 2I, H/2], gate_up_scales bf16 [S, 2I, H/32], down_packed uint8
    [S, H, I/2], down_scales bf16 [S, H, I/32], ``units`` as in `decode_experts`. Same contract as
    `reference_decode_experts_int4`.
    """
    hidden = x.shape[1]
    num_slots, two_inter = gate_up_packed.shape[:2]
    inter = two_inter // 2
    want = {"gate_up_packed": (num_slots, 2 * inter, hidden // 2),
            "gate_up_scales": (num_slots, 2 * inter, hidden // GROUP),
            "down_packed": (num_slots, hidden, inter // 2),
            "down_scales": (num_slots, hidden, inter // GROUP)}
    got = {"gate_up_packed": gate_up_packed.shape, "gate_up_scales": gate_up_scales.shape,
           "down_packed": down_packed.shape, "down_scales": down_scales.shape}
    _check_dtypes(gate_up_packed=(gate_up_packed, jnp.uint8),
                  gate_up_scales=(gate_up_scales, jnp.bfloat16),
                  down_packed=(down_packed, jnp.uint8), down_scales=(down_scales, jnp.bfloat16))
    bad = {k: v for k, v in got.items() if tuple(v) != want[k]}
    if bad:
        raise ValueError(f"int4 bank shapes {bad} do not match x {x.shape}: expected "
                         f"{ {k: want[k] for k in bad} }")
    plan = _plan(slots.shape[0], hidden, inter, int4=True, block_i=block_i, block_k=block_k,
                 block_h=block_h, num_stages=num_stages)
    # Free views: gate/up row 2m + p -> [m, p], so a TMA box can take the even or odd rows.
    banks = (gate_up_packed.reshape(num_slots, inter, 2, hidden // 2),
             gate_up_scales.reshape(num_slots, inter, 2, hidden // GROUP), down_packed, down_scales)
    return _launch(plan, x, slots, tokens, n_valid, banks, interpret, units)
