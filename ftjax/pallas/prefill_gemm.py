"""Prefill grouped expert MLP on Mosaic GPU (Hopper WGMMA), bf16 and int4, beside its jnp reference.

One MoE layer's prefill: ``x [T, H]``, router output ``expert_ids [T, k]`` and ``gate_weights
[T, k]``, ``token_valid [T]``; expert weights from a slot cache, ``gate_up [S, 2I, H]`` (rows
0..I-1 gate, I..2I-1 up) and ``down [S, H, I]`` in torch [out, in] orientation, found through
``slot_of_expert [E]``. Output ``y [T, H]`` fp32:

    y_t = sum_j w[t, j] * down[s] @ (silu(gate[s] @ x_t) * (up[s] @ x_t)),
    s = slot_of_expert[expert_ids[t, j]]

and zero for invalid tokens.

Plan (one screen):
  1. `route_tables`: the routes sorted by expert into groups padded to ``tile_m`` rows
     (``R_pad``, a static bound: ``T*k + min(E, T*k) * (tile_m - 1)`` rounded down to a tile),
     and the kernels' tables, by `routing.plan_routes` in XLA or by one CUDA call (``plan_impl``);
     `routing.gather_input_rows` builds kernel 1's input ``x_rows``: the same groups aligned to
     8 rows only (~T*k rows; row tile m reads from ``plan.tile_row0[m]`` on, and the rows it
     reads past its group's routes only feed padding rows of ``act``). At 8K tokens, 256
     experts, that writes ~66,000 rows of ``x`` instead of ~98,000, by XLA's take; ``gather="tma"``
     copies them by one TMA load and store per row (`row_gather`) instead: twice as fast alone
     (137 against 279 us in `bench/prefill_glue.py`) but 1-3% slower in the prefill call on the
     H200, where XLA's take ran 117 us (session 16), so not the default.
  2. kernel 1, gate+up grouped matmul with fused SwiGLU: ``act [R_pad, I]`` bf16. Where it can run
     (an sm_90 GPU, bf16, the default tiles: ``gather="auto"``), step 1's gather and step 2 are one CUDA
     call that reads the rows of ``x`` through ``token_of_input_row`` (`gate_up_cuda`, session 23): the
     x-row copy (117 us at 8K tokens, Qwen3.6 shape) is gone, though that kernel ran ~9% slower than
     the Mosaic kernel on the same rows; the call at 8K: 0.95 ms against 1.02 steady (0.59 vs 0.55
     of the matmul ceiling).
  3. kernel 2, down grouped matmul: ``out [R_pad, H]`` bf16.
  4. `routing.combine_rows`: fp32 weighted gather-sum back to tokens.
  The kernels always get at least one row tile (``max(n_tiles, 1)``, slots clamped into the
  cache): Mosaic GPU hung once on an all-empty launch, and an empty batch then computes one tile
  of zero padding rows that no route reads. No ``lax.cond`` (XLA:GPU runs a conditional by reading
  its predicate on the host); the jnp route plan goes through an optimization barrier instead, which
  also keeps XLA from fusing the plan's index math into the gather and the combine (without either,
  that fusion cost 5.7 ms of glue at 8K tokens on the H200, session 10). Only the plan's fields used
  here pass the barrier, so XLA drops the rest (the padded layout's per-row route map), and the
  route sort runs on uint16 keys: the call at 8K tokens (Qwen shape) ran 38 GPU events in session
  16, 32 in session 20 (the sort's 6 radix kernels, 33 us, became 4, 19 us), 9 with the route tables
  by CUDA (`plan_impl="auto"`, session 21: 21 us for the tables, the call 0.44-0.46 -> 0.47-0.49 of
  the matmul ceiling at 8K, 0.56 -> 0.60-0.61 at 16K). The idle time of a single
  call (0.55 ms of 1.8 at 8K, Qwen shape) stayed without the cond: it is mostly the host's launch
  and wait; dispatched back to back a call took 1.38 ms against 1.27 ms of GPU work
  (`bench/kernels.py` b2b column).

Kernel layout (both kernels are one builder, `_grouped_matmul`): a persistent grid of one CTA
per SM walks the output tiles ``(m, n)``, by default ``n`` fastest, so neighbouring CTAs share a
row tile and an expert's weights while they are in L2; with ``walk_band`` B the walk goes per
expert in bands of B row tiles, the band's row tiles fastest (`routing.tile_walk`, a device table
of work item -> tile built with the route plan), so the CTAs running at the same time read the same
weight block, each weight byte fetched into L2 serving up to ``B * tile_m`` rows. ``"auto"`` (the
default) takes B = 2 for a kernel of 16 or more output blocks: on the H200 (session 20) that lifted
the DeepSeek-like shape (2 to 3 row tiles per expert at 8K tokens) by 0.07-0.10 of the matmul
ceiling (its gate+up kernel from 0.51-0.60 to 0.64-0.73 at 8K), and did nothing for the Qwen3.6
shape's Mosaic kernels, whose 4 and 8 output blocks keep the default. The fused kernel 1
(`gate_up_cuda`) takes B = 2 at any block count: at the Qwen3.6 shape it cut its HBM reads from 2.07
to 1.65 GB (session 24). The walk is ``plgpu.nd_loop`` over a *device*
count of row tiles (``n_tiles``), so the idle tail of the padded buffer costs nothing, and since an
empty group has no row tile it costs nothing either. Each CTA has three warpgroups: a memory warpgroup
issuing TMA copies into a ``stages``-deep SMEM ring (``emit_pipeline_warp_specialized``) and two
compute warpgroups, each owning ``tile_n`` of the CTA's ``2 * tile_n`` output columns. A pipeline
step is one ``tile_k`` slice of the reduction: the ``[tile_m, tile_k]`` row tile and the
``[2 * tile_n, tile_k]`` weight tile(s), read straight from ``w.at[slot]`` (torch [out, in] is
K-major, so the weight tile is WGMMA's B operand through a transposed SMEM view). The slot is
``tile_slot[m] = slot_of_expert[tile_group[m]]``, an int32 GMEM input read inside the kernel
before the TMA addresses are formed; any cache (prefill double buffer, decode LRU) can feed it.
Kernel 1 streams the gate and the up rows of the same output columns and keeps two fp32
accumulators per warpgroup; its epilogue applies SwiGLU in registers. Epilogues go through a
``[tile_m, 64]`` SMEM tile per warpgroup and TMA stores. A compute warpgroup waits for its
WGMMAs before a step returns its SMEM slot (no ``delay_release``: a WGMMA still reading the last
slot would race the memory warpgroup's prologue copies for the next tile); the two compute
warpgroups interleave on the tensor cores.

int4 (`prefill_experts_int4`): weights are the host pool's group-32 layout (`ftjax.host.quant`):
``packed uint8 [.., rows, cols/2]`` (column 2j in the low nibble of byte j) and ``scales bf16
[.., rows, cols/32]``, value ``(q - 8) * scale``. The wrapper reinterprets ``packed`` as an int4
array ``[.., rows, cols]`` (a bitcast; the nibble order is jax's int4 order). Per step the memory
warpgroup copies the int4 tile and an 8-group (256-column) block of scales; each compute
warpgroup loads its int4 rows into registers, flips the top bit (``q ^ 8`` read as signed int4
is ``q - 8``), converts to bf16, multiplies by the scales selected per 32-column group, stores the
bf16 tile into its own swizzled SMEM tile, fences (``commit_smem``: proxy fence + warpgroup
barrier) and issues WGMMA from it. Needs ``H % 256 == 0``, ``I % 256 == 0`` and
``tile_n`` a multiple of 64 with ``2 * tile_n <= 256`` (one TMA copy of scales).

Defaults (H100/H200, 227 KiB SMEM): ``tile_m=128, tile_k=64``, stages 3 (bf16 down: 4); kernel 1 ``tile_n=64``
(CTA 128 x 128 act columns = 256 weight rows, 2 x 64 fp32 accumulator registers per thread),
kernel 2 ``tile_n=128`` (CTA 128 x 256). Both use 48 KiB per stage in bf16 and 28 KiB in int4
(plus a 32 KiB dequant buffer), and a 32 KiB epilogue. ``tile_m=64`` halves the padding waste
(at most 63 rows per non-empty expert). Tile sweep on the H200 (8K tokens, back to back, session
11): 3 stages beat 4 by 5-8% on both benchmark shapes; tile_k 128 (2 stages fit) and tile_m 64 lost.
``cross_tile=True`` runs a CTA's tiles as one pipeline of pipelines (the next tile's first copies
during this tile's last steps and epilogue); it needs the stage count to divide the step counts, so
not 3 stages at power-of-two sizes. On the H200 (session 16) it lifted the Qwen down kernel by
0.02-0.06 of the ceiling over the same stages, but the calls stayed within ~2-3% of per-tile 3 stages
(``cross_tile=None`` picks cross-tile only where the stages divide the steps). Since session 22 the bf16
default is per kernel, ``stages=(3, 4)``: gate+up per-tile with 3 stages, down (8 steps at the Qwen3.6
shape, 32 at the DeepSeek-like one) cross-tile with 4; its down kernel ran 1-11% faster and the Qwen call at
8K 4% (b2b) / 6% (steady) faster, the others within +-1.5% (sessions 20 and 22). int4 keeps 3 and 3.

Cost model (for the benchmark): `prefill_flops` counts the useful FLOPs, ``6 * T*k * H * I``
(three matmuls of 2 flops per MAC). `prefill_bytes` counts the minimum HBM traffic: the weights
of the experts hit once, ``n_hit * 3*H*I * b_w`` (``b_w`` = 2 for bf16, ``0.5 + 2/32`` for int4),
plus ``x`` in and ``y`` out, ``T*H*(2 + 4)``. The bf16 intermediates ``x_rows``, ``act`` and ``out``
are each written once and read back once, at most ``R_pad * (4H + 2I) * 2`` bytes;
`prefill_bytes(..., with_intermediates=True)` adds them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ftjax.pallas import gate_up_cuda
from ftjax.pallas import route_tables
from ftjax.pallas import routing
from ftjax.pallas import row_gather
from ftjax.pallas.int4 import GROUP as QUANT_GROUP
from ftjax.pallas.int4 import dequantize_int4
from ftjax.pallas.prefill_options import EPI_N as _EPI_N
from ftjax.pallas.prefill_options import SCALE_BLOCK as _SCALE_BLOCK
from ftjax.pallas.prefill_options import WG_ROWS as _WG_ROWS
from ftjax.pallas.prefill_options import check_routing, resolve_tiles
from ftjax.pallas.prefill_options import plgpu_module as _plgpu


# ---------------------------------------------------------------------------------------------
# Reference and cost model


def reference_prefill_experts(x, expert_ids, gate_weights, token_valid, gate_up, down,
                              slot_of_expert):
    """Plain jnp reference: gather each route's weights, fp32 HIGHEST einsums. ``[T, H]`` fp32."""
    num_tokens, top_k = expert_ids.shape
    inter = down.shape[-1]
    hi = lax.Precision.HIGHEST
    slots = slot_of_expert[expert_ids.reshape(-1)]  # [R]
    xf = jnp.repeat(x.astype(jnp.float32), top_k, axis=0)  # [R, H]
    gu = jnp.einsum("rih,rh->ri", gate_up[slots].astype(jnp.float32), xf, precision=hi)
    act = jax.nn.silu(gu[:, :inter]) * gu[:, inter:]
    y = jnp.einsum("rhi,ri->rh", down[slots].astype(jnp.float32), act, precision=hi)
    w = gate_weights.reshape(-1).astype(jnp.float32)
    if token_valid.ndim == 2:  # per route: drop the routes left out
        w = jnp.where(token_valid.reshape(-1), w, 0.0)
        token_valid = token_valid.any(axis=1)
    y = (y * w[:, None]).reshape(num_tokens, top_k, -1).sum(axis=1)
    return jnp.where(token_valid[:, None], y, 0.0)


