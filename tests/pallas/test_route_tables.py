"""The prefill kernels' route tables (ftjax.pallas.route_tables): the CUDA kernel against the jnp form.

The jnp form is `routing.plan_routes` + `routing.tile_walk` (checked against numpy in
test_prefill_gemm.py). The CUDA kernel must give the same tables bit for bit (the `gpu` tests); on
the CPU only the choice of form and its errors run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.pallas import prefill_gemm as pg
from ftjax.pallas import route_tables as rt
from ftjax.pallas import routing


def _on_gpu():
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def test_impl_choice_and_errors():
    with pytest.raises(ValueError, match="plan_impl must be one of"):
        rt.resolve_impl("triton", 8)
    assert rt.resolve_impl("jnp", 10_000) == "jnp"
    assert rt.resolve_impl("auto", 8, interpret=True) == "jnp"
    assert rt.resolve_impl("auto", rt.CUDA_MAX_EXPERTS + 1) == "jnp"
    with pytest.raises(ValueError, match="up to 1024 experts"):
        rt.resolve_impl("cuda", rt.CUDA_MAX_EXPERTS + 1)
    with pytest.raises(ValueError, match="interpret"):
        rt.resolve_impl("cuda", 8, interpret=True)
    if not rt.cuda_available():
        assert rt.resolve_impl("auto", 8) == "jnp"
        with pytest.raises(ValueError, match="needs a CUDA build"):
            rt.resolve_impl("cuda", 8)
    with pytest.raises(ValueError, match="two \\(n_blocks, band\\) pairs"):
        rt.route_tables(jnp.zeros((2, 2), jnp.int32), jnp.ones(2, bool), jnp.zeros(4, jnp.int32),
                        n_slots=4, tile=8, walks=((1, None),), impl="jnp")
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        rt.route_tables(jnp.zeros((2, 2), jnp.int32), jnp.ones(2, bool), jnp.zeros(4, jnp.int32),
                        n_slots=4, tile=8, impl="auto")
    with pytest.raises(ValueError, match="plan_impl must be one of"):
        pg.prefill_experts(jnp.zeros((2, 128)), jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 2)),
                           jnp.ones(2, bool), jnp.zeros((1, 256, 128)), jnp.zeros((1, 128, 128)),
                           jnp.zeros(4, jnp.int32), plan_impl="xla")


def test_jnp_tables_are_the_plan_fields():
    rng = np.random.default_rng(3)
    T, k, E, tile, S = 50, 4, 9, 16, 12
    ids = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
    valid = jnp.asarray(rng.random(T) < 0.8)
    slots = jnp.asarray(rng.permutation(S)[:E], jnp.int32)
    tables = rt.route_tables(ids, valid, slots, n_slots=S, tile=tile, walks=((2, None), (3, 2)), impl="jnp")
    plan = routing.plan_routes(ids, valid, E, tile)
    for name in ("row_of_route", "token_of_input_row", "tile_row0", "tile_rows"):
        np.testing.assert_array_equal(getattr(tables, name), getattr(plan, name), err_msg=name)
    np.testing.assert_array_equal(tables.tile_slot, np.asarray(slots)[np.asarray(plan.tile_group)])
    assert int(tables.n_launch[0]) == max(int(plan.n_tiles), 1)
    assert tables.walks[0] is None
    np.testing.assert_array_equal(tables.walks[1], routing.tile_walk(plan, tile, 3, 2))


def _case(seed, T, k, E, *, skew=0.0, p_valid=1.0, per_route=False, S=None):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, E, (T, k))
    hot = rng.random((T, k)) < skew
    ids[hot] = min(3, E - 1)  # one large group (duplicates within a token are allowed)
    valid = rng.random((T, k) if per_route else T) < p_valid
    S = S or E + 5
    slots = rng.permutation(S)[:E]
    slots[0] = -1  # clamped into the cache by both forms
    return jnp.asarray(ids, jnp.int32), jnp.asarray(valid), jnp.asarray(slots, jnp.int32), S


CASES = [
    dict(T=1024, k=8, E=256, tile=128, walks=((4, None), (8, None))),  # Qwen-like prefill, default walks
    dict(T=1024, k=8, E=256, tile=128, walks=((16, 2), (16, 2))),  # DeepSeek-like walks
    dict(T=333, k=6, E=37, tile=64, skew=0.9, p_valid=0.8, per_route=True, walks=((2, 3), (1, 1))),
    dict(T=77, k=2, E=1024, tile=64, p_valid=0.5, walks=((3, 2), (5, None))),  # more experts than routes
    dict(T=4096, k=8, E=64, tile=128, skew=0.3, walks=((8, 4), (4, None))),
    dict(T=5, k=3, E=4, tile=64, p_valid=0.0, walks=((2, 2), (2, None))),  # every token invalid
    dict(T=0, k=8, E=16, tile=128, walks=((2, 2), (2, None))),  # the empty batch
]


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu(), reason="needs JAX's GPU backend")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c['T']}k{c['k']}E{c['E']}t{c['tile']}")
def test_cuda_tables_equal_jnp(case):
    assert rt.cuda_available(), "a GPU run needs the CUDA build of ftjax._host"
    ids, valid, slots, S = _case(11, case["T"], case["k"], case["E"], skew=case.get("skew", 0.0),
                                 p_valid=case.get("p_valid", 1.0), per_route=case.get("per_route", False))
    kw = dict(n_slots=S, tile=case["tile"], walks=case["walks"])
    want = jax.jit(lambda *a: rt.route_tables(*a, impl="jnp", **kw))(ids, valid, slots)
    got = jax.jit(lambda *a: rt.route_tables(*a, impl="cuda", **kw))(ids, valid, slots)
    for name in ("row_of_route", "token_of_input_row", "tile_slot", "tile_row0", "tile_rows", "n_launch"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                      err_msg=name)
    for w, (g, e) in enumerate(zip(got.walks, want.walks)):
        assert (g is None) == (e is None)
        if e is not None:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(e), err_msg=f"walk {w}")


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu(), reason="needs JAX's GPU backend")
def test_prefill_with_cuda_tables_equals_jnp_tables():
    rng = np.random.default_rng(5)
    T, k, H, I, E, S = 777, 8, 1024, 512, 64, 70
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
    w = jnp.asarray(rng.random((T, k)), jnp.float32)
    valid = jnp.asarray(rng.random(T) < 0.9)
    gate_up = jnp.asarray(rng.standard_normal((S, 2 * I, H)) * 0.03, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((S, H, I)) * 0.03, jnp.bfloat16)
    slots = jnp.asarray(rng.permutation(S)[:E], jnp.int32)
    outs = [pg.prefill_experts(x, ids, w, valid, gate_up, down, slots, plan_impl=impl, walk_band=band)
            for impl in ("jnp", "cuda") for band in (None, 2)]
    assert np.all(np.isfinite(np.asarray(outs[0]))) and np.any(np.asarray(outs[0]))
    for out in outs[1:]:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(outs[0]))
