"""Shared pure-jnp layers of the Qwen3-MoE / Qwen3-Next / Qwen3.5 families.

Numerics follow Hugging Face transformers 5.x (see shared/reference/model-architectures.md, section 1):
norms and softmaxes in fp32 with HF's cast order, the gated delta rule entirely in fp32. Linear weights
keep the torch ``[out, in]`` orientation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
# fp32 parts of the model (GDN) must not silently drop to TF32/bf16 passes on GPUs.
_HI = lax.Precision.HIGHEST
GDN_CHUNK = 64


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` for a torch-oriented ``w [out, in]``."""
    return jnp.einsum("...i,oi->...o", x, w)


# ---------------------------------------------------------------------------------------------- norms
def rms_norm(x: jax.Array, w: jax.Array, eps: float, zero_centred: bool = False) -> jax.Array:
    """RMSNorm over the last axis. Plain: ``w * norm(x).to(dtype)``; zero-centred: ``(norm(x) * (1+w)).to(dtype)``."""
    xf = x.astype(F32)
    normed = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if zero_centred:
        return (normed * (1.0 + w.astype(F32))).astype(x.dtype)
    return (w * normed.astype(x.dtype)).astype(x.dtype)


def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """GDN output norm: normalise in fp32, cast, scale by ``w``, then gate by ``silu(z)`` in fp32."""
    xf = x.astype(F32)
    normed = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    h = (w * normed.astype(x.dtype)).astype(F32)
    return (h * jax.nn.silu(z.astype(F32))).astype(x.dtype)


