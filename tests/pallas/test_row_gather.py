"""TMA row gather (ftjax.pallas.row_gather) against ``x[idx]``: interpret mode on the CPU, CUDA
lowering at the prefill's real sizes without a GPU, the compiled kernel on a GPU (marked)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.pallas import row_gather as rg


def _case(seed, T, H, N, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, H)) + 0.5, dtype)  # no zero rows: a missed copy shows
    idx = jnp.asarray(rng.integers(0, T, N), jnp.int32)
    return x, idx


@pytest.mark.parametrize("T, H, N, num_sms, dtype", [
    (37, 256, 100, 3, jnp.bfloat16),  # rows split unevenly over the CTAs (34, 34, 32)
    (9, 512, 7, 4, jnp.bfloat16),  # fewer rows than CTAs x 2: the last CTA has one row
    (5, 128, 3, 8, jnp.bfloat16),  # more CTAs than rows: idle CTAs
    (50, 1024, 300, 2, jnp.bfloat16),  # a row of 4 boxes' worth of columns ([1, 4, 256]); ring reuse
    (20, 96, 61, 3, jnp.float32),  # f32, H < 256: one box of 96 columns
])
def test_matches_take(T, H, N, num_sms, dtype, mgpu_interpret):
    x, idx = _case(T + N, T, H, N, dtype)
    out = rg.gather_rows(x, idx, num_sms=num_sms, interpret=True)
    assert out.shape == (N, H) and out.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(out), np.asarray(rg.reference_gather_rows(x, idx)))


def test_out_of_range_rows_are_clamped(mgpu_interpret):
    x, _ = _case(1, 6, 128, 4)
    idx = jnp.asarray([-3, 0, 5, 99], jnp.int32)
    out = rg.gather_rows(x, idx, num_sms=2, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x)[[0, 0, 5, 5]])


def test_supported_and_errors():
    assert rg.row_layout(2048, 2) == (8, 256) and rg.row_layout(4096, 2) == (16, 256)
    assert rg.row_layout(96, 4) == (1, 96)
    assert rg.row_layout(100, 2) is None  # 200 bytes: not a 16-byte multiple
    assert rg.row_layout(300, 2) is None  # 300 = C * 256 has no integer C
    assert rg.supported((8, 2048), jnp.bfloat16, 65536, 132)
    assert not rg.supported((0, 2048), jnp.bfloat16, 10, 132)  # no rows to read
    assert not rg.supported((8, 2048), jnp.bfloat16, 0, 132)  # nothing to write
    assert not rg.supported((8, 256 * 257), jnp.bfloat16, 10, 132)  # C = 257 boxes
    with pytest.raises(ValueError, match=r"not one TMA box per row"):
        jax.eval_shape(functools.partial(rg.gather_rows, num_sms=2),
                       jax.ShapeDtypeStruct((8, 100), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32))


@pytest.mark.parametrize("T, H, N", [(8192, 2048, 67456), (8192, 4096, 67456), (16384, 2048, 133504)])
def test_lowers_for_cuda(T, H, N, mgpu):
    from jax import export

    sd = jax.ShapeDtypeStruct
    exp = export.export(jax.jit(functools.partial(rg.gather_rows, num_sms=132)), platforms=["cuda"])(
        sd((T, H), jnp.bfloat16), sd((N,), jnp.int32))
    assert "mosaic_gpu" in exp.mlir_module()


def _on_gpu():
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu(), reason="needs JAX's GPU backend (Hopper)")
@pytest.mark.parametrize("T, H, N", [(8192, 2048, 67456), (1000, 4096, 5003), (64, 256, 7)])
def test_compiled_matches_take_on_gpu(T, H, N):
    x, idx = _case(3, T, H, N)
    out = rg.gather_rows(x, idx, num_sms=jax.devices()[0].core_count)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x[idx]))
