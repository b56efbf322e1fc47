"""Shared layers against plain numpy references, and the model-level padding/state contracts."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.config import parse_hf_config
from ftjax.experts.resident import ResidentExperts
from ftjax.models import get_family, layers as L, make_step_fns
from ftjax.models.params import expert_bank_shapes, flatten, param_shapes, unflatten


def rand(rng, *shape, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


# ------------------------------------------------------------------------------------ gated delta rule
def gdn_inputs(rng, B=2, T=37, hk=2, hv=4, dk=8, dv=8):
    q, k, v = rand(rng, B, T, hk, dk), rand(rng, B, T, hk, dk), rand(rng, B, T, hv, dv)
    g = -jnp.asarray(rng.uniform(0.01, 1.0, (B, T, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (B, T, hv)), jnp.float32)
    state = rand(rng, B, hv, dk, dv, scale=0.3)
    return q, k, v, g, beta, state


def np_delta_rule(q, k, v, g, beta, state):
    """Float64 recurrence straight from the definition (S_t = e^g (I - b k k^T) S + b k v^T, o = S^T q)."""
    q, k, v, g, beta, S = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, state))
    rep = v.shape[2] // q.shape[2]
    q, k = np.repeat(q, rep, 2), np.repeat(k, rep, 2)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(q.shape[-1])
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    S = S.copy()
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        S = S * np.exp(g[:, t])[..., None, None]
        u = np.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + np.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t][..., None] * (v[:, t] - u))
        out[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
    return out, S


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_and_recurrent_match_reference(chunk):
    rng = np.random.default_rng(0)
    args = gdn_inputs(rng)
    ref_o, ref_s = np_delta_rule(*args)
    for o, s in (L.gated_delta_chunked(*args, chunk=chunk), L.gated_delta_recurrent(*args)):
        np.testing.assert_allclose(o, ref_o, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(s, ref_s, rtol=1e-4, atol=1e-5)


def test_chunked_continuation_from_state():
    """20 tokens, then 17 more from the carried state (neither a multiple of the chunk) == all at once."""
    rng = np.random.default_rng(1)
    q, k, v, g, beta, state = gdn_inputs(rng)
    full_o, full_s = L.gated_delta_chunked(q, k, v, g, beta, state, chunk=16)
    part = lambda a, s: a[:, s]  # noqa: E731
    o1, s1 = L.gated_delta_chunked(*(part(a, slice(0, 20)) for a in (q, k, v, g, beta)), state, chunk=16)
    o2, s2 = L.gated_delta_chunked(*(part(a, slice(20, None)) for a in (q, k, v, g, beta)), s1, chunk=16)
    np.testing.assert_allclose(jnp.concatenate([o1, o2], 1), full_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s2, full_s, rtol=1e-4, atol=1e-5)
    # and token-by-token decode steps continue it identically
    o3, s3 = L.gated_delta_recurrent(*(part(a, slice(20, 21)) for a in (q, k, v, g, beta)), s1)
    np.testing.assert_allclose(o3[:, 0], full_o[:, 20], rtol=1e-4, atol=1e-5)


def test_zero_beta_and_decay_leave_state_untouched():
    rng = np.random.default_rng(2)
    q, k, v, g, beta, state = gdn_inputs(rng, T=5)
    for rule in (L.gated_delta_chunked, L.gated_delta_recurrent):
        _, s = rule(q, k, v, jnp.zeros_like(g), jnp.zeros_like(beta), state)
        np.testing.assert_array_equal(s, state)


# ------------------------------------------------------------------------------------------ conv1d
def np_conv(x, w, prefix):
    """Causal depthwise conv over ``[prefix ; x]`` (prefix = K-1 earlier inputs), SiLU, last T outputs."""
    full = np.concatenate([prefix, x], 0)
    K, T = w.shape[1], x.shape[0]
    y = np.stack([(full[t:t + K] * w.T).sum(0) for t in range(T)])
    return y / (1 + np.exp(-y))


def test_conv_rolling_state_and_padding():
    rng = np.random.default_rng(3)
    B, T, C, K = 3, 11, 6, 4
    x, w = rand(rng, B, T, C), rand(rng, C, K)
    n_new = jnp.asarray([11, 7, 2], jnp.int32)
    y, st = L.causal_conv1d(x, jnp.zeros((B, C, K - 1)), w, n_new)
    for b in range(B):
        n = int(n_new[b])
        np.testing.assert_allclose(y[b, :n], np_conv(np.asarray(x[b, :n]), np.asarray(w), np.zeros((K - 1, C))),
                                   rtol=1e-5, atol=1e-6)
        last = np.concatenate([np.zeros((K - 1, C)), np.asarray(x[b, :n])])[-(K - 1):]
        np.testing.assert_array_equal(np.asarray(st[b]).T, last)
    # continue: one chunk of 3 then single steps equal the conv over the whole valid sequence
    x2 = rand(rng, B, 5, C)
    y2, st2 = L.causal_conv1d(x2[:, :3], st, w, jnp.full((B,), 3, jnp.int32))
    outs = [y2]
    for t in range(3, 5):
        yt, st2 = L.causal_conv1d(x2[:, t:t + 1], st2, w, jnp.ones((B,), jnp.int32))
        outs.append(yt)
    got = jnp.concatenate(outs, 1)
    for b in range(B):
        n = int(n_new[b])
        whole = np.concatenate([np.asarray(x[b, :n]), np.asarray(x2[b])])
        ref = np_conv(whole, np.asarray(w), np.zeros((K - 1, C)))[n:]
        np.testing.assert_allclose(got[b], ref, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------------- rope, norms
def test_partial_rope_matches_rotate_half_reference():
    rng = np.random.default_rng(4)
    B, T, nh, hd, rd, theta = 2, 5, 3, 16, 8, 10000.0
    x = rand(rng, B, T, nh, hd)
    pos = jnp.asarray([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]], jnp.int32)
    cos, sin = L.rope_tables(pos, rd, theta, jnp.float32)
    got = L.apply_rope(x, cos, sin)
    inv = 1.0 / theta ** (np.arange(0, rd, 2) / rd)
    ang = np.asarray(pos)[..., None] * inv
    c, s = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    xr = np.asarray(x)
    x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:rd]
    ref = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, xr[..., rd:]], -1)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_norms():
    rng = np.random.default_rng(5)
    x, w, z = rand(rng, 4, 16), rand(rng, 16, scale=0.2), rand(rng, 4, 16)
    xn = np.asarray(x) / np.sqrt((np.asarray(x) ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(L.rms_norm(x, w, 1e-6), xn * np.asarray(w), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(L.rms_norm(x, w, 1e-6, zero_centred=True), xn * (1 + np.asarray(w)),
                               rtol=1e-5, atol=1e-6)
    zz = np.asarray(z)
    np.testing.assert_allclose(L.gated_rms_norm(x, z, w, 1e-6), xn * np.asarray(w) * zz / (1 + np.exp(-zz)),
                               rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------- attention
def test_attention_over_cache_with_padding_rows():
    rng = np.random.default_rng(6)
    B, S, T, nh, nkv, hd = 3, 12, 4, 4, 2, 8
    lengths = jnp.asarray([0, 5, 3], jnp.int32)
    n_new = jnp.asarray([4, 2, 0], jnp.int32)
    k_cache, v_cache = rand(rng, B, S, nkv, hd), rand(rng, B, S, nkv, hd)
    q, k, v = rand(rng, B, T, nh, hd), rand(rng, B, T, nkv, hd), rand(rng, B, T, nkv, hd)
    valid = jnp.arange(T)[None] < n_new[:, None]
    kc, vc = L.write_kv(k_cache, k, lengths, valid), L.write_kv(v_cache, v, lengths, valid)
    pos = lengths[:, None] + jnp.arange(T)[None]
    out = L.attend(q, kc, vc, pos, lengths + n_new, hd ** -0.5)
    for b in range(B):
        lo, n = int(lengths[b]), int(n_new[b])
        keep = np.ones(S, bool)
        keep[lo:lo + n] = False  # only the new slots change
        np.testing.assert_array_equal(np.asarray(kc[b])[keep], np.asarray(k_cache[b])[keep])
        np.testing.assert_array_equal(kc[b, lo:lo + n], k[b, :n])
        for t in range(n):
            for h in range(nh):
                g = h // (nh // nkv)
                kk, vv = np.asarray(kc[b, :lo + t + 1, g]), np.asarray(vc[b, :lo + t + 1, g])
                sc = kk @ np.asarray(q[b, t, h]) / np.sqrt(hd)
                p = np.exp(sc - sc.max())
                np.testing.assert_allclose(out[b, t, h], (p / p.sum()) @ vv, rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(out)).all()


# --------------------------------------------------------------------------------------- MoE pieces
def test_router_softmax_topk_renormalised():
    rng = np.random.default_rng(7)
    x, w = rand(rng, 6, 16), rand(rng, 8, 16)
    ids, wts = L.route(x, w, 3, True)
    logits = np.asarray(x) @ np.asarray(w).T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref_ids = np.argsort(-p, -1)[:, :3]
    np.testing.assert_array_equal(ids, ref_ids)
    ref_w = np.take_along_axis(p, ref_ids, -1)
    np.testing.assert_allclose(wts, ref_w / ref_w.sum(-1, keepdims=True), rtol=1e-5)
    _, raw = L.route(x, w, 3, False)
    np.testing.assert_allclose(raw, ref_w, rtol=1e-5)


def test_resident_paths_agree_with_numpy():
    rng = np.random.default_rng(8)
    Lyr, E, I, H, T, k = 2, 8, 12, 16, 10, 3
    st = {"gate_up": rand(rng, Lyr * E, 2 * I, H, scale=0.3), "down": rand(rng, Lyr * E, H, I, scale=0.3)}
    x = rand(rng, T, H)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)
    wts = jnp.asarray(rng.random((T, k)), jnp.float32)
    valid = jnp.arange(T) < 8
    ref = np.zeros((T, H))
    for t in range(8):
        for j in range(k):
            e = E + int(ids[t, j])
            h = np.asarray(st["gate_up"][e]) @ np.asarray(x[t])
            act = h[:I] / (1 + np.exp(-h[:I])) * h[I:]
            ref[t] += float(wts[t, j]) * (np.asarray(st["down"][e]) @ act)
    for path in ("gather", "ragged", "auto"):
        y, _ = jax.jit(lambda s, *a, p=path: ResidentExperts(E, path=p)(s, 1, *a))(st, x, ids, wts, valid)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5, err_msg=path)
    with pytest.raises(ValueError, match="path"):
        ResidentExperts(E, path="dense")


# ------------------------------------------------------------------------------------ params, model
HYBRID = {
    "model_type": "qwen3_5_moe_text", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "linear_conv_kernel_dim": 4,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "layer_types": ["linear_attention", "full_attention"],
}


def random_model(cfg, seed=0):
    rng = np.random.default_rng(seed)
    flat = {n: rand(rng, *s, scale=0.3) for n, s in param_shapes(cfg).items()}
    banks = {b: rand(rng, *s, scale=0.3) for b, s in expert_bank_shapes(cfg).items()}
    return unflatten(flat), banks


def test_param_names_roundtrip():
    cfg = parse_hf_config(HYBRID)
    shapes = param_shapes(cfg)
    assert shapes["layers.0.gdn.in_proj_qkv"] == (2 * 16 + 32, 32)
    assert shapes["layers.1.attn.q_proj"] == (2 * 4 * 8, 32)
    nested = unflatten(shapes)
    assert set(nested["layers"][0]) == {"input_norm", "post_attn_norm", "gdn", "moe"}
    assert flatten(nested) == shapes
    assert expert_bank_shapes(cfg) == {"gate_up": (8, 32, 32), "down": (8, 32, 16)}


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe_text"])
def test_padded_rows_match_single_rows_and_leave_state(model_type):
    """A right-padded batch row equals that row run alone; an n_new=0 row's state is untouched."""
    raw = dict(HYBRID, model_type=model_type)
    if model_type == "qwen3_moe":
        raw = {k: v for k, v in raw.items() if not k.startswith(("linear_", "shared_", "layer_types"))}
    cfg = parse_hf_config(raw)
    params, banks = random_model(cfg)
    backend = ResidentExperts(cfg.num_experts)
    fam = get_family(cfg)
    rng = np.random.default_rng(9)
    tokens = jnp.asarray(rng.integers(0, 64, (3, 6)), jnp.int32)
    n_new = jnp.asarray([6, 3, 0], jnp.int32)
    state = fam.init_state(cfg, 3, 16, jnp.float32)
    prefill, decode = make_step_fns(cfg, backend, 3, 6, 16)
    logits, state2, banks = prefill(params, banks, state, tokens, n_new)  # banks are donated
    alone = jax.jit(lambda *a: fam.forward(*a, cfg=cfg, backend=backend))
    for b in (0, 1):
        one = fam.init_state(cfg, 1, 16, jnp.float32)
        ref, one, _ = alone(params, banks, one, tokens[b:b + 1, :int(n_new[b])], n_new[b:b + 1])
        np.testing.assert_allclose(logits[b], ref[0], rtol=1e-5, atol=1e-5)
        for got, want in zip(jax.tree.leaves(state2["layers"]), jax.tree.leaves(one["layers"])):
            n = want.shape[1]  # KV: compare the written prefix; GDN: the whole state
            if got.ndim == 4 and got.shape[1] == 16:
                n = int(n_new[b])
            np.testing.assert_allclose(got[b, :n], want[0, :n], rtol=1e-5, atol=1e-5)
    for leaf in jax.tree.leaves(state2["layers"]):
        np.testing.assert_array_equal(leaf[2], 0.0)
    np.testing.assert_array_equal(state2["lengths"], [6, 3, 0])
    _, state3, banks = decode(params, banks, state2, tokens[:, :1], jnp.asarray([1, 1, 0], jnp.int32))
    np.testing.assert_array_equal(state3["lengths"], [7, 4, 0])
    with pytest.raises(ValueError, match="tokens shape"):
        decode(params, banks, state3, tokens[:, :2], jnp.ones((3,), jnp.int32))


