"""The fused plan (``plan_layer(impl="fused")``: cpp/plan_core.h through the ``ftjax_plan_layer`` FFI
target) against the jnp plan (its reference): the same LayerPlan and the same cache state, bit for bit,
step after step, for every rule, with and without updates, deferred fills, the unit split, fill caps,
padded tokens and the LRU clock's rebase; with the CPU branch's task arrays and the decode step's
background rows computed in the call (``plan_layer_fused(gate_weights=, background=)``) against
``cpu_tasks`` / ``record_background``. On the CPU backend (CI) and, marked gpu, on the GPU (one thread
block: the parallel reductions and compactions of plan_core)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.experts.cache import CacheGeometry, check_invariants, init_cache_state
from ftjax.experts.plan import (BACKGROUND_KEYS, REBASE_AT, cpu_tasks, fill_capacity, plan_layer,
                                record_background)
from ftjax.experts.plan_fused import plan_layer_fused

# rule, S, T, k, E, update, defer, unit_split, fill_cap
CASES = [
    ("balance", 5, 1, 3, 8, True, False, None, None),
    ("all", 7, 3, 3, 8, True, False, None, None),
    ("balance", 40, 4, 8, 64, True, False, None, None),
    ("all", 100, 3, 8, 64, True, False, None, 3),
    ("none", 20, 2, 4, 16, True, False, None, None),
    ("balance", 20, 2, 4, 16, False, False, None, None),  # static: the maps frozen
    ("balance", 3, 9, 8, 16, True, False, None, None),    # T*k > E: U = E
    ("balance", 5, 1, 3, 8, True, True, None, None),
    ("balance", 40, 2, 8, 64, True, True, None, None),
    ("balance", 12, 1, 8, 32, True, True, (64, 8), None),
    ("balance", 60, 4, 8, 64, True, True, (32, 8), 2),
    ("balance", 0, 2, 4, 16, True, False, None, None),    # no slots: every miss on the CPU
    ("all", 700, 64, 8, 256, True, False, None, None),    # more routes than one thread block
]
IDS = [f"{c[0]}-S{c[1]}-T{c[2]}k{c[3]}E{c[4]}{'' if c[5] else '-frozen'}{'-defer' if c[6] else ''}"
       f"{'-units' if c[7] else ''}{f'-cap{c[8]}' if c[8] else ''}" for c in CASES]
L = 3


def _steppers(rule, E, update, defer, unit_split, fill_cap, team_threads=1):
    """The jnp plan with ``cpu_tasks`` and ``record_background`` (the reference), and the fused plan: layer 0
    plain (``plan_layer(impl="fused")``; with ``team_threads`` > 1 ``plan_layer_fused`` on that many CPU
    threads), layer 1 with the gate weights (its task arrays from the call), layer 2 with the gate weights
    and the background rows (both from the call)."""
    kw = dict(num_experts=E, rule=rule, update=update, defer_horizon=L if defer else 0, unit_split=unit_split,
              fill_cap=fill_cap)

    def ref(cache, ids, valid, gw):
        plans, tasks = [], []
        for layer in range(L):
            p, cache = plan_layer(cache, layer, ids[layer], valid, impl="scatter", victims_by="rank", **kw)
            tasks.append(cpu_tasks(p, layer, ids[layer], gw[layer], E))
            if p.fill_ids.shape[0]:
                cache = record_background(cache, p, layer, unit_split is not None)
            plans.append(p)
        return (plans, tasks), cache

    def fused(cache, ids, valid, gw):
        plans, tasks, staging = [], [], []
        for layer in range(L):
            if layer == 0 and team_threads == 1:
                p, cache = plan_layer(cache, layer, ids[layer], valid, impl="fused", **kw)
                t = cpu_tasks(p, layer, ids[layer], gw[layer], E)
            elif layer == 0:
                p, cache = plan_layer_fused(cache, layer, ids[layer], valid, team_threads=team_threads, **kw)
                t = cpu_tasks(p, layer, ids[layer], gw[layer], E)
            elif layer == 1:
                p, cache, t, _ = plan_layer_fused(cache, layer, ids[layer], valid, gate_weights=gw[layer],
                                                  team_threads=team_threads, **kw)
            else:  # with the background rows, and the CPU branch's list staged as a publishing plan stages it
                bg = {key: cache[key] for key in BACKGROUND_KEYS}
                x = staged_x(gw[layer])
                p, cache, t, bg, staged = plan_layer_fused(cache, layer, ids[layer], valid, gate_weights=gw[layer],
                                                           background=bg, team_threads=team_threads,
                                                           check_staging=True, publish_x=x, **kw)
                cache = dict(cache, **bg)
                staging.append((p, t, staged, x))
            if layer != 2 and p.fill_ids.shape[0]:
                cache = record_background(cache, p, layer, unit_split is not None)
            plans.append(p)
            tasks.append(t)
        return (plans, tasks), cache, staging

    return jax.jit(ref, donate_argnums=0), jax.jit(fused, donate_argnums=0)


def staged_x(gw, hidden=37):
    """An x [T, hidden] f32 of distinct values (37 words a row: the staged copy's chunks end mid-chunk)."""
    T = gw.shape[0]
    return jnp.arange(T * hidden, dtype=jnp.float32).reshape(T, hidden) + gw.sum()


def assert_staged(plan, tasks, staged, what, early=True, x=None):
    """The staged list (``check_staging``) is the call's CPU task list: its count, each task's token, flat id,
    gate weight and unit start (cpu_units), in the task arrays' order; staged before the victims (``early``);
    x's staged copy bit for bit ``x``."""
    if x is not None:
        np.testing.assert_array_equal(np.asarray(staged["x"]).view(np.uint8), np.asarray(x).view(np.uint8),
                                      f"{what}: staged x")
    n = int(plan.n_cpu_routes)
    assert int(staged["n"]) == n, f"{what}: staged {int(staged['n'])} tasks, the plan has {n}"
    assert int(staged["early"]) == int(early), f"{what}: staged early={int(staged['early'])}"
    for name, ref in zip(("token", "flat", "weight"), tasks):
        np.testing.assert_array_equal(np.asarray(staged[name])[:n], np.asarray(ref)[:n], f"{what}: staged {name}")
    np.testing.assert_array_equal(np.asarray(staged["units"])[:n], np.asarray(plan.cpu_units)[:n],
                                  f"{what}: staged units")


def _routing(rng, T, k, E):
    ids = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(T)]) for _ in range(L)])
    if rng.random() < 0.3:  # a burst of repeats: many hits
        ids[:] = ids[0]
    gw = rng.random((L, T, k)).astype(np.float32)
    return jnp.asarray(ids, jnp.int32), jnp.asarray(rng.random(T) < 0.8), jnp.asarray(gw)