def l2_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """FLA's L2 norm: eps inside the sqrt."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# ----------------------------------------------------------------------------------------------- rope
def rope_tables(positions: jax.Array, rotary_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[..., rotary_dim]`` for integer positions (HF ``cat(freqs, freqs)`` layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=F32) / rotary_dim))
    freqs = positions.astype(F32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Non-interleaved RoPE on the first ``cos.shape[-1]`` dims of ``x [B, T, heads, hd]``; the rest pass."""
    rd = cos.shape[-1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    xr = x[..., :rd]
    out = xr * c + rotate_half(xr) * s
    return jnp.concatenate([out, x[..., rd:]], axis=-1) if rd < x.shape[-1] else out


# ------------------------------------------------------------------------------------------ attention
def write_kv(cache: jax.Array, new: jax.Array, lengths: jax.Array, valid: jax.Array) -> jax.Array:
    """Write ``new [B, T, ...]`` at ``cache[b, lengths[b] + t]`` for valid ``t``; pads (and overflow) are dropped."""
    B, T = valid.shape
    S = cache.shape[1]
    pos = jnp.where(valid, lengths[:, None] + jnp.arange(T, dtype=lengths.dtype)[None, :], S)
    return cache.at[jnp.arange(B)[:, None], pos].set(new.astype(cache.dtype), mode="drop")


def attend(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, q_pos: jax.Array, kv_len: jax.Array,
           scale: float) -> jax.Array:
    """Causal GQA of ``q [B, T, nh, hd]`` over a cache ``[B, S, nkv, hd]``.

    Query ``t`` of row ``b`` sees cache slots ``j <= q_pos[b, t]`` and ``j < kv_len[b]``. Query head
    ``h`` uses KV head ``h // (nh/nkv)`` (HF ``repeat_kv``). Softmax in fp32, like HF eager.
    """
    B, T, nh, hd = q.shape
    S, nkv = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(B, T, nkv, nh // nkv, hd)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k_cache.astype(q.dtype)) * jnp.asarray(scale, q.dtype)
    j = jnp.arange(S)
    mask = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_len[:, None, None])
    scores = jnp.where(mask[:, None, None], scores.astype(F32), jnp.finfo(F32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v_cache.astype(q.dtype))
    return out.reshape(B, T, nh, hd)


# -------------------------------------------------------------------------------------- causal conv1d
def causal_conv1d(x: jax.Array, conv_state: jax.Array, w: jax.Array, n_new: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv + SiLU of ``x [B, T, C]`` continuing from ``conv_state [B, C, K-1]``.

    ``w [C, K]`` (torch cross-correlation order). Returns the outputs and the new state: the last K-1
    pre-conv inputs of each row's valid prefix ``x[b, :n_new[b]]`` (so right padding never enters it).
    """
    B, T, C = x.shape
    K = w.shape[1]
    full = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2).astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    w = w.astype(x.dtype)
    y = full[:, 0:T] * w[:, 0]
    for i in range(1, K):
        y = y + full[:, i:i + T] * w[:, i]
    y = jax.nn.silu(y)
    idx = n_new[:, None] + jnp.arange(K - 1)[None, :]
    new_state = jnp.take_along_axis(full, idx[:, :, None], axis=1)
    return y.astype(x.dtype), jnp.swapaxes(new_state, 1, 2).astype(conv_state.dtype)


# ---------------------------------------------------------------------------------- gated delta rule
def _prep_qkv(q, k, v, num_v_heads):
    """Repeat QK heads to value heads (repeat_interleave), fp32, L2-normalise, scale q by dk^-0.5."""
    rep = num_v_heads // q.shape[2]
    if rep > 1:
        q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
    q, k = l2_norm(q.astype(F32)), l2_norm(k.astype(F32))
    return q * (q.shape[-1] ** -0.5), k, v.astype(F32)


def gated_delta_recurrent(q, k, v, g, beta, state):
    """Token-by-token gated delta rule (the decode form).

    q, k ``[B, T, Hk, dk]``, v ``[B, T, Hv, dv]``, g (log decay) and beta ``[B, T, Hv]``, state
    ``[B, Hv, dk, dv]`` fp32. Returns ``(o [B, T, Hv, dv] in q.dtype, final state fp32)``.
    A token with ``g = beta = 0`` leaves the state unchanged.
    """
    out_dtype = q.dtype
    q, k, v = _prep_qkv(q, k, v, v.shape[2])
    g, beta = g.astype(F32), beta.astype(F32)

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, Hv, d], [B, Hv]
        S = S * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.sum(S * k_t[..., :, None], axis=-2)
        delta = (v_t - kv_mem) * b_t[..., None]
        S = S + k_t[..., :, None] * delta[..., None, :]
        return S, jnp.sum(S * q_t[..., :, None], axis=-2)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    state, o = lax.scan(step, state.astype(F32), xs)
    return jnp.moveaxis(o, 0, 1).astype(out_dtype), state


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = GDN_CHUNK):
    """Chunked (WY/UT-transform) gated delta rule, the prefill form; same contract as the recurrent one.

    Mirrors transformers' ``torch_chunk_gated_delta_rule``: T is zero-padded to a multiple of ``chunk``
    (beta = g = 0 there, so the final state is exact), intra-chunk terms use the cumulative log decay
    from the chunk start, and a scan carries the state across chunks.
    """
    out_dtype = q.dtype
    B, T = q.shape[:2]
    q, k, v = _prep_qkv(q, k, v, v.shape[2])
    # -> [B, Hv, T, d] / [B, Hv, T]
    q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
    g, beta = (jnp.swapaxes(a.astype(F32), 1, 2) for a in (g, beta))
    pad = (-T) % chunk
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, 0), (0, pad))) for a in (g, beta))
    Hv, dv = v.shape[1], v.shape[-1]
    n = (T + pad) // chunk
    split = lambda a: a.reshape(a.shape[:2] + (n, chunk) + a.shape[3:])  # noqa: E731
    v_beta, k_beta = split(v * beta[..., None]), split(k * beta[..., None])
    q, k, g = split(q), split(k), split(g)

    gc = jnp.cumsum(g, axis=-1)  # [B, Hv, n, C] log decay since the chunk start
    upper = jnp.triu(jnp.ones((chunk, chunk), bool), 1)
    decay = jnp.exp(jnp.where(upper, -jnp.inf, gc[..., :, None] - gc[..., None, :]))
    ut = jnp.einsum("...id,...jd->...ij", k_beta, k, precision=_HI) * decay
    intra = jnp.einsum("...id,...jd->...ij", q, k, precision=_HI) * decay
    solve = lambda rhs: lax.linalg.triangular_solve(  # noqa: E731
        ut, rhs, left_side=True, lower=True, unit_diagonal=True)
    new_values = solve(v_beta)  # U = (I + L)^-1 (beta v)
    k_cumdecay = solve(k_beta * jnp.exp(gc)[..., None])  # W = (I + L)^-1 (beta exp(gc) k)
    q_dec = q * jnp.exp(gc)[..., None]
    k_dec = k * jnp.exp(gc[..., -1:] - gc)[..., None]
    chunk_decay = jnp.exp(gc[..., -1])[..., None, None]

    def step(S, xs):
        u, w, qd, kd, att, cd = xs
        v_new = u - jnp.einsum("...ik,...kv->...iv", w, S, precision=_HI)
        o = (jnp.einsum("...ik,...kv->...iv", qd, S, precision=_HI)
             + jnp.einsum("...ij,...jv->...iv", att, v_new, precision=_HI))
        S = S * cd + jnp.einsum("...ik,...iv->...kv", kd, v_new, precision=_HI)
        return S, o

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (new_values, k_cumdecay, q_dec, k_dec, intra, chunk_decay))
    state, o = lax.scan(step, state.astype(F32), xs)  # o [n, B, Hv, C, dv]
    o = jnp.moveaxis(o, 0, 2).reshape(B, Hv, n * chunk, dv)[:, :, :T]
    return jnp.swapaxes(o, 1, 2).astype(out_dtype), state


# ------------------------------------------------------------------------------------------------ MoE
def route(x: jax.Array, w_router: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax-over-all-experts (fp32) top-k router. Returns ``(ids [N, k] i32, weights [N, k] x.dtype)``."""
    logits = linear(x, w_router)
    probs = jax.nn.softmax(logits.astype(F32), axis=-1)
    weights, ids = lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights.astype(logits.dtype)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    return linear(jax.nn.silu(linear(x, w_gate)) * linear(x, w_up), w_down)


def shared_expert(x: jax.Array, p: dict) -> jax.Array:
    """Qwen3-Next/3.5 shared expert, scaled by its per-token sigmoid gate (model dtype)."""
    y = swiglu(x, p["shared_gate_proj"], p["shared_up_proj"], p["shared_down_proj"])
    return jax.nn.sigmoid(linear(x, p["shared_expert_gate"])) * y