def reference_prefill_experts_int4(x, expert_ids, gate_weights, token_valid, gate_up_packed,
                                   gate_up_scales, down_packed, down_scales, slot_of_expert):
    """int4 reference: dequantize the banks to fp32, then `reference_prefill_experts`."""
    return reference_prefill_experts(
        x, expert_ids, gate_weights, token_valid, dequantize_int4(gate_up_packed, gate_up_scales),
        dequantize_int4(down_packed, down_scales), slot_of_expert)


def prefill_flops(num_tokens: int, top_k: int, hidden: int, inter: int) -> int:
    """Useful FLOPs of one layer's expert MLP: gate+up ``2*(2I)*H`` and down ``2*H*I`` per route."""
    return 6 * num_tokens * top_k * hidden * inter


def prefill_bytes(num_tokens: int, top_k: int, hidden: int, inter: int, experts_hit: int, *,
                  int4: bool = False, num_experts: int | None = None, tile_m: int = 128,
                  with_intermediates: bool = False) -> int:
    """Minimum HBM bytes: weights of the experts hit once, ``x`` (bf16) in, ``y`` (fp32) out.

    ``with_intermediates`` adds the padded ``x_rows``/``act``/``out`` buffers written and read back
    (bound ``R_pad`` from `routing.padded_rows_bound`, needs ``num_experts``).
    """
    per_weight = 0.5 + 2 / QUANT_GROUP if int4 else 2
    total = int(experts_hit * 3 * hidden * inter * per_weight) + num_tokens * hidden * (2 + 4)
    if with_intermediates:
        rows = routing.padded_rows_bound(num_tokens * top_k, num_experts or experts_hit, tile_m)
        total += rows * (4 * hidden + 2 * inter) * 2
    return total