def _assert_same(ref, got, what):
    ((p_ref, t_ref), c_ref), ((p_got, t_got), c_got) = ref, got
    for layer, (a, b) in enumerate(zip(p_ref, p_got)):
        for name in a._fields:
            x, y = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
            assert x.dtype == y.dtype, f"{what}, layer {layer}: {name} dtype {x.dtype} vs {y.dtype}"
            np.testing.assert_array_equal(x, y, f"{what}, layer {layer}: {name}")
    for layer, (a, b) in enumerate(zip(t_ref, t_got)):
        for name, x, y in zip(("token", "flat id", "weight"), a, b):
            assert x.dtype == y.dtype, f"{what}, layer {layer}: task {name} dtype {x.dtype} vs {y.dtype}"
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), f"{what}, layer {layer}: task {name}")
    for path, x in jax.tree_util.tree_flatten_with_path(c_ref)[0]:
        y = c_got
        for key in path:
            y = y[key.key]
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), f"{what}: state {jax.tree_util.keystr(path)}")


def run_lockstep(case, device, steps=30, seed=0, clock=None, team_threads=1):
    """Both plans from the same state, ``steps`` decode steps of ``L`` layers; compare after each."""
    rule, S, T, k, E, update, defer, unit_split, fill_cap = case
    ref_step, fused_step = _steppers(rule, E, update, defer, unit_split, fill_cap, team_threads)
    geom = CacheGeometry(num_layers=L, num_experts=E, num_slots=S, hidden=4, inter=unit_split[0] if unit_split else 2)
    rng = np.random.default_rng(seed + S * 7 + T)
    with jax.default_device(device):
        cache = init_cache_state(geom, jnp.float32, fill_fraction=float(rng.choice([0.3, 0.37, 0.5, 0.8])))
        cache.pop("gate_up"), cache.pop("down")
        if clock is not None:  # stamps near the rebase point
            cache["step"] = jnp.asarray(clock, jnp.int32)
        # the decode step's background rows, wider than F and filled with noise (columns past F stay)
        C = fill_capacity(T * k, E, S, fill_cap, rule) + 2
        for key, shape in zip(BACKGROUND_KEYS, [(L, C), (L, C), (L,), (L,)]):
            cache[key] = jnp.asarray(rng.integers(-5, 50, shape), jnp.int32)
        ref = jax.tree.map(jnp.copy, cache)
        n_staged = 0
        for i in range(steps):
            ids, valid, gw = _routing(rng, T, k, E)
            out_ref = ref_step(ref, ids, valid, gw)
            *out_fused, staging = fused_step(cache, ids, valid, gw)
            _assert_same(out_ref, out_fused, f"step {i}")
            for p, t, staged, x in staging:
                assert_staged(p, t, staged, f"step {i}", x=x)
                n_staged += int(staged["n"])
            ref, cache = out_ref[1], out_fused[1]
    check_invariants(cache)
    if not update or S < T * k:  # (where misses must reach the CPU, the staged lists are not all empty)
        assert n_staged > 0 or rule == "all"
    return cache


