"""HostCPUExperts (every route on the CPU worker pool) reproduces ResidentExperts end to end."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ftjax.config import parse_hf_config
from ftjax.experts.host_cpu import HostCPUExperts
from ftjax.experts.resident import ResidentExperts
from ftjax.host import HostPool
from ftjax.models import get_family, make_step_fns
from ftjax.models.params import expert_bank_shapes, param_shapes, unflatten

CFG = {
    "model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 64, "num_experts": 8, "num_experts_per_tok": 3,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 24, "linear_conv_kernel_dim": 4,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "layer_types": ["linear_attention", "full_attention"],
}

@pytest.fixture(autouse=True)
def _on_cpu():
    """cpu_experts is a CPU-platform target: run on JAX's CPU device also where a GPU is the default."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield



def run_steps(cfg, params, backend, expert_state, dtype):
    fam = get_family(cfg)
    rng = np.random.default_rng(9)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 6)), jnp.int32)
    n_new = jnp.asarray([6, 4], jnp.int32)
    prefill, decode = make_step_fns(cfg, backend, 2, 6, 16)
    logits, state, expert_state = prefill(params, expert_state, fam.init_state(cfg, 2, 16, dtype), tokens, n_new)
    outs = [logits]
    for _ in range(3):
        nxt = jnp.argmax(outs[-1], -1).astype(jnp.int32)[:, None]
        logits, state, expert_state = decode(params, expert_state, state, nxt, jnp.ones((2,), jnp.int32))
        outs.append(logits)
    return np.stack([np.asarray(o, np.float32) for o in outs])


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-4), (ml_dtypes.bfloat16, 5e-2)])
def test_host_cpu_backend_equals_resident(dtype, tol):
    cfg = parse_hf_config(CFG)
    rng = np.random.default_rng(0)
    params = unflatten({n: jnp.asarray(rng.standard_normal(s) * 0.3, dtype) for n, s in param_shapes(cfg).items()})
    banks = {b: (rng.standard_normal(s) * 0.3).astype(dtype) for b, s in expert_bank_shapes(cfg).items()}
    pool = HostPool.from_banks(banks)
    want = run_steps(cfg, params, ResidentExperts(cfg.num_experts), ResidentExperts.init_state(banks), dtype)
    got = run_steps(cfg, params, HostCPUExperts(pool, cfg.num_experts), {}, dtype)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() / scale < tol


def test_backend_validates():
    pool = HostPool(8, 64, 32, "f32")
    with pytest.raises(ValueError, match="does not divide"):
        HostCPUExperts(pool, 3)
