"""Route sorting for the grouped expert kernels: routes grouped by expert, in a padded row layout.

A route is one (token, choice) pair of the router output ``expert_ids [T, k]``; flat route
``r = t * k + j``. Grouped matmuls want the routes of each expert contiguous, and a kernel whose
row tiles never straddle two experts wants each group padded to a multiple of the row tile:

    group g (expert g) occupies rows ``padded_starts[g] .. padded_starts[g] + sizes[g]`` of a
    ``[num_rows, H]`` buffer, followed by ``round_up(sizes[g], tile) - sizes[g]`` padding rows.

Empty groups occupy no rows and no tiles. The padded total is data dependent; its upper bound
(`padded_rows_bound`) fixes every shape: with ``n`` non-empty groups the padding is at most
``n * (tile - 1)`` rows and ``n <= min(E, R)``. Row tiles ``0 .. n_tiles - 1`` are the active
ones (``tile_group`` names their expert); the rest of the buffer is never computed.

Routes of invalid tokens belong to no group: their padded row is the sentinel ``num_rows``.

The kernels' *input* rows need little padding: `gather_input_rows` writes ``x`` in the sorted
order with each group starting on a multiple of ``INPUT_ALIGN`` (8) rows (a TMA copy into a
tiled SMEM tile starts on a whole 8-row tile), then ``tile`` spare rows; row tile m reads its
``tile`` rows from ``tile_row0[m]`` on. The rows of a tile past its group's routes are the next
group's (or spare) rows: finite values whose results land in padding rows that nothing reads. At
8K tokens (256 experts, tile 128) that writes ~66,000 rows instead of ~98,000.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


INPUT_ALIGN = 8  # rows: group starts in the kernels' input buffer (`gather_input_rows`)


class RoutePlan(NamedTuple):
    """Where each route goes in the padded, expert-sorted row layout (all int32 device arrays)."""

    order: jax.Array  # [R] sorted position -> flat route (by expert, stable; invalid routes last)
    rank: jax.Array  # [R] flat route -> sorted position (inverse of `order`)
    group_sizes: jax.Array  # [E] valid routes per expert
    group_starts: jax.Array  # [E] first sorted position of each group (unpadded)
    padded_starts: jax.Array  # [E] first row of each group in the padded layout
    row_of_route: jax.Array  # [R] padded row of each route; num_rows for invalid routes
    route_of_row: jax.Array  # [num_rows] flat route at each padded row; R for padding rows
    tile_group: jax.Array  # [num_rows // tile] expert of each row tile (clamped for idle tiles)
    tile_row0: jax.Array  # [num_rows // tile] input-buffer row of each row tile's first row (0 if idle)
    token_of_input_row: jax.Array  # [input rows] token gathered into each input-buffer row
    tile_rows: jax.Array  # [num_rows // tile] rows of each row tile that hold routes (0 if idle)
    n_tiles: jax.Array  # [] row tiles in use: rows 0 .. n_tiles * tile - 1


def padded_rows_bound(num_routes: int, num_groups: int, tile: int) -> int:
    """Static upper bound on the padded row count: a multiple of `tile`, at least one tile."""
    if num_routes < 0 or num_groups < 1 or tile < 1:
        raise ValueError(f"need num_routes >= 0, num_groups >= 1, tile >= 1; got "
                         f"{num_routes}, {num_groups}, {tile}")
    bound = num_routes + min(num_groups, num_routes) * (tile - 1)
    return max(tile, bound // tile * tile)


def sort_routes(group_ids: jax.Array, valid: jax.Array, num_groups: int):
    """Stable sort of routes by group. ``group_ids [R]`` in ``0..num_groups-1``; ``valid [R]`` bool.

    Returns ``(order, rank, group_sizes, group_starts)``: ``order[p]`` is the route at sorted
    position p (invalid routes after every group), ``rank`` its inverse, ``group_sizes [G]`` the
    valid routes per group and ``group_starts [G]`` their exclusive cumulative sum.
    """
    num_routes = group_ids.shape[0]
    key = jnp.where(valid, group_ids.astype(jnp.int32), num_groups)
    # 16-bit sort keys where the groups fit (the radix sort's passes follow the key width: the
    # stable argsort of 65,536 routes on uint16 keys took 0.32 of the int32 one alone on the H200,
    # bench/prefill_glue.py, session 20); the same order either way
    sort_key = key.astype(jnp.uint16) if num_groups < 2**16 - 1 else key
    order = jnp.argsort(sort_key, stable=True).astype(jnp.int32)
    rank = jnp.zeros(num_routes, jnp.int32).at[order].set(jnp.arange(num_routes, dtype=jnp.int32),
                                                          unique_indices=True)  # a permutation
    sizes = jnp.zeros(num_groups + 1, jnp.int32).at[key].add(1)[:num_groups]
    starts = jnp.cumsum(sizes) - sizes
    return order, rank, sizes, starts


def plan_routes(expert_ids: jax.Array, token_valid: jax.Array, num_experts: int,
                tile: int) -> RoutePlan:
    """Sort the routes of ``expert_ids [T, k]`` by expert into groups padded to ``tile`` rows.
    ``token_valid`` is ``[T]`` (every route of a valid token) or ``[T, k]`` (per route)."""
    num_tokens, top_k = expert_ids.shape
    num_routes = num_tokens * top_k
    num_rows = padded_rows_bound(num_routes, num_experts, tile)
    valid = (token_valid.astype(bool).reshape(-1) if token_valid.ndim == 2
             else jnp.repeat(token_valid.astype(bool), top_k))
    order, rank, sizes, starts = sort_routes(expert_ids.reshape(-1), valid, num_experts)

    padded_starts, padded_ends, is_route, route = _group_layout(order, sizes, starts, num_rows, tile)
    group = jnp.clip(expert_ids.reshape(-1).astype(jnp.int32), 0, num_experts - 1)
    row = padded_starts[group] + rank - starts[group]
    row_of_route = jnp.where(valid, row, num_rows).astype(jnp.int32)
    route_of_row = jnp.where(is_route, route, num_routes).astype(jnp.int32)

    rows = jnp.arange(num_rows, dtype=jnp.int32)
    tile_first = rows[::tile]
    tile_group = jnp.minimum(_group_of(padded_ends, tile_first), num_experts - 1).astype(jnp.int32)
    n_tiles = (padded_ends[-1] // tile).astype(jnp.int32)

    # The kernels' input rows: the same groups, each starting on an INPUT_ALIGN-row boundary; each
    # valid route writes its token into its row (one scatter; padding and spare rows: token 0).
    num_in = padded_rows_bound(num_routes, num_experts, INPUT_ALIGN)
    in_sizes = (sizes + INPUT_ALIGN - 1) // INPUT_ALIGN * INPUT_ALIGN
    in_starts = jnp.cumsum(in_sizes) - in_sizes
    in_row = jnp.where(valid, in_starts[group] + rank - starts[group], num_in + tile)  # dropped
    token_of_input_row = jnp.zeros(num_in + tile, jnp.int32).at[in_row].set(
        jnp.arange(num_routes, dtype=jnp.int32) // top_k, mode="drop", unique_indices=True)
    active = tile_first < padded_ends[-1]
    in_group = tile_first - padded_starts[tile_group]  # the tile's first row within its group
    tile_row0 = jnp.where(active, in_starts[tile_group] + in_group, 0)
    tile_rows = jnp.where(active, jnp.clip(sizes[tile_group] - in_group, 0, tile), 0)
    return RoutePlan(order, rank, sizes, starts, padded_starts.astype(jnp.int32), row_of_route,
                     route_of_row, tile_group, tile_row0.astype(jnp.int32),
                     token_of_input_row.astype(jnp.int32), tile_rows.astype(jnp.int32), n_tiles)


def _group_of(ends, rows):
    """``searchsorted(ends, rows, side="right")`` as one comparison fusion, no loop: the default
    binary search is a while loop per call (three in the plan), each ~9 rounds of small kernels
    and device copies on the GPU (the plan at 8K tokens, 256 experts ran 36 device copies and 36
    loop fusions per call, ~70 us of events and their launch gaps; session 11)."""
    return jnp.searchsorted(ends, rows, side="right", method="compare_all")


def _group_layout(order, sizes, starts, num_rows: int, multiple: int):
    """Groups in sorted order, each padded to a multiple of ``multiple`` rows, over ``num_rows``.

    Returns ``(padded_starts, padded_ends)`` per group and, per row, ``(is_route, route)``: whether
    the row holds a route, and which (meaningless where it does not).
    """
    num_groups, num_routes = sizes.shape[0], order.shape[0]
    padded_sizes = (sizes + multiple - 1) // multiple * multiple
    padded_ends = jnp.cumsum(padded_sizes)
    padded_starts = padded_ends - padded_sizes
    # Row p lies in the group whose padded range holds it; past the group's routes it is padding.
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    g_of_row = jnp.minimum(_group_of(padded_ends, rows), num_groups - 1)
    pos = rows - padded_starts[g_of_row]
    is_route = (pos < sizes[g_of_row]) & (rows < padded_ends[-1])
    sorted_pos = jnp.clip(starts[g_of_row] + pos, 0, max(num_routes - 1, 0))
    route = order[sorted_pos] if num_routes else jnp.zeros_like(rows)
    return padded_starts, padded_ends, is_route, route


def gather_input_rows(x: jax.Array, plan: RoutePlan) -> jax.Array:
    """``x [T, H]`` -> the kernels' input rows ``[len(plan.token_of_input_row), H]``: each group's
    tokens in sorted order from an ``INPUT_ALIGN``-row boundary on (`plan_routes`), then spare rows,
    every row a copy of some row of ``x`` (padding rows: row 0).

    A plain row take, on ``x`` viewed as 32-bit words where its rows allow (two bf16 per word:
    171 us against 258 for bf16 words and 370 for the zero-padded select, for ~98,000 rows at
    H 2048 on the H200, `bench/prefill_glue.py`).
    """
    num_tokens, hidden = x.shape
    idx = plan.token_of_input_row
    if num_tokens == 0:
        return jnp.zeros((idx.shape[0], hidden), x.dtype)
    if x.dtype.itemsize == 2 and hidden % 2 == 0:
        words = lax.bitcast_convert_type(x.reshape(num_tokens, hidden // 2, 2), jnp.uint32)
        return lax.bitcast_convert_type(words[idx], x.dtype).reshape(idx.shape[0], hidden)
    return x[idx]


def combine_rows(rows: jax.Array, plan: RoutePlan, gate_weights: jax.Array) -> jax.Array:
    """Weighted sum over each token's routes, fp32: ``y[t] = sum_j w[t, j] * rows[row(t, j)]``.

    A gather per route (no scatter, so deterministic); routes of invalid tokens add nothing.
    """
    num_tokens, top_k = gate_weights.shape
    num_rows = rows.shape[0]
    valid = plan.row_of_route < num_rows
    picked = rows[jnp.where(valid, plan.row_of_route, 0)].astype(jnp.float32)
    w = jnp.where(valid, gate_weights.reshape(-1).astype(jnp.float32), 0.0)
    # where, not a multiply by 0: a garbage row must not leak NaN into the sum.
    contrib = jnp.where(valid[:, None], picked * w[:, None], 0.0)
    return contrib.reshape(num_tokens, top_k, -1).sum(axis=1)


def tile_walk(plan: RoutePlan, tile: int, n_blocks: int, band: int) -> jax.Array:
    """The order in which a persistent grid walks the output tiles ``(m, n)`` of a grouped matmul
    (``m`` a row tile of `plan`, ``n`` one of ``n_blocks`` output-column blocks): work item ``i``
    computes tile ``walk[i] = m * n_blocks + n``. ``[num_tiles * n_blocks]`` int32, a permutation.

    Per expert, in bands of ``band`` row tiles, the band's row tiles fastest, then the column
    blocks: consecutive work items (so CTAs running at the same time) read the same weight block
    of one expert, each weight byte serving ``band * tile`` rows while it is in L2, and a row tile
    is read by ``n_blocks`` CTAs at most ``band`` items apart. Groups follow each other in row-tile
    order. Items past the active tiles keep the row-major order ``m * n_blocks + n`` (with no tile
    in use the kernels compute row tile 0, whose work items are ``0 .. n_blocks - 1``).
    """
    if band < 1 or n_blocks < 1:
        raise ValueError(f"band and n_blocks must be >= 1, got {band}, {n_blocks}")
    num_tiles = plan.tile_group.shape[0]
    m = jnp.arange(num_tiles, dtype=jnp.int32)
    group = plan.tile_group
    first = plan.padded_starts[group] // tile  # the group's first row tile
    count = (plan.group_sizes[group] + tile - 1) // tile  # its row tiles
    band_first = first + (m - first) // band * band
    band_count = jnp.minimum(band, first + count - band_first)
    n = jnp.arange(n_blocks, dtype=jnp.int32)
    pos = band_first[:, None] * n_blocks + n[None, :] * band_count[:, None] + (m - band_first)[:, None]
    active = (m < plan.n_tiles)[:, None]
    size = num_tiles * n_blocks
    pos = jnp.where(active, pos, size)  # dropped: idle tiles keep the identity order
    code = m[:, None] * n_blocks + n[None, :]
    return jnp.arange(size, dtype=jnp.int32).at[pos.reshape(-1)].set(code.reshape(-1), mode="drop")