@pytest.fixture
def cpu():
    return jax.devices("cpu")[0]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fused_plan_equals_the_jnp_plan(case, cpu):
    cache = run_lockstep(case, cpu)
    stats = {key: int(np.asarray(v).sum()) for key, v in cache["stats"].items()}
    assert stats["calls"] == 30 * L
    if case[1] and case[5] and case[0] != "none":
        assert stats["fills"] > 0  # the cases exercise the fills (and the hits, where the cache can hold a layer)
        assert stats["hits"] > 0 or case[1] < case[4]


# Each case on one team: 3 threads (the even cases) or 8 (the odd ones and the largest, where 3 threads take three
# times as long); the two sizes split the strided phases differently, and each covers half the cases.
TEAM_CASES = [pytest.param(c, 8 if i % 2 or c[1] >= 700 else 3, id=f"{IDS[i]}-{8 if i % 2 or c[1] >= 700 else 3}")
              for i, c in enumerate(CASES)]


@pytest.mark.parametrize("case, threads", TEAM_CASES)
def test_fused_plan_on_a_team_of_threads_equals_the_jnp_plan(case, threads, cpu):
    """The GPU kernel's parallel form (strided phases, barriers, per-thread partials, compactions chunk by
    chunk) on host threads: a missing barrier or a phase reading another thread's unfinished writes shows here.
    A team reads and writes last_use and owner_of in place (no per-slot copies): the GPU's form for a cache too
    large for shared memory."""
    run_lockstep(case, cpu, steps=12, team_threads=threads)


@pytest.mark.parametrize("defer", [False, True])
def test_fused_plan_rebases_the_clock_like_the_jnp_plan(defer, cpu):
    cache = run_lockstep(("balance", 6, 2, 2, 8, True, defer, None, None), cpu, steps=12, clock=REBASE_AT - 4 * L)
    assert int(cache["step"]) < REBASE_AT  # rebased on the way


def test_fused_plan_updates_the_donated_state_in_place(cpu):
    """The state arrays are aliased to the call's results: no whole-map copies in the compiled step."""
    import re

    Lx, E, S, T, k = 4, 16, 40, 1, 4
    geom = CacheGeometry(num_layers=Lx, num_experts=E, num_slots=S, hidden=4, inter=2)
    with jax.default_device(cpu):
        cache = init_cache_state(geom, jnp.float32)

        def step(cache, ids):
            return plan_layer(cache, 1, ids, jnp.ones((T,), bool), num_experts=E, impl="fused")

        hlo = jax.jit(step, donate_argnums=0).lower(cache, jnp.zeros((T, k), jnp.int32)).compile().as_text()
    copied = re.findall(r"= s32\[(\d+)\]\{0\} copy\(", hlo[hlo.index("ENTRY"):])
    assert not {int(n) for n in copied} & {S, Lx * E}, copied
    assert "ftjax_plan_layer" in hlo


def test_fused_plan_checks_its_arguments(cpu):
    geom = CacheGeometry(num_layers=2, num_experts=4, num_slots=2, hidden=4, inter=2)
    with jax.default_device(cpu):
        cache = init_cache_state(geom, jnp.float32)
        ids, valid = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), bool)
        with pytest.raises(Exception, match="outside slot_of"):  # layer 2 of a 2-layer cache
            jax.block_until_ready(plan_layer(cache, 2, ids, valid, num_experts=4, impl="fused"))
        bad = dict(cache, last_use=cache["last_use"].astype(jnp.float32))
        with pytest.raises(ValueError, match="int32"):
            plan_layer(bad, 0, ids, valid, num_experts=4, impl="fused")
        from ftjax.experts.plan_fused import MAX_EXPERTS

        E = MAX_EXPERTS + 1
        big = init_cache_state(CacheGeometry(num_layers=1, num_experts=E, num_slots=2, hidden=4, inter=2), jnp.float32)
        with pytest.raises(ValueError, match="plan_impl='scatter'"):
            plan_layer(big, 0, ids, valid, num_experts=E, impl="fused")
        with pytest.raises(ValueError, match="team_threads"):
            plan_layer_fused(cache, 0, ids, valid, num_experts=4, rule="balance", fill_cap=None, update=True,
                             defer_horizon=0, unit_split=None, team_threads=0)


@pytest.fixture
def gpu():
    from ftjax.host import cuda

    if not cuda.available():
        pytest.skip("needs a CUDA build, a GPU and JAX's GPU backend")
    return jax.devices("gpu")[0]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fused_plan_equals_the_jnp_plan_on_the_gpu(case, gpu):
    run_lockstep(case, gpu)


