"""Qwen3-MoE (Qwen3-30B-A3B family): GQA attention with q/k norms + routed SwiGLU experts.

Pure functions (docs/internals.md, "Model API"). The attention and MoE blocks and the decoder loop
are shared with ``qwen3_5_moe``; they read ``cfg`` for the Qwen3.5 differences (zero-centred norms,
output-gated attention, partial rotary, shared expert).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from ftjax.config import ModelConfig
from ftjax.models import layers as L

State = dict[str, Any]


def check_family(cfg: ModelConfig, family: str) -> None:
    if cfg.family != family:
        raise ValueError(f"config family {cfg.family!r} given to the {family!r} model file")


def init_attn_state(cfg: ModelConfig, batch: int, max_len: int, dtype) -> dict[str, jax.Array]:
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def init_state(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> State:
    """Empty KV cache ``[B, max_len, nkv, hd]`` per layer and zero lengths."""
    check_family(cfg, "qwen3_moe")
    return {"lengths": jnp.zeros((batch,), jnp.int32),
            "layers": [init_attn_state(cfg, batch, max_len, dtype) for _ in range(cfg.num_layers)]}


def attention_block(p: dict, st: dict, h: jax.Array, ctx: dict, cfg: ModelConfig) -> tuple[jax.Array, dict]:
    """Self-attention of ``h [B, T, H]`` over this layer's KV cache; returns the output and the new cache."""
    B, T, _ = h.shape
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    zc = cfg.zero_centered_norm
    q = L.linear(h, p["q_proj"])
    if cfg.attn_output_gate:
        # HF keeps query and gate interleaved per head: [q_h (hd) | gate_h (hd)] for each head h.
        q = q.reshape(B, T, nh, 2 * hd)
        q, gate = q[..., :hd], q[..., hd:].reshape(B, T, nh * hd)
    else:
        q = q.reshape(B, T, nh, hd)
    k = L.linear(h, p["k_proj"]).reshape(B, T, nkv, hd)
    v = L.linear(h, p["v_proj"]).reshape(B, T, nkv, hd)
    q = L.rms_norm(q, p["q_norm"], cfg.rms_norm_eps, zc)
    k = L.rms_norm(k, p["k_norm"], cfg.rms_norm_eps, zc)
    q, k = L.apply_rope(q, *ctx["rope"]), L.apply_rope(k, *ctx["rope"])
    k_cache = L.write_kv(st["k"], k, ctx["lengths"], ctx["valid"])
    v_cache = L.write_kv(st["v"], v, ctx["lengths"], ctx["valid"])
    o = L.attend(q, k_cache, v_cache, ctx["positions"], ctx["lengths"] + ctx["n_new"], hd ** -0.5)
    o = o.reshape(B, T, nh * hd)
    if cfg.attn_output_gate:
        o = o * jax.nn.sigmoid(gate)
    return L.linear(o, p["o_proj"]), {"k": k_cache, "v": v_cache}


def moe_block(p: dict, h: jax.Array, layer: int, ctx: dict, expert_state, cfg: ModelConfig, backend):
    """Router (model side) + routed experts (backend) + optional gated shared expert."""
    B, T, H = h.shape
    x = h.reshape(B * T, H)
    ids, weights = L.route(x, p["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    y, expert_state = backend(expert_state, layer, x, ids, weights, ctx["valid"].reshape(-1), decode=T == 1)
    if "shared_expert_gate" in p:
        y = y + L.shared_expert(x, p)
    return y.reshape(B, T, H), expert_state


Mixer = Callable[[dict, dict, jax.Array, dict, ModelConfig], tuple[jax.Array, dict]]


def run_decoder(params, expert_state, state: State, tokens, n_new, *, cfg: ModelConfig, backend,
                all_logits: bool, mixers: dict[str, Mixer]):
    """The decoder loop shared by the families: pre-norm mixer + pre-norm MoE per layer, final norm, head."""
    B, T = tokens.shape
    lengths = state["lengths"]
    n_new = n_new.astype(jnp.int32)
    steps = jnp.arange(T, dtype=jnp.int32)
    positions = lengths[:, None] + steps[None, :]
    x = params["embed"][tokens]
    ctx = {"lengths": lengths, "n_new": n_new, "valid": steps[None, :] < n_new[:, None],
           "positions": positions,
           "rope": L.rope_tables(positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)}
    zc, eps = cfg.zero_centered_norm, cfg.rms_norm_eps
    new_layers = []
    for i, (p, st) in enumerate(zip(params["layers"], state["layers"])):
        mixer_key = "attn" if cfg.layer_types[i] == "full_attention" else "gdn"
        h = L.rms_norm(x, p["input_norm"], eps, zc)
        h, st = mixers[cfg.layer_types[i]](p[mixer_key], st, h, ctx, cfg)
        x = x + h
        h = L.rms_norm(x, p["post_attn_norm"], eps, zc)
        h, expert_state = moe_block(p["moe"], h, i, ctx, expert_state, cfg, backend)
        x = x + h
        new_layers.append(st)
    if not all_logits:
        last = jnp.maximum(n_new - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    x = L.rms_norm(x, params["final_norm"], eps, zc)
    logits = L.linear(x, params["lm_head"]).astype(jnp.float32)
    return logits, {"lengths": lengths + n_new, "layers": new_layers}, expert_state


def forward(params, expert_state, state: State, tokens, n_new, *, cfg: ModelConfig, backend,
            all_logits: bool = False):
    """Append ``n_new[b]`` tokens of row ``b`` (right-padded ``tokens [B, T]``) and return logits.

    Logits are ``[B, V]`` at each row's last new token, or ``[B, T, V]`` with ``all_logits``; fp32.
    """
    check_family(cfg, "qwen3_moe")
    return run_decoder(params, expert_state, state, tokens, n_new, cfg=cfg, backend=backend,
                       all_logits=all_logits, mixers={"full_attention": attention_block})