def test_stable_io_decode_matches_and_keeps_its_buffers():
    """``stable_io``: the same logits and state as the plain decode step, step after step, with the
    logits written into one donated buffer (same device address every step; the previous step's
    array is deleted) and host numpy inputs accepted."""
    cfg = parse_hf_config(HYBRID)
    params, banks = random_model(cfg)
    backend = ResidentExperts(cfg.num_experts)
    fam = get_family(cfg)
    rng = np.random.default_rng(4)
    prompt = jnp.asarray(rng.integers(0, 64, (3, 6)), jnp.int32)
    prefill, decode = make_step_fns(cfg, backend, 3, 6, 16)
    _, stable = make_step_fns(cfg, backend, 3, 6, 16, stable_io=True)
    state = fam.init_state(cfg, 3, 16, jnp.float32)
    _, state, banks = prefill(params, banks, state, prompt, jnp.asarray([6, 4, 0], jnp.int32))
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
    s_ref, b_ref, s_st, b_st = copy(state), copy(banks), state, banks
    pointers, previous = set(), None
    for step in range(4):
        tok = rng.integers(0, 64, (3, 1)).astype(np.int32)
        n_new = np.array([1, 1 if step % 2 else 0, step % 2], np.int32)
        want, s_ref, b_ref = decode(params, b_ref, s_ref, jnp.asarray(tok), jnp.asarray(n_new))
        got, s_st, b_st = stable(params, b_st, s_st, tok, n_new)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
        for g, w in zip(jax.tree.leaves(s_st), jax.tree.leaves(s_ref)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
        pointers.add(got.unsafe_buffer_pointer())
        if previous is not None:
            assert previous.is_deleted()
        previous = got
    assert len(pointers) == 1, pointers
    assert stable.lower(params, b_st, s_st, tok, n_new).compile() is not None
    with pytest.raises(ValueError, match="tokens shape"):
        stable(params, b_st, s_st, np.zeros((3, 2), np.int32), n_new)