@pytest.mark.gpu
def test_fused_plan_rebases_the_clock_on_the_gpu(gpu):
    run_lockstep(("balance", 6, 2, 2, 8, True, True, None, None), gpu, steps=12, clock=REBASE_AT - 4 * L)


@pytest.mark.parametrize("layer", [0, L - 1])
def test_fused_plan_stages_after_the_routes_for_a_router_id_out_of_range(layer, cpu):
    """A valid route whose router id lies outside [0, E) reads slot_of at the clamped flat id after the
    evictions (the jnp plan's gather): such a call stages its CPU list after the routes (early 0), still the
    plan's list; layers 0 and L-1, where the clamped id falls in the call's own layer."""
    E, S, T, k = 8, 5, 2, 3
    kw = dict(num_experts=E, rule="balance", update=True, defer_horizon=0, unit_split=None, fill_cap=None)
    geom = CacheGeometry(num_layers=L, num_experts=E, num_slots=S, hidden=4, inter=2)
    rng = np.random.default_rng(3)
    with jax.default_device(cpu):
        cache = init_cache_state(geom, jnp.float32, fill_fraction=0.5)
        cache.pop("gate_up"), cache.pop("down")
        valid = jnp.ones((T,), bool)
        for _ in range(4):  # slots held, so the clamped ids can be resident or evicted
            ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)
            _, cache = plan_layer(cache, layer, ids, valid, impl="scatter", victims_by="rank", **kw)
        ids = jnp.asarray([[1, -1, 3], [E + 1, 2, 5]], jnp.int32)
        gw = jnp.asarray(rng.random((T, k)), jnp.float32)
        ref_plan, ref_cache = plan_layer(jax.tree.map(jnp.copy, cache), layer, ids, valid, impl="scatter",
                                         victims_by="rank", **kw)
        ref_tasks = cpu_tasks(ref_plan, layer, ids, gw, E)
        x_in = jnp.asarray(rng.standard_normal((T, 6)), jnp.bfloat16)  # (3 words a row)
        plan, new, tasks, _, staged = plan_layer_fused(cache, layer, ids, valid, gate_weights=gw,
                                                       check_staging=True, publish_x=x_in, **kw)
        # (the CPU branch's list and the routes' slots as the reference's; the hit count is not compared: the
        # jnp plan counts an out-of-range route's clamped expert, the fused plan does not)
        for name in ("route_slot", "cpu_routes", "n_cpu_routes", "cpu_units", "fill_ids", "fill_slots", "n_fill"):
            np.testing.assert_array_equal(np.asarray(getattr(plan, name)), np.asarray(getattr(ref_plan, name)), name)
        for name, x, y in zip(("token", "flat", "weight"), ref_tasks, tasks):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), f"task {name}")
        assert_staged(plan, tasks, staged, f"layer {layer}", early=False, x=x_in)
        assert int(plan.n_cpu_routes) > 0


def test_publishing_plan_checks_its_arguments(cpu):
    geom = CacheGeometry(num_layers=1, num_experts=4, num_slots=2, hidden=4, inter=2)
    kw = dict(num_experts=4, rule="balance", fill_cap=None, update=True, defer_horizon=0, unit_split=None)
    with jax.default_device(cpu):
        cache = init_cache_state(geom, jnp.float32)
        ids, valid, gw = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), bool), jnp.ones((1, 2), jnp.float32)
        x = jnp.zeros((1, 4), jnp.float32)
        with pytest.raises(ValueError, match="needs the gate weights"):
            plan_layer_fused(cache, 0, ids, valid, check_staging=True, **kw)
        with pytest.raises(ValueError, match="both publish_x and channel"):
            plan_layer_fused(cache, 0, ids, valid, gate_weights=gw, publish_x=x, **kw)
        with pytest.raises(ValueError, match="both publish_x and channel"):
            plan_layer_fused(cache, 0, ids, valid, gate_weights=gw, channel=0, **kw)
        with pytest.raises(ValueError, match="whole 4-byte words"):
            plan_layer_fused(cache, 0, ids, valid, gate_weights=gw, publish_x=jnp.zeros((1, 3), jnp.bfloat16),
                             check_staging=True, **kw)
        with pytest.raises(ValueError, match="publish_x must be"):
            plan_layer_fused(cache, 0, ids, valid, gate_weights=gw, publish_x=x[0], channel=0, **kw)
        with pytest.raises(Exception, match="CUDA platform"):  # the CPU platform has no CPU-branch channel
            jax.block_until_ready(plan_layer_fused(cache, 0, ids, valid, gate_weights=gw, publish_x=x, channel=0,
                                                   **kw))
