"""Qwen3-Next / Qwen3.5 / Qwen3.6 MoE: hybrid Gated DeltaNet + output-gated attention, shared expert.

Layer ``i`` is full attention iff ``cfg.layer_types[i] == "full_attention"``, else a GDN layer. The
checkpoint reader converts Qwen3-Next's interleaved projections to the flat Qwen3.5 layout, so one
file serves both. Pure functions (docs/internals.md, "Model API").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ftjax.config import ModelConfig
from ftjax.models import layers as L
from ftjax.models.qwen3_moe import State, attention_block, check_family, init_attn_state, run_decoder


def init_state(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> State:
    """KV cache per attention layer; per GDN layer conv ``[B, conv_dim, K-1]`` (``dtype``) and rec
    ``[B, Hv, dk, dv]`` (fp32)."""
    check_family(cfg, "qwen3_5_moe")
    layers = []
    for kind in cfg.layer_types:
        if kind == "full_attention":
            layers.append(init_attn_state(cfg, batch, max_len, dtype))
        else:
            layers.append({
                "conv": jnp.zeros((batch, cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1), dtype),
                "rec": jnp.zeros((batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                  cfg.linear_value_head_dim), jnp.float32),
            })
    return {"lengths": jnp.zeros((batch,), jnp.int32), "layers": layers}


def gdn_block(p: dict, st: dict, h: jax.Array, ctx: dict, cfg: ModelConfig) -> tuple[jax.Array, dict]:
    """Gated DeltaNet of ``h [B, T, H]`` continuing from this layer's conv/recurrent state.

    Pads get beta = g = 0 (the recurrent state passes through them unchanged) and never enter the
    conv state. T == 1 runs the recurrent form, T > 1 the chunked form (also when continuing).
    """
    B, T, _ = h.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    valid = ctx["valid"]
    h = jnp.where(valid[..., None], h, jnp.zeros_like(h))
    qkv = L.linear(h, p["in_proj_qkv"])
    z = L.linear(h, p["in_proj_z"]).reshape(B, T, hv, dv)
    b = L.linear(h, p["in_proj_b"])
    a = L.linear(h, p["in_proj_a"])
    qkv, conv = L.causal_conv1d(qkv, st["conv"], p["conv1d"], ctx["n_new"])
    q = qkv[..., :hk * dk].reshape(B, T, hk, dk)
    k = qkv[..., hk * dk:2 * hk * dk].reshape(B, T, hk, dk)
    v = qkv[..., 2 * hk * dk:].reshape(B, T, hv, dv)
    beta = jax.nn.sigmoid(b)  # model dtype, as HF
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + p["dt_bias"])
    beta = jnp.where(valid[..., None], beta, jnp.zeros_like(beta))
    g = jnp.where(valid[..., None], g, jnp.zeros_like(g))
    rule = L.gated_delta_recurrent if T == 1 else L.gated_delta_chunked
    o, rec = rule(q, k, v, g, beta, st["rec"])
    o = L.gated_rms_norm(o, z, p["norm"], cfg.rms_norm_eps).reshape(B, T, hv * dv)
    return L.linear(o, p["out_proj"]), {"conv": conv, "rec": rec}


def forward(params, expert_state, state: State, tokens, n_new, *, cfg: ModelConfig, backend,
            all_logits: bool = False):
    """Append ``n_new[b]`` tokens of row ``b`` (right-padded ``tokens [B, T]``) and return logits.

    Logits are ``[B, V]`` at each row's last new token, or ``[B, T, V]`` with ``all_logits``; fp32.
    """
    check_family(cfg, "qwen3_5_moe")
    return run_decoder(params, expert_state, state, tokens, n_new, cfg=cfg, backend=backend,
                       all_logits=all_logits,
                       mixers={"full_attention": attention_block, "linear_attention": gdn_block})
