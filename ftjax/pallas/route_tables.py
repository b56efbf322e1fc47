"""The tables the prefill kernels read, from the router output: jnp (`routing`) or one CUDA call.

`prefill_gemm` needs, per call: each route's padded row (the combine's gather), each input row's
token (kernel 1's row gather), per row tile its cache slot, first input row and route count, the
launch's row-tile count, and each kernel's tile walk (`routing.tile_walk`). XLA builds them from
`routing.plan_routes` in ~28 small kernels (a radix sort, scatters, cumsums; ~80 us of GPU work and
as many launch gaps per call at 8K tokens on the H200, session 20); the ``ftjax_route_tables`` FFI
target (`cpp/route_tables_cuda.cu`) builds the same tables, bit for bit, in three launches (count per
block of routes, layout, rank per block).

``impl``: ``"jnp"`` (everywhere), ``"cuda"`` (a CUDA build of the host module with a GPU, up to
`CUDA_MAX_EXPERTS` experts; ValueError otherwise) or ``"auto"`` (CUDA where it can run).
Expert ids outside ``0..E-1`` are undefined in the jnp form; the CUDA form drops their routes.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ftjax.pallas import routing

IMPLS = ("auto", "cuda", "jnp")
CUDA_MAX_EXPERTS = 1024  # the rank kernel's per-warp counts are 8 x E int32 of shared memory
MAX_BLOCKS = 256  # the CUDA form's grid: a block per ROUTES_PER_BLOCK routes, at most this many
ROUTES_PER_BLOCK = 2048


class RouteTables(NamedTuple):
    """All int32 device arrays; ``num_rows`` = `routing.padded_rows_bound`, ``M = num_rows / tile``."""

    row_of_route: jax.Array  # [T*k] padded row of each route; num_rows for dropped routes
    token_of_input_row: jax.Array  # [input rows] token of each kernel-1 input row (0: padding)
    tile_slot: jax.Array  # [M] cache slot of each row tile's expert (clamped into the cache)
    tile_row0: jax.Array  # [M] input row of each row tile's first row (0 if idle)
    tile_rows: jax.Array  # [M] rows of each row tile that hold routes (0 if idle)
    n_launch: jax.Array  # [1] max(row tiles in use, 1): the kernels never launch empty
    walks: tuple  # per kernel (gate+up, down): [M * n_blocks] work item -> tile, or None


def cuda_available() -> bool:
    """Whether the ``ftjax_route_tables`` target can run here."""
    from ftjax.host import cuda

    return cuda.available()


def resolve_impl(impl: str, num_experts: int, *, interpret: bool = False) -> str:
    """``impl`` as ``"cuda"`` or ``"jnp"`` (ValueError for an unknown name, or for ``"cuda"`` where it
    cannot run). Interpret mode always takes jnp under "auto"."""
    if impl not in IMPLS:
        raise ValueError(f"plan_impl must be one of {IMPLS}, got {impl!r}")
    if impl == "jnp":
        return impl
    fits = num_experts <= CUDA_MAX_EXPERTS
    if impl == "auto":
        return "cuda" if fits and not interpret and cuda_available() else "jnp"
    if not fits:
        raise ValueError(f"plan_impl='cuda' handles up to {CUDA_MAX_EXPERTS} experts, got {num_experts}; "
                         f"use 'jnp'")
    if interpret or not cuda_available():
        raise ValueError("plan_impl='cuda' needs a CUDA build of ftjax._host, a GPU and JAX's GPU backend "
                         "(and not interpret mode); use 'jnp' or 'auto'")
    return impl


def route_tables(expert_ids, token_valid, slot_of_expert, *, n_slots: int, tile: int,
                 walks=((1, None), (1, None)), impl: str = "jnp") -> RouteTables:
    """The prefill kernels' tables for ``expert_ids [T, k]``, ``token_valid [T]`` or ``[T, k]``,
    ``slot_of_expert [E]``; ``walks``: per kernel ``(n_blocks, band)``, band None for no walk table.
    ``impl``: "jnp" or "cuda" (`resolve_impl` first for "auto")."""
    if len(walks) != 2:
        raise ValueError(f"walks must be two (n_blocks, band) pairs, got {walks!r}")
    if impl == "cuda":
        return _cuda_tables(expert_ids, token_valid, slot_of_expert, n_slots=n_slots, tile=tile, walks=walks)
    if impl != "jnp":
        raise ValueError(f"route_tables takes impl 'jnp' or 'cuda' (resolve 'auto' first), got {impl!r}")
    return _jnp_tables(expert_ids, token_valid, slot_of_expert, n_slots=n_slots, tile=tile, walks=walks)


def _jnp_tables(expert_ids, token_valid, slot_of_expert, *, n_slots, tile, walks):
    num_experts = slot_of_expert.shape[0]
    plan = routing.plan_routes(expert_ids, token_valid, num_experts, tile)
    # materialized before the gather and the combine: without this barrier XLA fused the plan's index
    # math (searchsorted, gathers) into both and recomputed it for every element: 4.2 + 1.6 ms of glue
    # beside 0.78 ms of kernels at 8K tokens (session 10). Only the fields used below pass it; XLA
    # drops the rest (the padded layout's per-row route map, the sort's order).
    used = ("group_sizes", "padded_starts", "row_of_route", "tile_group", "tile_row0",
            "token_of_input_row", "tile_rows", "n_tiles")
    plan = plan._replace(**dict(zip(used, lax.optimization_barrier(
        tuple(getattr(plan, name) for name in used)))))
    tile_slot = jnp.clip(slot_of_expert.astype(jnp.int32)[plan.tile_group], 0, n_slots - 1)
    walk_tables = tuple(None if band is None else routing.tile_walk(plan, tile, n_blocks, band)
                        for n_blocks, band in walks)
    return RouteTables(plan.row_of_route, plan.token_of_input_row, tile_slot, plan.tile_row0,
                       plan.tile_rows, jnp.maximum(plan.n_tiles, 1).reshape(1), walk_tables)


def _cuda_tables(expert_ids, token_valid, slot_of_expert, *, n_slots, tile, walks):
    from ftjax.host.ffi import register_targets

    register_targets()
    num_tokens, top_k = expert_ids.shape
    num_experts = slot_of_expert.shape[0]
    routes = num_tokens * top_k
    num_rows = routing.padded_rows_bound(routes, num_experts, tile)
    in_rows = routing.padded_rows_bound(routes, num_experts, routing.INPUT_ALIGN) + tile
    n_row_tiles = num_rows // tile

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    walk_shapes = [i32(n_row_tiles * n_blocks) if band is not None else i32(1) for n_blocks, band in walks]
    grid = min(MAX_BLOCKS, max(1, -(-routes // ROUTES_PER_BLOCK)))
    call = jax.ffi.ffi_call("ftjax_route_tables", [i32(routes), i32(in_rows), i32(n_row_tiles), i32(n_row_tiles),
                                                   i32(n_row_tiles), i32(1), *walk_shapes,
                                                   i32((grid + 2) * num_experts)])  # the last: scratch
    (w0_blocks, w0_band), (w1_blocks, w1_band) = walks
    out = call(expert_ids.astype(jnp.int32).reshape(-1), token_valid.astype(bool).reshape(-1),
               slot_of_expert.astype(jnp.int32),
               top_k=np.int64(top_k), tile=np.int64(tile), num_rows=np.int64(num_rows),
               n_slots=np.int64(n_slots), valid_per_route=np.int64(token_valid.ndim == 2),
               walk0_blocks=np.int64(w0_blocks), walk0_band=np.int64(w0_band or 0),
               walk1_blocks=np.int64(w1_blocks), walk1_band=np.int64(w1_band or 0), grid=np.int64(grid))
    walk_tables = tuple(None if band is None else table for (_, band), table in zip(walks, out[6:8]))
    return RouteTables(*out[:6], walk_tables)
