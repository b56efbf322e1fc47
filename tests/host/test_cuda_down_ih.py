"""The CUDA fills from a pool whose down bank is stored transposed (``down_layout="ih"``, host ``[I, H]`` per expert):
every fill writes the GPU slot's ``[H, I]``, bit for bit what the same experts in an "hi" pool give (GPU only)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ftjax.host import HostPool, cuda

pytestmark = pytest.mark.gpu
if not cuda.available():
    pytest.skip("needs a CUDA build, a GPU and JAX's GPU backend", allow_module_level=True)

H, I, N, S = 136, 72, 24, 12  # not square, multiples of 8 but not of the 16-byte tiles' 64 columns
DT = {"bf16": (np.dtype(ml_dtypes.bfloat16), jnp.bfloat16), "f32": (np.dtype(np.float32), jnp.float32)}


@pytest.fixture(scope="module", params=["bf16", "f32"])
def pools(request):
    np_dt, _ = DT[request.param]
    rng = np.random.default_rng(11)
    banks = {"gate_up": (rng.standard_normal((N, 2 * I, H)) * 0.2).astype(np_dt),
             "down": (rng.standard_normal((N, H, I)) * 0.2).astype(np_dt)}
    hi, ih = HostPool.from_banks(banks), HostPool.from_banks(banks, down_layout="ih")
    assert hi.pin_if_cuda() and ih.pin_if_cuda()
    return request.param, hi, ih, banks


def caches(fmt):
    dt = DT[fmt][1]
    return jnp.full((S, 2 * I, H), -3.0, dt), jnp.full((S, H, I), -3.0, dt)


def host(a):
    return np.asarray(a.astype(jnp.float32))


@pytest.mark.parametrize("blocks", [0, 3])
def test_fill_transposes_into_the_slot(pools, blocks):
    fmt, hi, ih, banks = pools
    ids = np.array([5, 23, 0, -1, 7], np.int32)
    slots = np.array([3, 0, 11, 4, 6], np.int32)
    out = {}
    for name, p in (("hi", hi), ("ih", ih)):
        fill = jax.jit(lambda i, s, n, g, d, p=p: cuda.expert_fill(i, s, n, g, d, p, blocks=blocks),
                       donate_argnums=(3, 4))
        out[name] = [host(a) for a in fill(ids, slots, jnp.int32(5), *caches(fmt))]
    np.testing.assert_array_equal(out["ih"][1], out["hi"][1])
    np.testing.assert_array_equal(out["ih"][0], out["hi"][0])
    for q in (0, 1, 2, 4):
        np.testing.assert_array_equal(out["ih"][1][slots[q]], banks["down"][ids[q]].astype(np.float32))
    assert np.all(out["ih"][1][[1, 2, 4, 5]] == -3.0)


def test_fill_units_transposes_the_units_only(pools):
    fmt, hi, ih, banks = pools
    ids = np.array([5, 23, -1, 7], np.int32)
    slots = np.array([3, 0, 4, 6], np.int32)
    for u in (8, 40, 64, I):
        out = {}
        for name, p in (("hi", hi), ("ih", ih)):
            fill = jax.jit(lambda i, s, n, uu, g, d, p=p: cuda.expert_fill_units(i, s, n, uu, g, d, p),
                           donate_argnums=(4, 5))
            out[name] = [host(a) for a in fill(ids, slots, jnp.int32(4), jnp.int32(u), *caches(fmt))]
        np.testing.assert_array_equal(out["ih"][0], out["hi"][0])
        np.testing.assert_array_equal(out["ih"][1], out["hi"][1])
        d = out["ih"][1][slots[0]]
        np.testing.assert_array_equal(d[:, :u], banks["down"][ids[0]][:, :u].astype(np.float32))
        assert np.all(d[:, u:] == -3.0)


def test_background_fork_transposes_whole_and_the_rest(pools):
    fmt, hi, ih, banks = pools
    L, F = 2, 2
    ids, slots = np.array([[5, 23], [7, 9]], np.int32), np.array([[3, 0], [6, 1]], np.int32)
    for u in (0, 16, 48):
        out = {}
        for name, p in (("hi", hi), ("ih", ih)):
            bg = cuda.create_background(L, F)

            @jax.jit
            def step(ids, slots, n, frm, g, d, p=p, bg=bg):
                g, d = cuda.background_fork(ids, slots, n, g, d, p, bg, units_from=frm, blocks=3)
                for layer in range(L):
                    g, d = cuda.background_wait(g, d, bg, layer)
                return g, d

            out[name] = [host(a) for a in step(ids, slots, np.array([2, 1], np.int32), np.array([u, 0], np.int32),
                                               *caches(fmt))]
            assert not cuda.background_error(bg)
            cuda.destroy_background(bg)
        np.testing.assert_array_equal(out["ih"][0], out["hi"][0])
        np.testing.assert_array_equal(out["ih"][1], out["hi"][1])
        np.testing.assert_array_equal(out["ih"][1][slots[1, 0]], banks["down"][ids[1, 0]].astype(np.float32))
        np.testing.assert_array_equal(out["ih"][1][slots[0, 0]][:, u:], banks["down"][ids[0, 0]][:, u:].astype(np.float32))

