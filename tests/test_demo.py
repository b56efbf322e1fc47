"""The demo model: a real HF checkpoint + FTW store, built once, reused, rebuilt when damaged."""
import json
import time

import numpy as np
import pytest
from safetensors import safe_open

from ftjax.config import load_hf_config
from ftjax.demo import HF_NAME, STORE_NAME, DemoSpec, default_cache_dir, ensure_demo_model
from ftjax.demo_checkpoint import MARKUP_TOKENS, SPECIAL_TOKENS
from ftjax.ftw import load_store
from ftjax.tokenizer import Tokenizer

TINY = DemoSpec.tiny()


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("demo-cache")
    ensure_demo_model(cache, spec=TINY, progress=False)
    return cache


def test_builds_real_hf_checkpoint(tiny_cache):
    hf = tiny_cache / HF_NAME
    raw = json.loads((hf / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe_text"
    cfg = load_hf_config(hf)
    assert cfg.family == "qwen3_5_moe" and cfg.num_experts == TINY.num_experts
    assert cfg.layer_types[3] == "full_attention" and cfg.layer_types[0] == "linear_attention"
    assert cfg.vocab_size % 64 == 0
    with safe_open(str(hf / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.0.linear_attn.conv1d.weight").get_shape()[1] == 1
        q = f.get_slice("model.layers.3.self_attn.q_proj.weight").get_shape()
    assert q == [2 * TINY.num_heads * TINY.head_dim, TINY.hidden_size]
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.A_log",
                 "model.layers.3.self_attn.q_norm.weight", "model.layers.1.mlp.experts.7.down_proj.weight",
                 "model.layers.1.mlp.shared_expert_gate.weight", "model.layers.2.mlp.gate.weight"):
        assert name in keys, name
    assert (hf / "generation_config.json").is_file() and (hf / "tokenizer_config.json").is_file()


def test_store_loads_with_tokenizer_and_nondegenerate_weights(tiny_cache):
    store = tiny_cache / STORE_NAME
    m = load_store(store, device=False)
    tok = Tokenizer.from_dir(store)
    assert tok.vocab_size <= m.config.vocab_size
    for t in SPECIAL_TOKENS + MARKUP_TOKENS:
        assert len(tok.encode(t)) == 1
    assert tok.token_id("<|im_end|>") in tok.eos_token_ids
    embed = np.asarray(m.params["embed"], np.float32)
    assert np.isfinite(embed).all() and embed.std() > 0.1
    gate_up = np.asarray(m.experts["gate_up"][:4], np.float32)
    assert 0.005 < gate_up.std() < 0.1


def test_second_call_reuses(tiny_cache):
    store = tiny_cache / STORE_NAME
    before = (store / "ftw.json").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert ensure_demo_model(tiny_cache, spec=TINY, progress=False) == store
    assert time.perf_counter() - t0 < 5
    assert (store / "ftw.json").stat().st_mtime_ns == before


def test_damaged_or_other_spec_is_rebuilt(tmp_path):
    store = ensure_demo_model(tmp_path, spec=TINY, progress=False)
    victim = next(p for p in (store / "experts").rglob("*") if p.is_file() and p.stat().st_size > 1000)
    victim.write_bytes(b"\0" * victim.stat().st_size)  # a corrupt expert chunk
    before = (store / "ftw.json").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path, spec=TINY, progress=False) == store
    assert (store / "ftw.json").stat().st_mtime_ns != before
    load_store(store, device=False, verify="full")
    (store / "ftw.json").unlink()  # a partial store
    ensure_demo_model(tmp_path, spec=TINY, progress=False)
    load_store(store, device=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".demo-build")]


def test_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FTJAX_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("FTJAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "ftjax"


def test_default_demo_model(tmp_path):
    """The real default config (~240 MB): builds in well under a minute on a laptop CPU."""
    t0 = time.perf_counter()
    store = ensure_demo_model(tmp_path, progress=False)
    assert time.perf_counter() - t0 < 60
    cfg = load_store(store, device=False).config
    assert (cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size) == (8, 64, 4, 512)
    assert cfg.attention_layers == (3, 7)
    assert cfg.shared_expert_intermediate_size > 0 and cfg.head_dim == 128
    tok = Tokenizer.from_dir(store)
    assert 4000 <= tok.vocab_size <= cfg.vocab_size < tok.vocab_size + 64
