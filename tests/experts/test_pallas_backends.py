"""The backends with ``kernel="pallas"`` (Mosaic GPU kernels, interpreted on the CPU) equal the jnp
resident model within bf16 tolerance: prefill (grouped GEMM) and decode (grouped GEMV) steps, for
ResidentExperts and OffloadExperts (lru-split at ~37% of the pool, so routes go to the cache, the CPU
and fills). Skips where this jax cannot interpret Mosaic GPU kernels (jax 0.10.2)."""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ftjax.config import parse_hf_config
from ftjax.experts.decode import OffloadExperts
from ftjax.experts.kernels import check_kernel, prefill_tiles
from ftjax.experts.resident import ResidentExperts
from ftjax.experts.runtime import OffloadConfig
from ftjax.host import HostPool
from ftjax.models import get_family, make_step_fns
from ftjax.models.params import expert_bank_shapes, param_shapes, unflatten

CFG = {
    "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "norm_topk_prob": True,
}
L, E = 2, 8
PROMPT, STEPS, MAX_LEN = 6, 4, 12  # prefill 12 routes > E: grouped GEMM; decode 2 routes: GEMV


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@functools.cache
def _model():
    cfg = parse_hf_config(CFG)
    rng = np.random.default_rng(0)
    params = unflatten({n: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16)
                        for n, s in param_shapes(cfg).items()})
    banks = {b: (rng.standard_normal(s) * 1.0).astype(ml_dtypes.bfloat16) for b, s in expert_bank_shapes(cfg).items()}
    return cfg, params, banks


def _run(backend, expert_state):
    cfg, params, _ = _model()
    fam = get_family(cfg)
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, PROMPT)), jnp.int32)
    prefill, decode = make_step_fns(cfg, backend, 1, PROMPT, MAX_LEN)
    state = fam.init_state(cfg, 1, MAX_LEN, jnp.bfloat16)
    logits, state, expert_state = prefill(params, expert_state, state, prompt, jnp.asarray([PROMPT], jnp.int32))
    outs = [logits]
    for i in range(STEPS):
        tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 1)), jnp.int32)
        logits, state, expert_state = decode(params, expert_state, state, tok, jnp.ones((1,), jnp.int32))
        outs.append(logits)
    return np.stack([np.asarray(o, np.float32) for o in outs])


@functools.cache
def _reference():
    _, _, banks = _model()
    return _run(ResidentExperts(E), ResidentExperts.init_state(banks))


def _close(got, want):
    scale = np.abs(want).max()
    assert np.isfinite(got).all() and scale > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=0.03 * scale)


def test_resident_pallas_equals_jnp(mgpu_interpret):
    _, _, banks = _model()
    _close(_run(ResidentExperts(E, kernel="pallas"), ResidentExperts.init_state(banks)), _reference())


def test_offload_pallas_equals_resident(mgpu_interpret):
    """fill_cap=1: one expert per layer call is filled, so prefill and decode both leave routes to
    the CPU and the kernels see partial route sets (per-route validity, compaction)."""
    _, _, banks = _model()
    backend = OffloadExperts(HostPool.from_banks(banks), L, E, round(0.37 * L * E), "lru-split", fill_cap=1,
                             kernel="pallas")
    state = backend.init_state(fill_fraction=0.4)
    _close(_run(backend, state), _reference())


def test_offload_pallas_unit_split_equals_resident(mgpu_interpret):
    """The unit split through the Pallas decode GEMV: a split call's routes compute units [0, u) from the
    slot (the GEMV's per-route units), the CPU [u, I): the resident logits (prefill calls are never split:
    they keep the prefill kernel)."""
    _, _, banks = _model()
    backend = OffloadExperts(HostPool.from_banks(banks), L, E, round(0.37 * L * E), "lru-split", defer_fills=True,
                             unit_split=True, kernel="pallas")
    state = backend.init_state(fill_fraction=0.4)
    _close(_run(backend, state), _reference())


def test_kernel_choice_errors():
    with pytest.raises(ValueError, match="bf16"):
        check_kernel("pallas", 64, 32, jnp.float32)
    with pytest.raises(ValueError, match="unknown"):
        check_kernel("triton", 64, 32, jnp.bfloat16)
    with pytest.raises(ValueError, match="cannot tile"):
        prefill_tiles(48, 24, interpret=False)
    with pytest.raises(ValueError, match="kernel"):
        OffloadConfig(kernel="cuda")
    with pytest.raises(ValueError, match="kernel"):
        ResidentExperts(E, kernel="cuda")
    f32 = {b: np.ones(s, np.float32) for b, s in expert_bank_shapes(parse_hf_config(CFG)).items()}
    with pytest.raises(ValueError, match="bf16"):
        OffloadExperts(HostPool.from_banks(f32), L, E, 4, "lru-split", kernel="pallas")
