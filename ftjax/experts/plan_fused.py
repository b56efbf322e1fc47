"""The plan of one MoE layer call as one native call (``plan_layer(impl="fused")``).

The same plan and state updates as :func:`ftjax.experts.plan.plan_layer` (its reference), bit for bit
(tests/experts/test_plan_fused.py), computed by ``cpp/plan_core.h`` in one pass: on the CPU backend one
thread inside the FFI call, on the GPU one thread block, where XLA runs the jnp plan as a chain of ~20
small kernels (~26 us per layer on the H200, bench/RESULTS.md session 8). The cache state is updated in
place: its arrays are aliased to the call's results (donate the state, as every decode step does).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.experts.cache import STAT_KEYS
from ftjax.host.ffi import register_targets

RULE_CODES = {"balance": 0, "all": 1, "none": 2}  # cpp/plan_core.h PlanRule
MAX_EXPERTS = 5120  # 10 E int32 of scratch at most within cpp/plan_cuda.cu kPlanMaxSmem (200 KiB)


def plan_statics(layer: int, num_routes: int, num_experts: int, num_slots: int, *, rule: str, fill_cap: int | None,
                 update: bool, defer_horizon: int, unit_split: tuple[int, int] | None) -> dict:
    """The plan's static parameters as the native calls take them (the fused plan's attributes; the host
    plan's, ``cuda.cpu_experts_publish``): the fill capacity, the rule's code, the effective defer horizon."""
    from ftjax.experts.plan import ALL_UNITS, REBASE_AT, REBASE_BY, fill_capacity

    F = fill_capacity(num_routes, num_experts, num_slots, fill_cap, rule) if update else 0
    defer = defer_horizon > 0 and rule == "balance" and update
    return dict(layer=np.int64(layer), n_experts=np.int64(num_experts), fill_capacity=np.int64(F),
                rule=np.int64(RULE_CODES[rule]), update=np.int64(bool(update)),
                defer_horizon=np.int64(defer_horizon if defer else 0),
                split_inter=np.int64(unit_split[0] if unit_split else 0),
                split_granule=np.int64(unit_split[1] if unit_split else 0),
                rebase_at=np.int64(REBASE_AT), rebase_by=np.int64(REBASE_BY), all_units=np.int64(ALL_UNITS))


def plan_layer_fused(cache: dict, layer: int, expert_ids: jax.Array, token_valid: jax.Array, *, num_experts: int,
                     rule: str, fill_cap: int | None, update: bool, defer_horizon: int,
                     unit_split: tuple[int, int] | None, gate_weights: jax.Array | None = None,
                     background: dict | None = None, team_threads: int = 1, publish_x: jax.Array | None = None,
                     channel: int | None = None, check_staging: bool = False):
    """``plan.plan_layer``'s result through the ``ftjax_plan_layer`` FFI target (arguments checked there).

    Returns ``(plan, cache)``, or ``(plan, cache, tasks, background)`` when ``gate_weights`` ([T, k]) or
    ``background`` is given: the same call then also computes what ``plan.cpu_tasks`` and
    ``plan.record_background`` would (``tasks`` None without gate weights; ``background``, the arrays
    ``bg_ids``/``bg_slots`` [L, C >= F], ``bg_n``/``bg_from`` [L] updated in place at row ``layer``, None
    without it; ``bg_from`` is written only under the unit split). ``team_threads`` > 1 (tests, CPU backend):
    the CPU handler runs the plan on that many threads in the GPU thread block's form.

    ``publish_x`` ([T, H] f32/bf16) with ``channel`` (CUDA): the plan kernel itself stages x and the CPU
    branch's task list in that CPU-branch channel and publishes the request as soon as the list is known
    (before the victims are chosen), as ``cuda.cpu_experts_submit`` would after it; the result then has a
    fifth element, the submit token for ``cuda.cpu_experts_collect``. ``check_staging`` (tests, either
    platform): the staged list goes into results instead, the fifth element a dict ``token, flat, weight,
    units`` [R], ``n`` and ``early`` [] (1: staged before the victims; 0: after the routes, as for a router id
    outside [0, E)), and ``x``, the staged copy of ``publish_x`` (given without a channel; None without it).
    Both need the gate weights."""
    from ftjax.experts.plan import BACKGROUND_KEYS, LayerPlan

    register_targets()
    T, k = expert_ids.shape
    if not 1 <= team_threads <= 64:
        raise ValueError(f"team_threads must be in [1, 64], got {team_threads}")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"the fused plan handles up to {MAX_EXPERTS} experts per layer (its GPU scratch is in "
                         f"shared memory), got {num_experts}: use plan_impl='scatter'")
    R, E = T * k, num_experts
    statics = plan_statics(layer, T * k, E, cache["owner_of"].shape[0], rule=rule, fill_cap=fill_cap, update=update,
                           defer_horizon=defer_horizon, unit_split=unit_split)
    F = int(statics["fill_capacity"])
    stats = cache["stats"]
    state = [cache["slot_of"], cache["owner_of"], cache["last_use"], cache["step"], cache["recency"],
             *(stats[key] for key in STAT_KEYS), stats["hist"]]
    bg = [background[key] for key in BACKGROUND_KEYS] if background is not None else []
    for x in state + bg:
        if x.dtype != jnp.int32:
            raise ValueError(f"the cache state must be int32, got {x.dtype}{list(x.shape)}")
    with_tasks = gate_weights is not None
    if with_tasks and gate_weights.shape != expert_ids.shape:
        raise ValueError(f"gate weights {gate_weights.shape} must match the expert ids {expert_ids.shape}")
    if channel is not None and check_staging:
        raise ValueError("check_staging stages into results, not into a channel: give one of them")
    if (channel is not None) != (publish_x is not None) and not (publish_x is not None and check_staging):
        raise ValueError("a publishing plan needs both publish_x and channel (or publish_x with check_staging)")
    publish = 1 if channel is not None else 2 if check_staging else 0
    if publish and not with_tasks:
        raise ValueError("a publishing plan (channel or check_staging) needs the gate weights")
    if publish_x is not None and (publish_x.ndim != 2 or publish_x.shape[0] != T
                                  or publish_x.dtype not in (jnp.float32, jnp.bfloat16)
                                  or publish_x.size * publish_x.dtype.itemsize % 4):
        raise ValueError(f"publish_x must be f32/bf16 [T={T}, H] (whole 4-byte words), got "
                         f"{publish_x.dtype}{list(publish_x.shape)}")
    x_in = publish_x if publish_x is not None else jnp.zeros((T, 2), jnp.float32)  # (check form: a stand-in)

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state + bg]
    results += [i32(R)] * 4 + [i32(F)] * 2 + [i32()] * 7
    if with_tasks:
        results += [i32(R), i32(R), jax.ShapeDtypeStruct((R,), jnp.float32)]
    if publish == 1:
        results += [i32()]
    elif publish == 2:
        results += [i32(R), i32(R), jax.ShapeDtypeStruct((R,), jnp.float32), i32(R), i32(), i32(),
                    jax.ShapeDtypeStruct(x_in.shape, x_in.dtype)]
    first_state = 3 + with_tasks + (publish != 0)
    call = jax.ffi.ffi_call("ftjax_plan_layer", results,
                            input_output_aliases={first_state + i: i for i in range(len(state) + len(bg))})
    head = [expert_ids.astype(jnp.int32), token_valid.astype(jnp.int32),
            jnp.asarray(cache["fill_fraction"], jnp.float32).reshape(())]
    if with_tasks:
        head.append(gate_weights.astype(jnp.float32))
    if publish:
        head.append(x_in)
    out = call(*head, *state, *bg, **statics, with_tasks=np.int64(with_tasks),
               with_background=np.int64(background is not None), bg_units=np.int64(unit_split is not None),
               team_threads=np.int64(team_threads), publish=np.int64(publish),
               channel=np.int64(-1 if channel is None else channel))
    n = len(state)
    slot_of, owner_of, last_use, step, recency = out[:5]
    new_stats = dict(zip(STAT_KEYS, out[5:5 + len(STAT_KEYS)]), hist=out[n - 1])
    new_bg = dict(background, **dict(zip(BACKGROUND_KEYS, out[n:n + len(bg)]))) if background is not None else None
    p = n + len(bg)
    (route_slot, cpu_routes, route_units, cpu_units, fill_ids, fill_slots, n_cpu_routes, n_fill, hits, misses,
     cpu_experts, deferred, fill_units) = out[p:p + 13]
    plan = LayerPlan(route_slot=route_slot, cpu_routes=cpu_routes, n_cpu_routes=n_cpu_routes, fill_ids=fill_ids,
                     fill_slots=fill_slots, n_fill=n_fill, hits=hits, misses=misses, cpu_experts=cpu_experts,
                     deferred=deferred != 0, route_units=route_units, cpu_units=cpu_units, fill_units=fill_units)
    new = dict(cache, slot_of=slot_of, owner_of=owner_of, last_use=last_use, step=step, recency=recency,
               stats=new_stats)
    if gate_weights is None and background is None:
        return plan, new
    tasks = tuple(out[p + 13:p + 16]) if with_tasks else None
    if publish == 1:
        return plan, new, tasks, new_bg, out[p + 16]
    if publish == 2:
        staged = dict(zip(("token", "flat", "weight", "units", "n", "early", "x"), out[p + 16:]))
        return plan, new, tasks, new_bg, dict(staged, x=staged["x"] if publish_x is not None else None)
    return plan, new, tasks, new_bg