# ---------------------------------------------------------------------------------------------
# Kernel


def _swizzled(minor_elems: int, dtype):
    """TMA/WGMMA-friendly SMEM transforms for a tile whose rows hold ``minor_elems`` of dtype."""
    plgpu = _plgpu()
    bits = jnp.dtype(dtype).itemsize * 8 if dtype != jnp.int4 else 4
    swizzle = plgpu.find_swizzle(minor_elems * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _dequant_tile(q_ref, s_ref, k, *, tile_k):
    """int4 ``[n, tile_k]`` SMEM tile + ``[n, 8]`` scale block -> bf16 ``[n, tile_k]`` in registers.

    ``q ^ 8`` read as signed int4 is ``q - 8``; each 32-column group takes its scale column,
    picked from the 8-column block by a masked row sum (the column index is dynamic).
    """
    plgpu = _plgpu()
    n = q_ref.shape[0]
    # Load 8 nibbles (32 bits) per register, shuffle to 4 per register, convert, shuffle into
    # the WGMMA layout where a row's scale broadcasts along the columns: the layout chain
    # Mosaic GPU supports for int4 -> bf16 (4X -> 2X relayouts are 4-bit only).
    q = plgpu.load(q_ref, layout=plgpu.Layout.WGMMA_UPCAST_4X) ^ jnp.int4(-8)
    q = plgpu.layout_cast(q, plgpu.Layout.WGMMA_UPCAST_2X)
    w = plgpu.layout_cast(q.astype(jnp.bfloat16), plgpu.Layout.WGMMA)
    s_blk = s_ref[...].astype(jnp.float32)  # [n, 8]
    groups = tile_k // QUANT_GROUP
    base = lax.rem(k * groups, _SCALE_BLOCK)
    blk_col = lax.broadcasted_iota(jnp.int32, (n, _SCALE_BLOCK), 1)
    per_group = []
    for g in range(groups):
        s_g = jnp.sum(jnp.where(blk_col == base + g, s_blk, 0.0), axis=1).astype(jnp.bfloat16)
        per_group.append(jnp.broadcast_to(s_g[:, None], (n, QUANT_GROUP)))
    scale = jnp.concatenate(per_group, axis=1)
    # (q - 8) * scale rounds once to bf16, as the fp32 product would when stored.
    return w * scale


def _grouped_matmul(a, tile_slot, tile_row0, tile_rows, n_tiles, weights, *, n_out, swiglu, tile_m, tile_n,
                    tile_k, stages, num_sms, interpret, cross_tile, walk=None):
    """``out[tile m's rows] = epilogue(a[tile_row0[m] : tile_row0[m] + tile_m] @ W[slot]^T)`` over
    the active row tiles; tile m's output rows are ``m * tile_m ..`` (the padded layout).

    ``a [rows, K]`` bf16 with ``tile_row0[m] + tile_m <= rows``; ``tile_slot``, ``tile_row0``,
    ``tile_rows`` (rows of tile m that hold routes: its 64-row slabs past them skip their WGMMAs
    and write garbage) ``[R_pad/tile_m]`` and ``n_tiles [1]`` int32;
    ``weights`` is ``(w,)`` with ``w [S, n_w, K]`` bf16, or ``(q, s)`` with ``q [S, n_w, K]`` int4
    and ``s [S, n_w, K/32]`` bf16. ``swiglu``: ``n_w = 2 * n_out`` and the output is
    ``silu(a @ W[:n_out]^T) * (a @ W[n_out:]^T)``; otherwise ``n_w = n_out``. Returns
    ``[R_pad, n_out]`` bf16; rows of idle tiles are left unwritten. ``cross_tile``: a CTA's
    tiles run as one pipeline of pipelines (needs ``K / tile_k`` divisible by ``stages``).
    ``walk``: None walks the tiles ``(m, n)`` with ``n`` fastest; else an int32
    ``[R_pad/tile_m * n_out/(2*tile_n)]`` table (`routing.tile_walk`): work item i is tile
    ``walk[i] = m * n_blocks + n``.
    """
    from jax.experimental import pallas as pl

    plgpu = _plgpu()
    int4 = len(weights) == 2
    num_rows, k_dim = tile_slot.shape[0] * tile_m, a.shape[1]
    n_b = 2 if swiglu else 1
    cta_n = 2 * tile_n
    n_iters = n_out // cta_n
    k_iters = k_dim // tile_k
    k_per_scale_block = (QUANT_GROUP * _SCALE_BLOCK) // tile_k if int4 else 1
    epi_n = min(tile_n, _EPI_N)
    n_slabs = tile_m // _WG_ROWS

    a_tr = _swizzled(tile_k, jnp.bfloat16)
    w_tr = _swizzled(tile_k, jnp.int4 if int4 else jnp.bfloat16)
    deq_tr = _swizzled(tile_k, jnp.bfloat16)
    out_tr = _swizzled(epi_n, jnp.bfloat16)

    in_specs = [plgpu.BlockSpec((tile_m, tile_k), lambda k: (0, k), transforms=a_tr)]
    for _ in range(n_b):
        in_specs.append(plgpu.BlockSpec((cta_n, tile_k), lambda k: (0, k), transforms=w_tr))
        if int4:
            in_specs.append(plgpu.BlockSpec((cta_n, _SCALE_BLOCK),
                                            lambda k: (0, k // k_per_scale_block)))

    def get_pipeline(body, compute_context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40, in_specs=in_specs, wg_axis="wg",
            num_compute_wgs=2, max_concurrent_steps=stages, compute_context=compute_context,
            pipeline_state=state)

    def pipeline_state(info):
        """START on a CTA's first tile (fill the ring), STOP on its last (drain it), STEADY in
        between: the memory warpgroup copies the next tile's first steps while the compute
        warpgroups finish this tile and run its epilogue. A CTA with one tile takes START and
        skips the drain, which only waits for releases nothing reuses."""
        if not cross_tile:
            return None
        pp = plgpu.PipelinePipeline
        last = info.local_index == info.num_local_steps - 1
        return jnp.where(info.local_index == 0, jnp.int32(pp.START),
                         jnp.where(last, jnp.int32(pp.STOP), jnp.int32(pp.STEADY)))

    def weight_refs(w_gmem, slot, ni):
        """GMEM slabs of the ``n_b`` weight row blocks (gate, up) of output block ni."""
        refs = []
        for b in range(n_b):
            row0 = b * n_out + ni * cta_n
            refs.append(w_gmem[0].at[slot, pl.ds(row0, cta_n)])
            if int4:
                refs.append(w_gmem[1].at[slot, pl.ds(row0, cta_n)])
        return refs

    def tiles_loop(nt_ref, walk_ref):
        """The persistent loop over the active tiles; the body gets ``(info, mi, ni)``."""
        def deco(body):
            if walk_ref is None:
                @plgpu.nd_loop((nt_ref[0], n_iters), collective_axes="sm")
                def _tile(info):
                    mi, ni = info.index
                    body(info, mi, ni)
            else:
                @plgpu.nd_loop((nt_ref[0] * n_iters,), collective_axes="sm")
                def _tile(info):
                    (i,) = info.index
                    code = walk_ref[i]
                    body(info, lax.div(code, n_iters), lax.rem(code, n_iters))
        return deco

    def kernel(slot_ref, row0_ref, rows_ref, nt_ref, *refs, o_smem, deq_smem=None):
        walk_ref, refs = (None, refs) if walk is None else (refs[0], refs[1:])
        a_gmem, refs = refs[0], refs[1:]
        w_gmem, o_gmem = refs[:-1], refs[-1]
        ignore = lambda *_, **__: None
        allocs = get_pipeline(ignore, ignore).get_allocations(
            a_gmem.at[pl.ds(0, tile_m)], *weight_refs(w_gmem, 0, 0))

        @functools.partial(pl.run_scoped, allocs=allocs, collective_axes="wg")
        def _scope(allocs):
            wg = lax.axis_index("wg")
            wg_rows = pl.ds(wg * tile_n, tile_n)

            @tiles_loop(nt_ref, walk_ref)
            def _tile(info, mi, ni):
                slot = slot_ref[mi]
                live_rows = rows_ref[mi]  # rows of the tile that hold routes (>= 1 when active)

                def compute_context(run_pipeline):
                    # one accumulator per weight block per 64-row slab: a slab without routes
                    # skips its WGMMAs (half of a group's last tile, often)
                    accs = [plgpu.ACC((_WG_ROWS, tile_n), jnp.float32)
                            for _ in range(n_b * n_slabs)]

                    @functools.partial(pl.run_scoped, accs=accs)
                    def _acc_scope(accs):
                        run_pipeline(tuple(accs))
                        vals = []
                        for h in range(n_slabs):
                            if swiglu:
                                g, u = accs[h][...], accs[n_slabs + h][...]
                                vals.append((g / (1.0 + jnp.exp(-g)) * u).astype(o_gmem.dtype))
                            else:
                                vals.append(accs[h][...].astype(o_gmem.dtype))
                        for j in range(tile_n // epi_n):
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            for h, val in enumerate(vals):
                                o_smem[wg, pl.ds(h * _WG_ROWS, _WG_ROWS)] = \
                                    val[:, j * epi_n:(j + 1) * epi_n]
                            plgpu.commit_smem()
                            col0 = ni * cta_n + wg * tile_n + j * epi_n
                            plgpu.copy_smem_to_gmem(
                                o_smem.at[wg],
                                o_gmem.at[pl.ds(mi * tile_m, tile_m), pl.ds(col0, epi_n)])

                def mma(idx, a_smem, *refs):
                    *b_refs, accs = refs
                    (k,) = idx
                    if int4:
                        for b in range(n_b):
                            q_ref, s_ref = b_refs[2 * b], b_refs[2 * b + 1]
                            deq_smem[wg, b] = _dequant_tile(
                                q_ref.at[wg_rows], s_ref.at[wg_rows], k, tile_k=tile_k)
                        plgpu.commit_smem()  # generic-proxy stores -> visible to WGMMA
                        b_tiles = [deq_smem.at[wg, b] for b in range(n_b)]
                    else:
                        b_tiles = [b_ref.at[wg_rows] for b_ref in b_refs]
                    for b, b_tile in enumerate(b_tiles):
                        plgpu.wgmma(accs[b * n_slabs], a_smem.at[pl.ds(0, _WG_ROWS)], b_tile.T)
                    for h in range(1, n_slabs):
                        @pl.when(live_rows > h * _WG_ROWS)
                        def _slab():
                            for b, b_tile in enumerate(b_tiles):
                                plgpu.wgmma(accs[b * n_slabs + h],
                                            a_smem.at[pl.ds(h * _WG_ROWS, _WG_ROWS)], b_tile.T)
                    # Done before the step returns its SMEM slot (and dequant buffer): a WGMMA
                    # left in flight past the last step would race the next tile's prologue
                    # copies. The other compute warpgroup keeps the tensor cores busy meanwhile.
                    plgpu.wgmma_wait(0)
                    return accs

                row0 = pl.multiple_of(row0_ref[mi], routing.INPUT_ALIGN)  # a TMA starts on an 8-row tile
                get_pipeline(mma, compute_context, pipeline_state(info))(
                    a_gmem.at[pl.ds(row0, tile_m)], *weight_refs(w_gmem, slot, ni), allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = dict(o_smem=plgpu.SMEM((2, tile_m, epi_n), jnp.bfloat16, transforms=out_tr))
    if int4:  # per compute warpgroup, per weight block
        scratch["deq_smem"] = plgpu.SMEM((2, n_b, tile_n, tile_k), jnp.bfloat16,
                                         transforms=deq_tr)
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_rows, n_out), jnp.bfloat16),
        grid=(num_sms,), grid_names=("sm",), num_threads=3, thread_name="wg",
        kernel_name="mosaic_prefill_gate_up" if swiglu else "mosaic_prefill_down",  # profiles tell them apart
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    walk_args = () if walk is None else (walk,)
    return call(tile_slot, tile_row0, tile_rows, n_tiles, *walk_args, a, *weights)


# ---------------------------------------------------------------------------------------------
# Public entry points


def _prefill(x, expert_ids, gate_weights, token_valid, slot_of_expert, gu_weights, d_weights,
             *, hidden, inter, tiles, fused_options=None):
    (tile_m, tile_n_gate_up, tile_n_down, tile_k, stages, num_sms, interpret, cross_tile, gather,
     walk_band, plan_impl) = tiles
    num_experts = slot_of_expert.shape[0]
    impl = route_tables.resolve_impl(plan_impl, num_experts, interpret=interpret)
    blocks = (inter // (2 * tile_n_gate_up), hidden // (2 * tile_n_down))
    tables = route_tables.route_tables(expert_ids, token_valid, slot_of_expert, n_slots=gu_weights[0].shape[0],
                                       tile=tile_m, walks=tuple(zip(blocks, walk_band)), impl=impl)
    common = dict(tile_m=tile_m, tile_k=tile_k, num_sms=num_sms, interpret=interpret)
    if gather == "fused" and x.shape[0] > 0:  # kernel 1 reads x through the tables (CUDA, sm_90a)
        act = gate_up_cuda.gate_up(x, tables, gu_weights[0], num_sms=num_sms,
                                   **gate_up_cuda.kernel_options(fused_options))
    else:
        x_rows = _input_rows(x.astype(jnp.bfloat16), tables, gather=gather, num_sms=num_sms,
                             interpret=interpret)
        act = _grouped_matmul(x_rows, tables.tile_slot, tables.tile_row0, tables.tile_rows, tables.n_launch,
                              gu_weights, n_out=inter, swiglu=True, tile_n=tile_n_gate_up,
                              walk=tables.walks[0], stages=stages[0], cross_tile=cross_tile[0], **common)
    padded_row0 = jnp.arange(tables.tile_row0.shape[0], dtype=jnp.int32) * tile_m
    out = _grouped_matmul(act, tables.tile_slot, padded_row0, tables.tile_rows, tables.n_launch, d_weights,
                          n_out=hidden, swiglu=False, tile_n=tile_n_down, walk=tables.walks[1],
                          stages=stages[1], cross_tile=cross_tile[1], **common)
    return routing.combine_rows(out, tables, gate_weights)


_STATIC = ("tile_m", "tile_n_gate_up", "tile_n_down", "tile_k", "stages", "num_sms", "interpret",
           "cross_tile", "gather", "walk_band", "plan_impl")
_STATIC_BF16 = _STATIC + ("fused_options",)


def _input_rows(x, tables, *, gather, num_sms, interpret):
    """Kernel 1's input rows (`routing.gather_input_rows`): by TMA row copies (`row_gather`) where
    the rows allow and ``gather == "tma"``, else XLA's take."""
    idx = tables.token_of_input_row
    if gather == "tma" and row_gather.supported(x.shape, x.dtype, idx.shape[0], num_sms):
        return row_gather.gather_rows(x, idx, num_sms=num_sms, interpret=interpret)
    return routing.gather_input_rows(x, tables)


@functools.partial(jax.jit, static_argnames=_STATIC_BF16)
def prefill_experts(x, expert_ids, gate_weights, token_valid, gate_up, down, slot_of_expert, *,
                    tile_m=128, tile_n_gate_up=64, tile_n_down=128, tile_k=64, stages=(3, 4),
                    num_sms=None, interpret=False, cross_tile=None, gather="auto", walk_band="auto",
                    plan_impl="auto", fused_options=None):
    """Mosaic GPU prefill expert MLP, bf16 weights; same contract as `reference_prefill_experts`.

    x [T, H]; expert_ids [T, k] int32 in 0..E-1; gate_weights [T, k]; token_valid [T] bool (or
    [T, k]: per route, e.g. the routes whose expert is in the cache);
    gate_up [S, 2I, H] and down [S, H, I] bf16; slot_of_expert [E] int32. Returns [T, H] fp32.
    Needs ``I % (2 * tile_n_gate_up) == 0``, ``H % (2 * tile_n_down) == 0`` and both divisible by
    ``tile_k`` (ValueError otherwise). ``num_sms`` CTAs (default: this GPU's SM count, else 132);
    ``interpret=True`` runs Mosaic GPU interpret mode on the CPU. ``stages``: the SMEM ring's depth, one
    value or a ``(gate_up, down)`` pair (default 3 for gate+up, 4 for down: see the module docstring).
    ``cross_tile`` (default: per kernel, where its reduction's steps, ``H / tile_k`` for gate+up and
    ``I / tile_k`` for down, are a multiple of its stages and this jax supports it) runs each CTA's
    tiles as one pipeline, so the next tile's first copies overlap this tile's last steps and
    epilogue; ``True`` where that cannot be raises ValueError, ``False`` drains the ring at every
    tile. Both also take a ``(gate_up, down)`` pair, one setting per kernel. ``gather``: kernel 1's
    input rows by XLA's take (``"xla"``), by TMA row copies (``"tma"``, where a row is one TMA
    box, `row_gather`; measured slower in the call), or none: ``"fused"`` runs kernel 1 as a CUDA call
    that reads the rows of ``x`` itself (`gate_up_cuda`: sm_90 GPUs, tile_m 128, tile_n_gate_up 64;
    ``stages``, ``cross_tile`` and ``tile_k`` then apply to the down kernel only; ValueError where it cannot run);
    ``"auto"`` (default): ``"fused"`` where it can run, else ``"xla"`` (always ``"xla"`` for int4).
    ``walk_band``: the order of the persistent grid's tiles. None: output-column blocks fastest
    (neighbouring CTAs share a row tile); an int B: per expert, bands of B row tiles fastest
    (neighbouring CTAs share a weight block, `routing.tile_walk`); a pair: (gate+up, down);
    ``"auto"`` (default): 2 for a kernel of 16+ output blocks and for the fused kernel 1, else None
    (`prefill_options.walk_bands`).
    ``plan_impl``: who builds the route tables (`route_tables`): ``"jnp"`` (XLA), ``"cuda"`` (one
    call of the host module's CUDA build, three small kernels) or ``"auto"`` (default: CUDA where it can run).
    ``fused_options``: where kernel 1 is the fused CUDA call, its kernel options (`gate_up_cuda.OPTIONS`) as
    ``(name, value)`` pairs (hashable), e.g. ``(("epilogue", "smem"),)``; None: `gate_up_cuda.gate_up`'s defaults.
    """
    check_routing(x, expert_ids, gate_weights, token_valid, slot_of_expert)
    gate_up_cuda.kernel_options(fused_options)  # checked even where kernel 1 is not the fused call
    hidden, inter = x.shape[1], down.shape[-1]
    if gate_up.shape[1:] != (2 * inter, hidden) or down.shape[1:] != (hidden, inter) \
            or gate_up.shape[0] != down.shape[0]:
        raise ValueError(f"banks gate_up {gate_up.shape} / down {down.shape} do not match "
                         f"x {x.shape}: want [S, 2I, H] and [S, H, I]")
    tiles = resolve_tiles(hidden, inter, int4=False, tile_m=tile_m,
                              tile_n_gate_up=tile_n_gate_up, tile_n_down=tile_n_down,
                              tile_k=tile_k, stages=stages, num_sms=num_sms, interpret=interpret,
                              cross_tile=cross_tile, gather=gather, walk_band=walk_band,
                              plan_impl=plan_impl)
    return _prefill(x, expert_ids, gate_weights, token_valid, slot_of_expert,
                    (gate_up.astype(jnp.bfloat16),), (down.astype(jnp.bfloat16),),
                    hidden=hidden, inter=inter, tiles=tiles, fused_options=fused_options)


def _as_int4(packed):
    """uint8 ``[.., cols/2]`` -> int4 ``[.., cols]`` view, low nibble first (jax's int4 order)."""
    q = lax.bitcast_convert_type(packed, jnp.int4)
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@functools.partial(jax.jit, static_argnames=_STATIC)
def prefill_experts_int4(x, expert_ids, gate_weights, token_valid, gate_up_packed,
                         gate_up_scales, down_packed, down_scales, slot_of_expert, *,
                         tile_m=128, tile_n_gate_up=64, tile_n_down=128, tile_k=64, stages=3,
                         num_sms=None, interpret=False, cross_tile=None, gather="auto",
                         walk_band="auto", plan_impl="auto"):
    """Mosaic GPU prefill expert MLP, int4 group-32 weights (host pool layout, `ftjax.host.quant`).

    gate_up_packed uint8 [S, 2I, H/2], gate_up_scales bf16 [S, 2I, H/32], down_packed uint8
    [S, H, I/2], down_scales bf16 [S, H, I/32]; the rest as `prefill_experts` (but ``stages`` 3 for both
    kernels by default: the int4 down kernel with 4 stages was not timed). Also needs
    ``H % 256 == 0`` and ``I % 256 == 0``. Same contract as `reference_prefill_experts_int4`.
    """
    check_routing(x, expert_ids, gate_weights, token_valid, slot_of_expert)
    hidden = x.shape[1]
    inter = down_packed.shape[-1] * 2
    want = {"gate_up_packed": (2 * inter, hidden // 2), "gate_up_scales": (2 * inter,
            hidden // QUANT_GROUP), "down_packed": (hidden, inter // 2),
            "down_scales": (hidden, inter // QUANT_GROUP)}
    got = {"gate_up_packed": gate_up_packed, "gate_up_scales": gate_up_scales,
           "down_packed": down_packed, "down_scales": down_scales}
    for name, arr in got.items():
        if arr.shape[1:] != want[name] or arr.shape[0] != gate_up_packed.shape[0]:
            raise ValueError(f"{name} is {arr.shape}, want [S, {', '.join(map(str, want[name]))}]"
                             f" for x {x.shape} and I = {inter}")
    for name in ("gate_up_packed", "down_packed"):
        if got[name].dtype != jnp.uint8:
            raise ValueError(f"{name} must be uint8 (two int4 per byte), got {got[name].dtype}")
    tiles = resolve_tiles(hidden, inter, int4=True, tile_m=tile_m,
                              tile_n_gate_up=tile_n_gate_up, tile_n_down=tile_n_down,
                              tile_k=tile_k, stages=stages, num_sms=num_sms, interpret=interpret,
                              cross_tile=cross_tile, gather=gather, walk_band=walk_band,
                              plan_impl=plan_impl)
    return _prefill(x, expert_ids, gate_weights, token_valid, slot_of_expert,
                    (_as_int4(gate_up_packed), gate_up_scales.astype(jnp.bfloat16)),
                    (_as_int4(down_packed), down_scales.astype(jnp.bfloat16)),
                    hidden=hidden, inter=inter, tiles=tiles)
