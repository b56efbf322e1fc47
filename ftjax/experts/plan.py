"""The plan of one MoE layer in one step (DESIGN.md mechanisms 1-3): fixed shapes, no host sync.

Per call: de-duplicate the routed experts of the batch (capacity ``U = min(T*k, E)``, sentinel-padded);
split them into hits and unique misses (m); choose ``n_fill`` misses to copy into LRU victim slots
(most recently active misses first) and leave the other ``m - n_fill`` to the CPU; update the cache
maps in place. Everything dynamic is data: id/slot lists of static capacity plus device counts.

The split (:func:`balance_fill`): with ``f = B_P / B_H``, filling F of m misses costs time
``F / B_P`` on PCIe and ``(m - F) / (B_H - B_P)`` on the CPU (the fill's DRAM reads slow the CPU
down), balanced at the paper's ``q* = m * B_P / B_H``. We take floor(q*) or floor(q*)+1, whichever
makes the slower side faster; at least 1 when m > 0; at most the fill cap and the evictable slots.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

FILL_RULES = ("balance", "all", "none")
ALL_UNITS = 1 << 30  # route_units of a route computed whole (no unit split): more than any expert's units


class LayerPlan(NamedTuple):
    """What the decode step executes for one layer (``R = T*k`` routes in order ``t*k + j``)."""

    route_slot: jax.Array    # [R] i32: cache slot of a route served on the GPU, -1 otherwise
    cpu_routes: jax.Array    # [R] i32: route indices, the n_cpu_routes CPU routes first
    n_cpu_routes: jax.Array  # [] i32
    fill_ids: jax.Array      # [F] i32: flat ids to copy from the host pool (first n_fill valid)
    fill_slots: jax.Array    # [F] i32: their slots
    n_fill: jax.Array        # [] i32
    hits: jax.Array          # [] i32 unique experts already resident
    misses: jax.Array        # [] i32 unique experts not resident (m)
    cpu_experts: jax.Array   # [] i32 unique experts computed on the CPU (m - n_fill; m when deferred)
    deferred: jax.Array      # [] bool: the fills run in the background (their experts on the CPU now)
    route_units: jax.Array   # [R] i32: intermediate units [0, u) a GPU route computes (I: the whole expert)
    cpu_units: jax.Array     # [R] i32: per CPU route (cpu_routes order), its first unit (0: the whole expert)
    fill_units: jax.Array    # [] i32: a split call copies units [0, u) of its fills now (I, or ALL_UNITS
                             # without a unit split: whole experts)


def balance_fill(m: jax.Array, fill_fraction: jax.Array) -> jax.Array:
    """floor(m f) or floor(m f) + 1, whichever minimises max(F (1 - f), (m - F) f); >= 1 when m > 0."""
    f = jnp.clip(fill_fraction.astype(jnp.float32), 0.0, 1.0)
    mf = m.astype(jnp.float32)
    lo = jnp.minimum(jnp.floor(mf * f).astype(jnp.int32), m)
    hi = jnp.minimum(lo + 1, m)

    def slower(F):
        Ff = F.astype(jnp.float32)
        return jnp.maximum(Ff * (1.0 - f), (mf - Ff) * f)

    n = jnp.where(slower(hi) < slower(lo), hi, lo)
    return jnp.where(m > 0, jnp.maximum(n, 1), 0)


def defer_fills(m: jax.Array, n_fill: jax.Array, fill_fraction: jax.Array) -> jax.Array:
    """Whether computing all ``m`` misses on the CPU now, with the ``n_fill`` fills in the background
    (hidden behind later GPU work), beats the split's critical path: ``m f < max(n_fill (1 - f),
    (m - n_fill) f)`` in :func:`balance_fill`'s units (f = B_P / (B_P + B_H)). At f < 1/2 (PCIe slower
    than the CPU's DRAM) a lone miss (m = 1) is deferred; with the H200's figures (f ~ 0.36) only that."""
    f = jnp.clip(fill_fraction.astype(jnp.float32), 0.0, 1.0)
    mf, nf = m.astype(jnp.float32), n_fill.astype(jnp.float32)
    return (n_fill > 0) & (mf * f < jnp.maximum(nf * (1.0 - f), (mf - nf) * f))


def split_units(m: jax.Array, n_fill: jax.Array, fill_fraction: jax.Array, num_units: int,
                granule: int) -> jax.Array:
    """Units ``u`` of each of the ``n_fill`` experts a unit-split call fills synchronously (the CPU
    computes their units ``[u, I)`` beside the ``m - n_fill`` whole misses): the share ``q = m f / n_fill``
    that balances ``n_fill q`` expert fills on PCIe against ``m - n_fill q`` experts on the CPU (``f =
    B_P / (B_P + B_H)``), capped at 1, rounded to ``granule`` units (an int4 group for int4 pools).
    ``u = I``: whole fills (no split); ``u = 0``: every unit on the CPU."""
    f = jnp.clip(fill_fraction.astype(jnp.float32), 0.0, 1.0)
    q = jnp.minimum(1.0, m.astype(jnp.float32) * f / jnp.maximum(n_fill, 1).astype(jnp.float32))
    steps = num_units // granule
    return (jnp.round(q * steps).astype(jnp.int32) * granule).clip(0, num_units)


def compact(mask: jax.Array, size: int, fill_value: int | None) -> jax.Array:
    """Indices where ``mask`` holds, ascending, in ``size`` entries; then ``fill_value``, or (None) the
    other indices ascending (a stable partition). Scatter-based: no sort."""
    n = mask.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    pos = jnp.cumsum(mask, dtype=jnp.int32) - 1
    if fill_value is None:
        pos = jnp.where(mask, pos, jnp.sum(mask, dtype=jnp.int32) + jnp.cumsum(~mask, dtype=jnp.int32) - 1)
        return jnp.zeros((size,), jnp.int32).at[pos].set(idx, mode="drop")
    return jnp.full((size,), fill_value, jnp.int32).at[jnp.where(mask, pos, size)].set(idx, mode="drop")


def compact_dense(mask: jax.Array, size: int, fill_value: int | None) -> jax.Array:
    """:func:`compact` without a scatter: each output entry picks its index out of an ``[size, n]``
    comparison (a fused select and reduction; for the short lists of a decode step)."""
    n = mask.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    pos = jnp.cumsum(mask, dtype=jnp.int32) - 1
    if fill_value is None:
        pos = jnp.where(mask, pos, jnp.sum(mask, dtype=jnp.int32) + jnp.cumsum(~mask, dtype=jnp.int32) - 1)
        return jnp.sum(jnp.where(pos[None, :] == jnp.arange(size, dtype=jnp.int32)[:, None], idx[None, :], 0),
                       axis=1, dtype=jnp.int32)
    pick = mask[None, :] & (pos[None, :] == jnp.arange(size, dtype=jnp.int32)[:, None])
    return jnp.min(jnp.where(pick, idx[None, :], jnp.int32(fill_value)), axis=1)


def set_at(arr: jax.Array, idx: jax.Array, vals, valid: jax.Array, dense: bool) -> jax.Array:
    """``arr`` with ``arr[idx[j]] = vals[j]`` where ``valid[j]`` (the valid indices distinct): a scatter,
    or (``dense``) one select over the whole array against the short index list."""
    vals = jnp.broadcast_to(jnp.asarray(vals, arr.dtype), idx.shape)
    if not dense:
        return arr.at[jnp.where(valid, idx, arr.shape[0])].set(vals, mode="drop")
    match = (jnp.arange(arr.shape[0], dtype=jnp.int32)[:, None] == idx[None, :]) & valid[None, :]
    return jnp.where(match.any(axis=1), jnp.sum(jnp.where(match, vals[None, :], 0), axis=1, dtype=arr.dtype), arr)


def rank_misses(miss: jax.Array, recency: jax.Array, ids: jax.Array, dense: bool = False) -> jax.Array:
    """Order of the unique experts: misses first, most recently routed first, ties to the lower id.

    Pairwise ranks over the ``U <= E`` unique experts (no sort; distinct ids make the order total)."""
    mi, mj = miss[:, None], miss[None, :]
    ri, rj = recency[:, None], recency[None, :]
    before = (mj & ~mi) | ((mj == mi) & ((rj > ri) | ((rj == ri) & (ids[None, :] < ids[:, None]))))
    rank = jnp.sum(before, axis=1, dtype=jnp.int32)  # how many go before entry i
    idx = jnp.arange(rank.shape[0], dtype=jnp.int32)
    if dense:  # rank is a permutation: entry p is the one i with rank[i] == p
        return jnp.sum(jnp.where(rank[None, :] == idx[:, None], idx[None, :], 0), axis=1, dtype=jnp.int32)
    return jnp.zeros_like(rank).at[rank].set(idx)


def fill_capacity(num_routes: int, num_experts: int, num_slots: int, fill_cap: int | None, rule: str) -> int:
    """Static length of the fill lists: the most misses one call can fill."""
    if rule == "none" or num_slots == 0:
        return 0
    cap = min(num_routes, num_experts, num_slots)
    return cap if fill_cap is None else min(cap, fill_cap)


TOPK_CHUNK = 16  # XLA:GPU's own top-k kernel: f32/bf16, k <= 16, rows >= 1024 (TopkSpecializer)


def lru_victims(last_use: jax.Array, step: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """The ``count`` least recently used slots (ties to the lower slot) and how many of them are evictable
    (not used in this step: ``last_use < step``).

    Ranked by age ``step - last_use`` as f32 in rounds of at most 16, each round masking the slots it took:
    XLA:GPU runs f32 top-k with k <= 16 over >= 1024 entries as one kernel of its own, where an int32 top-k
    becomes a sort of all ``S`` slots (each layer, on the step's critical path before the fill). Ages
    below 2**24 layer calls are exact in f32; older ones may merge, which only reorders slots that old.
    A slot used in this step has age 0 and every other age is >= 1, so the evictable ones come first."""
    age = (step - last_use).astype(jnp.float32)
    slots, ages = [], []
    for c in range(0, count, TOPK_CHUNK):
        val, idx = lax.top_k(age, min(TOPK_CHUNK, count - c))
        slots.append(idx.astype(jnp.int32))
        ages.append(val)
        if c + TOPK_CHUNK < count:
            age = age.at[idx].set(-1.0)  # below every real age: the next round ranks the rest
    slots, ages = jnp.concatenate(slots), jnp.concatenate(ages)
    return slots, jnp.sum(ages > 0, dtype=jnp.int32)


def lru_victims_rank(last_use: jax.Array, step: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """`lru_victims` by counting, without top-k or sort: same slots, same order (tested).

    Each slot's rank is the number of slots before it in LRU order (older ``last_use``, ties to the
    lower slot): one compare-and-count over ``S x S`` pairs, a single reduction kernel with no memory
    traffic beyond ``last_use``; victim ``j`` is the slot of rank ``j`` (a ``[count, S]`` reduction).
    Two kernels whatever ``count`` is, where the top-k form runs one XLA:GPU top-k kernel per 16
    victims (16 us each on the H200 over 3,788 slots, session 8). ``S^2`` compares: meant for the GPU,
    on the CPU backend the top-k form is the faster one."""
    S = last_use.shape[0]
    lu = last_use.astype(jnp.int32)
    slot = jnp.arange(S, dtype=jnp.int32)
    before = (lu[None, :] < lu[:, None]) | ((lu[None, :] == lu[:, None]) & (slot[None, :] < slot[:, None]))
    rank = jnp.sum(before, axis=1, dtype=jnp.int32)
    pick = rank[None, :] == jnp.arange(count, dtype=jnp.int32)[:, None]
    victims = jnp.sum(jnp.where(pick, slot[None, :], 0), axis=1, dtype=jnp.int32)
    return victims, jnp.minimum(jnp.sum(lu < step, dtype=jnp.int32), count)


VICTIM_METHODS = {"topk": lru_victims, "rank": lru_victims_rank}


# The LRU clock (``step``, one tick per MoE layer call) is int32: 40 layers at 100 steps/s reach 2^31 in
# six days. Layer 0 of a step rebases it once it passes REBASE_AT: every stamp moves back by REBASE_BY,
# stamps older than that collapse to 0 (still "used once", still after the never-used -1), so the order
# of the last REBASE_BY calls (~13,000 decode steps of 40 layers) is exact and nothing overflows.
REBASE_AT = 1 << 30
REBASE_BY = 1 << 29


def rebase_clock(cache: dict) -> dict:
    """``cache`` with the LRU clock moved back by REBASE_BY when it has passed REBASE_AT (else as is)."""
    shift = jnp.where(cache["step"] >= REBASE_AT, REBASE_BY, 0).astype(jnp.int32)

    def back(stamps):
        return jnp.where(stamps >= 0, jnp.maximum(stamps - shift, 0), stamps)

    return dict(cache, step=cache["step"] - shift, last_use=back(cache["last_use"]), recency=back(cache["recency"]))


PLAN_IMPLS = ("scatter", "mixed", "dense", "fused")
DENSE_MAX_ROUTES = 64  # "mixed": the call-sized parts dense up to this many routes per call (decode)


def plan_layer(cache: dict, layer: int, expert_ids: jax.Array, token_valid: jax.Array, *, num_experts: int,
               rule: str = "balance", fill_cap: int | None = None, update: bool = True,
               impl: str = "scatter", victims_by: str = "topk", defer_horizon: int = 0,
               unit_split: tuple[int, int] | None = None) -> tuple[LayerPlan, dict]:
    """Plan one MoE layer call and return the updated cache maps (banks untouched: the caller fills).

    ``expert_ids [T, k]`` per-layer ids; ``token_valid [T]``. ``rule``: "balance" (the miss split with
    ``cache["fill_fraction"]``), "all" (fill every miss the pool can take), "none" (no fills: every
    miss on the CPU). ``update=False`` freezes the cache (no LRU bookkeeping): the static policies.
    ``impl``: how the state is updated, with the same results (tested). "scatter" (default): an XLA
    scatter per update. "dense": every update a select over the whole array against the call's short
    lists, the layer's own entries through a static slice. "mixed": the call-sized parts dense (dedup,
    the CPU route list, rank of the misses, statistics, recency; up to ``DENSE_MAX_ROUTES`` routes per
    call) and the global maps (``slot_of``, ``owner_of``, ``last_use``) by scatter. A CPU-compiled
    4-layer decode step has 382 fusions with scatter, 331 mixed, 306 dense (a fusion is a kernel in the
    GPU's step graph, where a batch-1 plan is a chain of tiny kernels); on the CPU backend scatter is the
    fastest at batch 1 (bench/plan.py: 29 / 43 / 54 us per layer); on the H200 (session 8, 40 layers,
    3,788 slots, batch 1) lru-split 36.6 / 40.5 / 61.6 us. "fused": the whole plan in one native call
    (``ftjax.experts.plan_fused``: one thread on the CPU backend, one thread block on the GPU; exact LRU
    order whatever ``victims_by``). ``victims_by``: how the LRU victims are ranked, "topk" (`lru_victims`)
    or "rank" (`lru_victims_rank`); same slots.

    ``defer_horizon`` > 0 (rule "balance" only) lets a call defer its fills (:func:`defer_fills`): the
    maps are updated as for any fill, but the call's missed experts are served on the CPU
    (``route_slot`` -1) and the caller may complete the fills in the background, joining them before the
    layer's next call. The filled slots get ``last_use = step + defer_horizon`` (the clock value of the
    layer's next call: one tick per MoE layer call, so the number of MoE layers), so no call before that
    one can choose them as victims: nothing overwrites or reads a slot while its background fill runs.

    ``unit_split = (I, granule)`` (with ``defer_horizon`` > 0, instead of deferring whole experts) splits
    the experts a call fills by intermediate units (:func:`split_units`): their routes keep their slots
    for units ``[0, u)`` (``route_units``; the caller fills those units now) and also go to the CPU for
    ``[u, I)`` (``cpu_units``); a call with ``u < I`` is ``deferred``: its slots are completed in the
    background, protected as above.
    """
    if rule not in FILL_RULES:
        raise ValueError(f"fill rule {rule!r} unknown; valid: {FILL_RULES}")
    if impl not in PLAN_IMPLS:
        raise ValueError(f"plan impl {impl!r} unknown; valid: {PLAN_IMPLS}")
    if victims_by not in VICTIM_METHODS:
        raise ValueError(f"victims_by {victims_by!r} unknown; valid: {tuple(VICTIM_METHODS)}")
    T, k = expert_ids.shape
    E, R = num_experts, T * k
    dense = impl == "dense" or (impl == "mixed" and R <= DENSE_MAX_ROUTES)  # the call-sized parts
    dense_maps = impl == "dense"  # the global maps
    if defer_horizon < 0:
        raise ValueError(f"defer_horizon must be >= 0, got {defer_horizon}")
    defer = defer_horizon > 0 and rule == "balance" and update
    if unit_split is not None and (unit_split[1] < 1 or unit_split[0] % unit_split[1]):
        raise ValueError(f"unit_split (I, granule) = {unit_split}: the granule must divide I")
    if impl == "fused":  # the same plan in one native call (one kernel on the GPU)
        from ftjax.experts.plan_fused import plan_layer_fused

        return plan_layer_fused(cache, layer, expert_ids, token_valid, num_experts=num_experts, rule=rule,
                                fill_cap=fill_cap, update=update, defer_horizon=defer_horizon, unit_split=unit_split)
    if layer == 0 and update:
        cache = rebase_clock(cache)
    S, N = cache["owner_of"].shape[0], cache["slot_of"].shape[0]
    U = min(R, E)
    F = fill_capacity(R, E, S, fill_cap, rule) if update else 0

    ids = expert_ids.reshape(-1).astype(jnp.int32)
    route_valid = jnp.repeat(token_valid, k)
    flat_routes = layer * E + ids
    step = cache["step"] + 1

    # De-duplicate over the layer's E experts: ascending ids, sentinel E after the last one.
    if dense:  # valid routes per expert of the layer
        routed = jnp.sum((ids[:, None] == jnp.arange(E, dtype=jnp.int32)[None, :]) & route_valid[:, None],
                         axis=0, dtype=jnp.int32)
        present = routed > 0
        uniq = compact_dense(present, U, fill_value=E)
    else:
        present = jnp.zeros((E,), jnp.int32).at[ids].max(route_valid.astype(jnp.int32)) > 0
        uniq = compact(present, U, fill_value=E)
    uniq_valid = uniq < E
    uniq_flat = layer * E + jnp.minimum(uniq, E - 1)
    slot_u = jnp.where(uniq_valid, cache["slot_of"][uniq_flat], -1)
    hit_u = slot_u >= 0
    miss_u = uniq_valid & ~hit_u
    m = jnp.sum(miss_u, dtype=jnp.int32)
    hits = jnp.sum(hit_u, dtype=jnp.int32)

    slot_of, owner_of, last_use, recency = cache["slot_of"], cache["owner_of"], cache["last_use"], cache["recency"]
    if defer:  # which routes miss (read before the in-place updates: see the barrier note below)
        route_missed, slot_of = lax.optimization_barrier((slot_of[flat_routes] < 0, slot_of))
    if update:  # hits are used in this step: they can no longer be victims
        last_use = set_at(last_use, slot_u, step, hit_u, dense_maps)

    if F > 0:
        if rule == "all":
            want = m
        else:
            want = balance_fill(m, cache["fill_fraction"])
        # Victims: the F least recently used slots of the whole pool (used slots carry `step`).
        victims, evictable = VICTIM_METHODS[victims_by](last_use, step, F)  # evictable: min(F, slots not used this step)
        n_fill = jnp.minimum(jnp.minimum(want, F), evictable)
        if defer and unit_split is not None:
            units = split_units(m, n_fill, cache["fill_fraction"], *unit_split)
            deferred = (n_fill > 0) & (units < unit_split[0])
        elif defer:
            deferred = defer_fills(m, n_fill, cache["fill_fraction"])
        else:
            deferred = jnp.zeros((), bool)
        # Misses first, most recently routed first, ties to the lower id (lexsort: last key is primary).
        # Reads of arrays updated in place further down go through a barrier with the array: XLA copies a
        # donated array twice when a read of it and its in-place update have no data dependency between them.
        rec_u, recency = lax.optimization_barrier((recency[uniq_flat], recency))
        order = rank_misses(miss_u, rec_u, uniq, dense)
        fill_ids = uniq_flat[order[:F]]
        take = jnp.arange(F, dtype=jnp.int32) < n_fill
        old, owner_of = lax.optimization_barrier((owner_of[victims], owner_of))
        # Evicted ids (resident) and filled ids (misses) are disjoint: the order of the two is free.
        slot_of = set_at(slot_of, old, -1, take & (old >= 0), dense_maps)
        slot_of = set_at(slot_of, fill_ids, victims, take, dense_maps)
        owner_of = set_at(owner_of, victims, fill_ids, take, dense_maps)
        stamp = jnp.where(deferred, step + defer_horizon, step) if defer else step
        last_use = set_at(last_use, victims, stamp, take, dense_maps)
        fill_slots = jnp.where(take, victims, 0)
        fill_ids = jnp.where(take, fill_ids, 0)
    else:
        n_fill = jnp.zeros((), jnp.int32)
        deferred = jnp.zeros((), bool)
        fill_ids = fill_slots = jnp.zeros((0,), jnp.int32)

    route_slot = jnp.where(route_valid, slot_of[flat_routes], -1)
    num_units = unit_split[0] if unit_split is not None else ALL_UNITS
    route_units = jnp.full((R,), num_units, jnp.int32)
    fill_units = jnp.asarray(num_units, jnp.int32)
    if defer and unit_split is not None and F > 0:  # a split call's filled experts: [0, u) here, [u, I) on the CPU
        split_route = deferred & route_missed & (route_slot >= 0)
        route_units = jnp.where(split_route, units, route_units)
        fill_units = jnp.where(deferred, units, fill_units)
    elif defer:  # a deferred call's filled experts are computed on the CPU this time
        route_slot = jnp.where(deferred & route_missed, -1, route_slot)
    cpu_experts = jnp.where(deferred, m, m - n_fill)
    on_cpu = route_valid & ((route_slot < 0) | (route_units < num_units))
    cpu_routes = (compact_dense if dense else compact)(on_cpu, R, fill_value=None)
    cpu_units = jnp.where(route_slot[cpu_routes] >= 0, route_units[cpu_routes], 0)
    plan = LayerPlan(route_slot=route_slot, cpu_routes=cpu_routes, n_cpu_routes=jnp.sum(on_cpu, dtype=jnp.int32),
                     fill_ids=fill_ids, fill_slots=fill_slots, n_fill=n_fill, hits=hits, misses=m,
                     cpu_experts=cpu_experts, deferred=deferred, route_units=route_units, cpu_units=cpu_units,
                     fill_units=fill_units)

    stats = dict(cache["stats"])
    counts = (("hits", hits), ("misses", m), ("fills", n_fill), ("cpu_experts", cpu_experts),
              ("deferred", jnp.where(deferred, n_fill, 0)), ("calls", jnp.ones((), jnp.int32)))
    if dense:  # the layer's entries are a static slice; the per-layer counters one select each
        at_layer = jnp.arange(stats["calls"].shape[0]) == layer
        for key, val in counts:
            stats[key] = stats[key] + jnp.where(at_layer, val, 0)
        lo = layer * E
        stats["hist"] = lax.dynamic_update_slice(stats["hist"], stats["hist"][lo:lo + E] + routed, (lo,))
        recency = lax.dynamic_update_slice(recency, jnp.where(present, step, recency[lo:lo + E]), (lo,))
    else:
        for key, val in counts:
            stats[key] = stats[key].at[layer].add(val)
        stats["hist"] = stats["hist"].at[flat_routes].add(route_valid.astype(jnp.int32))
        recency = recency.at[jnp.where(uniq_valid, uniq_flat, N)].set(step, mode="drop")
    new = dict(cache, slot_of=slot_of, owner_of=owner_of, last_use=last_use, step=step, stats=stats, recency=recency)
    return plan, new


def cpu_tasks(plan: LayerPlan, layer: int, expert_ids: jax.Array, gate_weights: jax.Array, num_experts: int):
    """The CPU branch's task arrays in ``plan.cpu_routes`` order: each route's token, flat expert id
    (``layer * E + id``) and gate weight (f32); the first ``plan.n_cpu_routes`` are the CPU's. The fused
    plan computes the same in its call (``plan_layer_fused(gate_weights=...)``)."""
    k = expert_ids.shape[1]
    tasks = plan.cpu_routes
    flat = layer * num_experts + expert_ids.reshape(-1).astype(jnp.int32)
    return tasks // k, flat[tasks], gate_weights.reshape(-1).astype(jnp.float32)[tasks]


BACKGROUND_KEYS = ("bg_ids", "bg_slots", "bg_n", "bg_from")  # the decode step's rows of deferred fills


def record_background(background: dict, plan: LayerPlan, layer: int, unit_split: bool) -> dict:
    """Row ``layer`` of the decode step's background fills (``bg_ids``/``bg_slots`` [L, C >= F], ``bg_n``
    [L], ``bg_from`` [L] under the unit split): the call's fills, their count if the call deferred them,
    else 0. The fused plan writes the same in its call (``plan_layer_fused(background=...)``)."""
    F = plan.fill_ids.shape[0]
    out = dict(background, bg_ids=background["bg_ids"].at[layer, :F].set(plan.fill_ids),
               bg_slots=background["bg_slots"].at[layer, :F].set(plan.fill_slots),
               bg_n=background["bg_n"].at[layer].set(jnp.where(plan.deferred, plan.n_fill, 0)))
    if unit_split:
        out["bg_from"] = background["bg_from"].at[layer].set(jnp.where(plan.deferred, plan.fill_units, 0))
    return out
