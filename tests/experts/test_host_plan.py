"""The host plan (cpp/host_plan.h: the CPU branch's task list decided on the host from what the GPU gathers
before its plan kernel) against the fused plan's own task list (plan_core on the cache state, the CPU
handler): the same tasks in the same order, with the same unit starts and the same checksum, call after
call of random routing over every rule, deferred fills, the unit split, fill caps, small caches (fewer
evictable slots than the fill capacity), padded tokens and the LRU clock's rebase."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax import _host
from ftjax.experts.cache import CacheGeometry, init_cache_state
from ftjax.experts.plan import REBASE_AT, REBASE_BY
from ftjax.experts.plan_fused import plan_layer_fused, plan_statics

from test_plan_fused import CASES as FUSED_CASES, IDS as FUSED_IDS  # tests/experts is on sys.path

# the fused plan's cases (rule, S, T, k, E, update, defer, unit_split, fill_cap) but the one of more routes than a
# thread block, and one whose deferred stamps hold most slots
NAMED = [(c, i) for c, i in zip(FUSED_CASES, FUSED_IDS) if c[2] * c[3] <= 256]
NAMED.append((("balance", 9, 2, 4, 16, True, True, None, None), "balance-S9-T2k4E16-defer"))
CASES, IDS = [c for c, _ in NAMED], [i for _, i in NAMED]
L = 3


def gathered(cache, layer, ids, E, update):
    """What cpu_experts_publish gathers on the GPU: per route its expert's slot, recency and slot's last_use,
    the step, and the slots whose last_use (rebased as the plan will) is below the call's step."""
    slot_of, recency = np.asarray(cache["slot_of"]), np.asarray(cache["recency"])
    last_use, step0 = np.asarray(cache["last_use"]), int(cache["step"])
    flat = layer * E + np.asarray(ids).reshape(-1)
    slot = slot_of[flat]
    lu = np.where(slot >= 0, last_use[np.maximum(slot, 0)] if last_use.size else 0, 0).astype(np.int32)
    shift = REBASE_BY if (layer == 0 and update and step0 >= REBASE_AT) else 0
    back = np.where(last_use >= 0, np.maximum(last_use.astype(np.int64) - shift, 0), last_use)
    below = int(np.sum(back < step0 - shift + 1))
    return slot.astype(np.int32), recency[flat].astype(np.int32), lu, step0, below


def host_tasks(statics, T, k, ids, valid, gw, g, ff):
    slot, rec, lu, step, below = g
    return _host.host_plan_tasks(T, k, statics, np.asarray(ids, np.int32).reshape(-1), np.asarray(valid, np.int32),
                                 np.asarray(gw, np.float32).reshape(-1), slot, rec, lu, step, below, ff)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("clock", [None, REBASE_AT - 4], ids=["clock", "rebase"])
def test_host_plan_matches_fused(case, clock):
    rule, S, T, k, E, update, defer, unit_split, fill_cap = case
    kw = dict(num_experts=E, rule=rule, update=update, defer_horizon=L if defer else 0, unit_split=unit_split,
              fill_cap=fill_cap)
    geom = CacheGeometry(num_layers=L, num_experts=E, num_slots=S, hidden=4, inter=unit_split[0] if unit_split else 2)
    rng = np.random.default_rng(S * 7 + T + (clock is not None))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        cache = init_cache_state(geom, jnp.float32, fill_fraction=float(rng.choice([0.3, 0.37, 0.5, 0.8])))
        cache.pop("gate_up"), cache.pop("down")
        if clock is not None:
            cache["step"] = jnp.asarray(clock, jnp.int32)
        steps = {layer: jax.jit(lambda c, i, v, w, layer=layer: plan_layer_fused(c, layer, i, v, gate_weights=w,
                                                                                 **kw))
                 for layer in range(L)}
        ff = float(np.asarray(cache["fill_fraction"]))
        calls = with_cpu = 0
        for _ in range(12):
            for layer in range(L):
                ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
                valid = rng.random(T) < 0.8
                gw = rng.random((T, k)).astype(np.float32)
                g = gathered(cache, layer, ids, E, update)
                statics = plan_statics(layer, T * k, E, S, rule=rule, fill_cap=fill_cap, update=update,
                                       defer_horizon=L if defer else 0, unit_split=unit_split)
                token, flat, units, weight, checksum = host_tasks(statics, T, k, ids, valid, gw, g, ff)
                plan, cache, tasks, _ = steps[layer](cache, jnp.asarray(ids), jnp.asarray(valid), jnp.asarray(gw))
                n = int(plan.n_cpu_routes)
                what = f"call {calls} (layer {layer})"
                assert len(token) == n, f"{what}: {len(token)} host tasks, the plan has {n}"
                np.testing.assert_array_equal(token, np.asarray(tasks[0])[:n], what)
                np.testing.assert_array_equal(flat, np.asarray(tasks[1])[:n], what)
                np.testing.assert_array_equal(np.asarray(weight, np.float32), np.asarray(tasks[2])[:n], what)
                np.testing.assert_array_equal(units, np.asarray(plan.cpu_units)[:n], what)
                want = sum(_host.task_checksum(int(a), int(b), int(c), float(d))
                           for a, b, c, d in zip(token, flat, units, weight)) % (1 << 32)
                assert checksum == want, what
                calls += 1
                with_cpu += n > 0
        assert with_cpu > 0 or (rule == "all" and fill_cap is None), "no call left work to the CPU: it tests nothing"


def test_host_plan_rejects_bad_ids():
    statics = plan_statics(0, 2, 8, 4, rule="balance", fill_cap=None, update=True, defer_horizon=0, unit_split=None)
    args = dict(tokens=1, top_k=2, statics=statics, valid=np.ones(1, np.int32), gate=np.ones(2, np.float32),
                slot=np.full(2, -1, np.int32), recency=np.zeros(2, np.int32), slot_lu=np.zeros(2, np.int32), step=0,
                below=4, fill_fraction=0.5)
    with pytest.raises(ValueError, match="router id 8 outside"):
        _host.host_plan_tasks(ids=np.array([1, 8], np.int32), **args)
    with pytest.raises(ValueError, match="tokens \\* top_k"):
        _host.host_plan_tasks(ids=np.array([1, 2, 3], np.int32), **args)
    with pytest.raises(ValueError, match="no 'rule'"):
        _host.host_plan_tasks(ids=np.array([1, 2], np.int32), **dict(args, statics={
            key: v for key, v in statics.items() if key != "rule"}))
    token, flat, units, weight, checksum = _host.host_plan_tasks(ids=np.array([1, 2], np.int32), **args)
    assert len(token) == 1 and units == [0]  # two misses at f = 0.5: one filled, one on the CPU
