"""SamplingParams validation and the jitted per-row sampler."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.engine.sampling import SamplingParams, batch_arrays, row_keys, sample

sample_jit = jax.jit(sample)


@pytest.mark.parametrize("field, value, range_text", [
    ("temperature", -0.1, ">= 0"),
    ("temperature", float("nan"), ">= 0"),
    ("top_k", -1, ">= 0"),
    ("top_k", 2.5, "integer >= 0"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.01, "(0, 1]"),
    ("seed", -3, "[0, 2**32 - 1]"),
    ("seed", 2**32, "[0, 2**32 - 1]"),
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", True, ">= 1"),
    ("stop_token_ids", (-1,), "token ids >= 0"),
    ("stop", ("",), "non-empty strings"),
])
def test_invalid_values_name_field_and_range(field, value, range_text):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert field in str(e.value) and range_text in str(e.value)


def test_valid_values_and_normalisation():
    p = SamplingParams(temperature=0, top_k=0, top_p=1, max_tokens=1, stop="END", stop_token_ids=[5])
    assert p.greedy and p.stop == ("END",) and p.stop_token_ids == (5,)


def _logits(B=4, V=64, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, V)) * 3


def _rows(B, temperature=1.0, top_k=0, top_p=1.0):
    return (jnp.full((B,), temperature, jnp.float32), jnp.full((B,), top_k, jnp.int32),
            jnp.full((B,), top_p, jnp.float32))


def test_greedy_is_argmax():
    lg = _logits()
    ids = sample_jit(lg, jax.random.PRNGKey(1), *_rows(4, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(ids), np.argmax(np.asarray(lg), -1))


def test_top_k_restricts_support():
    lg = _logits(B=2, V=50)
    allowed = np.argsort(-np.asarray(lg), -1)[:, :3]
    for s in range(40):
        ids = np.asarray(sample_jit(lg, jax.random.PRNGKey(s), *_rows(2, top_k=3)))
        assert all(ids[b] in allowed[b] for b in range(2))
    ids = np.asarray(sample_jit(lg, jax.random.PRNGKey(0), *_rows(2, top_k=1)))
    np.testing.assert_array_equal(ids, allowed[:, 0])


def test_top_p_restricts_support():
    probs = np.array([[0.5, 0.3, 0.15, 0.05]], np.float32)
    lg = jnp.asarray(np.log(probs))
    seen = {int(sample_jit(lg, jax.random.PRNGKey(s), *_rows(1, top_p=0.7))[0]) for s in range(200)}
    assert seen == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 reaches it: token 2 and 3 are cut
    seen = {int(sample_jit(lg, jax.random.PRNGKey(s), *_rows(1, top_p=0.4))[0]) for s in range(50)}
    assert seen == {0}


def test_sampling_follows_distribution():
    probs = np.array([0.6, 0.3, 0.1], np.float32)
    lg = jnp.tile(jnp.log(probs)[None], (4096, 1))
    ids = np.asarray(sample_jit(lg, jax.random.PRNGKey(0), *_rows(4096)))
    np.testing.assert_allclose(np.bincount(ids, minlength=3) / 4096, probs, atol=0.03)


def test_seeded_reproducibility_and_per_row_keys():
    lg = _logits(B=3, V=200)
    rows = _rows(3, temperature=1.5)
    a = sample_jit(lg, row_keys(jnp.array([7, 7, 9], jnp.uint32), jnp.int32(4)), *rows)
    b = sample_jit(lg, row_keys(jnp.array([7, 7, 9], jnp.uint32), jnp.int32(4)), *rows)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A row's key depends only on its seed and the step, not on the other rows.
    alone = sample_jit(lg[2:], row_keys(jnp.array([9], jnp.uint32), jnp.int32(4)), *_rows(1, temperature=1.5))
    assert int(alone[0]) == int(a[2])
    steps = {int(sample_jit(lg, row_keys(jnp.array([7, 7, 9], jnp.uint32), jnp.int32(s)), *rows)[0])
             for s in range(20)}
    assert len(steps) > 1


def test_mixed_rows_in_one_batch():
    lg = _logits(B=3, V=100)
    temperature = jnp.array([0.0, 1.0, 1.0], jnp.float32)
    top_k = jnp.array([0, 1, 0], jnp.int32)
    top_p = jnp.array([1.0, 1.0, 1.0], jnp.float32)
    ids = np.asarray(sample_jit(lg, jax.random.PRNGKey(3), temperature, top_k, top_p))
    top = np.argmax(np.asarray(lg), -1)
    assert ids[0] == top[0] and ids[1] == top[1]


def test_typed_key_and_batch_arrays():
    lg = _logits(B=2)
    ids = sample_jit(lg, jax.random.key(0), *_rows(2))
    assert ids.shape == (2,) and ids.dtype == jnp.int32
    arrays = batch_arrays([SamplingParams(temperature=0.5, top_k=3, seed=11)], 4)
    assert arrays["temperature"].tolist() == [0.5, 0.0, 0.0, 0.0]
    assert arrays["top_k"].tolist() == [3, 0, 0, 0] and arrays["seeds"].tolist()[0] == 11
    with pytest.raises(ValueError, match="do not fit"):
        batch_arrays([SamplingParams()] * 3, 2)
