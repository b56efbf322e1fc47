"""Routing traces: format round trip, the calibrated generator, recording and replaying routing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.experts.resident import ResidentExperts
from ftjax.experts.traces import ReplayRouting, RoutingTrace, TraceRecorder, lru_miss_rate, synthetic_trace


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def test_round_trip(tmp_path):
    tr = synthetic_trace(5, 3, 16, 4, batch=2, seed=3)
    tr.save(tmp_path / "t.npz")
    back = RoutingTrace.load(tmp_path / "t.npz")
    assert np.array_equal(back.ids, tr.ids) and np.allclose(back.weights, tr.weights) and back.meta == tr.meta
    assert back.ids.shape == (5, 3, 2, 4)
    assert all(len(set(row)) == 4 for row in back.ids.reshape(-1, 4))  # k distinct experts per token


def test_generator_is_calibrated_to_the_paper_miss_rates():
    # the Qwen3.6-35B-A3B shape; a shorter run than the calibration's, so a looser tolerance
    tr = synthetic_trace(240, 40, 256, 8, seed=5)
    at37 = lru_miss_rate(tr, int(0.37 * 40 * 256), warmup=60)
    at11 = lru_miss_rate(tr, int(0.11 * 40 * 256), warmup=60)
    assert abs(at37 - 0.16) < 0.025 and abs(at11 - 0.39) < 0.03, (at37, at11)


def test_record_and_replay():
    L, E, k, T, H, I = 2, 8, 2, 3, 8, 4
    rng = np.random.default_rng(0)
    banks = {"gate_up": jnp.asarray(rng.standard_normal((L * E, 2 * I, H)), jnp.float32),
             "down": jnp.asarray(rng.standard_normal((L * E, H, I)), jnp.float32)}
    rec = TraceRecorder(ResidentExperts(E), E)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, E, (L, T, k)), jnp.int32)
    w = jnp.asarray(rng.random((L, T, k)), jnp.float32)
    valid = jnp.ones((T,), bool)
    for layer in range(L):  # a prefill call of as many tokens: skipped by the trace (decode=False)
        rec(banks, layer, x, ids[layer] * 0, w[layer], valid, decode=False)
    outs = []
    for step in range(2):
        for layer in range(L):
            y, _ = rec(banks, layer, x, ids[layer], w[layer], valid, decode=True)
            outs.append(y)
    jax.effects_barrier()
    tr = rec.to_trace(L)
    assert tr.ids.shape == (2, L, T, k) and np.array_equal(tr.ids[0], np.asarray(ids))
    assert np.array_equal(tr.ids[1], np.asarray(ids))
    rep = ReplayRouting(ResidentExperts(E))
    st = rep.init_state(banks, L, T, k)
    st["replay"] = {"ids": jnp.asarray(tr.ids[0]), "weights": jnp.asarray(tr.weights[0])}
    junk = jnp.zeros((T, k), jnp.int32)
    y, _ = rep(st, 1, x, junk, jnp.zeros((T, k), jnp.float32), valid)
    assert np.allclose(np.asarray(y), np.asarray(outs[1]), atol=1e-5)


def test_replay_whole_trace_on_device_steps_with_the_last_layer():
    L, E, T, k, H, I = 3, 8, 2, 2, 16, 8
    rng = np.random.default_rng(3)
    banks = {"gate_up": jnp.asarray(rng.standard_normal((L * E, 2 * I, H)), jnp.float32),
             "down": jnp.asarray(rng.standard_normal((L * E, H, I)), jnp.float32)}
    tr = synthetic_trace(3, L, E, k, batch=T, seed=1)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    valid = jnp.ones((T,), bool)
    junk_ids, junk_w = jnp.zeros((T, k), jnp.int32), jnp.zeros((T, k), jnp.float32)
    rep = ReplayRouting(ResidentExperts(E))
    dev = rep.init_trace_state(banks, tr)
    one = rep.init_state(banks, L, T, k)
    call = jax.jit(rep.__call__, static_argnums=(1,), static_argnames=("decode",))
    _, dev = call(dev, L - 1, x, junk_ids, junk_w, valid, decode=False)  # prefill: does not advance
    assert int(dev["replay"]["step"]) == 0
    for step in range(4):  # wraps around the 3-step trace
        s = step % 3
        one["replay"] = {"ids": jnp.asarray(tr.ids[s]), "weights": jnp.asarray(tr.weights[s])}
        for layer in range(L):
            y_dev, dev = call(dev, layer, x, junk_ids, junk_w, valid, decode=True)
            y_one, _ = rep(one, layer, x, junk_ids, junk_w, valid, decode=True)
            assert np.allclose(np.asarray(y_dev), np.asarray(y_one), atol=1e-5)
        assert int(dev["replay"]["step"]) == step + 1
    with pytest.raises(ValueError, match="the trace routes"):
        rep(dev, 0, x[:1], junk_ids[:1], junk_w[:1], valid[:1], decode=True)
