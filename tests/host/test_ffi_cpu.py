"""cpu_experts through XLA FFI inside jax.jit (CPU platform)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ftjax.host import HostPool, cpu_experts
from ftjax.host.reference import experts_reference

@pytest.fixture(autouse=True)
def _on_cpu():
    """cpu_experts is a CPU-platform target: run on JAX's CPU device also where a GPU is the default."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield



@pytest.fixture(scope="module")
def pool_and_banks():
    rng = np.random.default_rng(0)
    banks = {"gate_up": rng.standard_normal((8, 96, 64)).astype(np.float32) * 0.2,
             "down": rng.standard_normal((8, 64, 48)).astype(np.float32) * 0.2}
    return HostPool.from_banks(banks), banks


def test_jit_matches_reference(pool_and_banks):
    pool, banks = pool_and_banks
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    tok = rng.integers(0, 5, 12).astype(np.int32)
    eid = rng.integers(0, 8, 12).astype(np.int32)
    w = rng.random(12).astype(np.float32)
    f = jax.jit(lambda x, t, e, w, n: cpu_experts(x, t, e, w, n, pool) * 2.0)
    for n in (12, 7, 0):
        y = np.asarray(f(x, tok, eid, w, jnp.int32(n)))
        want = 2.0 * experts_reference(x, tok, eid, w, n, banks["gate_up"], banks["down"])
        np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5)


def test_bf16_activations(pool_and_banks):
    pool, banks = pool_and_banks
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 64)).astype(ml_dtypes.bfloat16)
    tok, eid, w = np.array([0, 1, 2, 2], np.int32), np.array([1, 1, 4, 7], np.int32), np.ones(4, np.float32)
    y = jax.jit(lambda *a: cpu_experts(*a, pool=pool))(jnp.asarray(x), tok, eid, w, 4)
    assert y.dtype == jnp.float32
    want = experts_reference(x.astype(np.float32), tok, eid, w, 4, banks["gate_up"], banks["down"], bf16_act=True)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-2, atol=2e-2)


def test_unit_start(pool_and_banks):
    """unit_start u: a task adds only its expert's intermediate units [u, I) (I = 48 here)."""
    pool, banks = pool_and_banks
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    tok, eid, w = np.array([0, 1, 2, 2], np.int32), np.array([1, 1, 4, 7], np.int32), np.ones(4, np.float32)
    units = np.array([0, 17, 48, 40], np.int32)
    y = jax.jit(lambda *a: cpu_experts(*a[:5], pool=pool, unit_start=a[5]))(jnp.asarray(x), tok, eid, w, 4, units)
    want = experts_reference(x, tok, eid, w, 4, banks["gate_up"], banks["down"], unit_start=units)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-5)
    with pytest.raises(Exception, match="unit start 49 is outside"):
        cpu_experts(x, tok, eid, w, 4, pool, unit_start=np.array([0, 0, 49, 0], np.int32)).block_until_ready()
    with pytest.raises(ValueError, match="must match the tasks"):
        cpu_experts(x, tok, eid, w, 4, pool, unit_start=np.zeros(3, np.int32))


def test_errors_surface_as_python_exceptions(pool_and_banks):
    pool, _ = pool_and_banks
    x = np.ones((2, 64), np.float32)
    one = np.zeros(1, np.int32)
    with pytest.raises(Exception, match="expert id 99 is outside"):
        cpu_experts(x, one, np.array([99], np.int32), np.ones(1, np.float32), 1, pool).block_until_ready()
    with pytest.raises(Exception, match="n_valid 5 outside"):
        cpu_experts(x, one, one, np.ones(1, np.float32), 5, pool).block_until_ready()
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_experts(x.astype(np.int32), one, one, np.ones(1, np.float32), 1, pool)
    closed = HostPool(2, 64, 48, "f32")
    closed.close()
    with pytest.raises(Exception, match="no host pool with id"):
        cpu_experts(x, one, one, np.ones(1, np.float32), 1, closed).block_until_ready()
