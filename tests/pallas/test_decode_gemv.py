"""Decode grouped GEMV (ftjax.pallas.decode_gemv) against its jnp reference, in Mosaic GPU
interpret mode on the CPU. Skips where this jax has no Mosaic GPU interpret mode (jax 0.10.2)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.pallas.decode_gemv import decode_experts, reference_decode_experts


@functools.cache
def _mgpu_interpret_unavailable():
    """None when Mosaic GPU interpret mode runs a tiny kernel here, else the reason."""
    try:
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except Exception as e:  # noqa: BLE001
        return f"no jax.experimental.pallas.mosaic_gpu: {e!r}"
    if not hasattr(plgpu, "InterpretGPUParams"):
        return f"jax {jax.__version__} has no plgpu.InterpretGPUParams (Mosaic GPU interpret mode)"
    try:
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...] + 1.0

        out = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                             interpret=plgpu.InterpretGPUParams())(jnp.ones((8, 128), jnp.float32))
        if not bool(jnp.all(out == 2.0)):
            return "Mosaic GPU interpret mode gave a wrong result on a probe kernel"
    except Exception as e:  # noqa: BLE001
        return f"Mosaic GPU interpret mode failed on a probe kernel: {e!r}"
    return None


def _need_interpret():
    reason = _mgpu_interpret_unavailable()
    if reason:
        pytest.skip(reason)


def _inputs(seed, *, T, H, I, S, R, x_dtype=jnp.bfloat16, dup=False):
    k = jax.random.split(jax.random.key(seed), 4)
    x = (jax.random.normal(k[0], (T, H)) + 0.1).astype(x_dtype)
    gate_up = (jax.random.normal(k[1], (S, 2 * I, H)) / np.sqrt(H) + 0.01).astype(jnp.bfloat16)
    down = (jax.random.normal(k[2], (S, H, I)) / np.sqrt(I) + 0.01).astype(jnp.bfloat16)
    slots = np.array(jax.random.permutation(k[3], max(S, R))[:R] % S, np.int32)
    if dup:
        slots[1::2] = slots[0]
    tokens = np.arange(R, dtype=np.int32) % T
    return x, jnp.asarray(slots), jnp.asarray(tokens), gate_up, down


def _check(out, ref, n_valid):
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.dtype == np.float32 and out.shape == ref.shape
    assert np.all(out[n_valid:] == 0.0)
    if n_valid:
        scale = np.max(np.abs(ref[:n_valid]))
        assert scale > 0
        np.testing.assert_allclose(out[:n_valid], ref[:n_valid], rtol=0, atol=1e-2 * scale)


def test_reference_matches_numpy_loop():
    x, slots, tokens, gate_up, down = _inputs(0, T=2, H=12, I=6, S=3, R=4)
    n_valid = 3
    ref = np.asarray(reference_decode_experts(x, slots, tokens, jnp.int32(n_valid), gate_up, down))
    xs, gu, dn = (np.asarray(a, np.float64) for a in (x, gate_up, down))
    for r in range(4):
        s, t = int(slots[r]), int(tokens[r])
        h = gu[s] @ xs[t]
        g, u = h[:6], h[6:]
        want = dn[s] @ (g / (1 + np.exp(-g)) * u) if r < n_valid else np.zeros(12)
        np.testing.assert_allclose(ref[r], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        # odd sizes: H, I not multiples of the block; last I-block clamped; partial count
        dict(T=3, H=40, I=20, S=5, R=6, n_valid=4, block_i=8, n_split=2),
        # count = capacity, duplicate slots, f32 activations
        dict(T=2, H=24, I=16, S=3, R=6, n_valid=6, block_i=8, n_split=1, dup=True,
             x_dtype=jnp.float32),
        # I smaller than the block, more splits than blocks, one route
        dict(T=1, H=33, I=5, S=2, R=1, n_valid=1, block_i=8, n_split=4),
        # count 0
        dict(T=2, H=16, I=8, S=2, R=3, n_valid=0, block_i=8, n_split=1),
    ],
    ids=["odd-partial", "full-dup-f32", "tiny-i", "count0"],
)
def test_decode_experts_matches_reference(case):
    _need_interpret()
    case = dict(case)
    n_valid, block_i, n_split = case.pop("n_valid"), case.pop("block_i"), case.pop("n_split")
    x, slots, tokens, gate_up, down = _inputs(1, **case)
    nv = jnp.int32(n_valid)
    out = decode_experts(x, slots, tokens, nv, gate_up, down, block_i=block_i, n_split=n_split,
                         interpret=True)
    _check(out, reference_decode_experts(x, slots, tokens, nv, gate_up, down), n_valid)


def test_device_count_one_compile():
    """n_valid is a traced device scalar: one compiled function serves every count."""
    _need_interpret()
    x, slots, tokens, gate_up, down = _inputs(2, T=4, H=24, I=12, S=4, R=8, dup=True)
    fn = jax.jit(functools.partial(decode_experts, block_i=8, n_split=2, interpret=True))
    for n_valid in (0, 3, 8):
        nv = jnp.int32(n_valid)
        out = fn(x, slots, tokens, nv, gate_up, down)
        _check(out, reference_decode_experts(x, slots, tokens, nv, gate_up, down), n_valid)
    assert fn._cache_size() == 1
