"""Logit fidelity against Hugging Face transformers on tiny random checkpoints.

The checkpoints and reference logits come from ``tools/make_reference.py`` (run with torch +
transformers); point ``FTJAX_REF_DIR`` at its output directory. Our model runs the 3 prompts as one
right-padded batch (prefill with all logits), then 8 decode steps fed with HF's greedy tokens.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.experts.resident import ResidentExperts
from ftjax.ftw import convert, load_store
from ftjax.ftw.hf import HFCheckpoint
from ftjax.models import get_family, make_step_fns

NAMES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text")
MAX_REL_ERR = 1e-4
REF_DIR = os.environ.get("FTJAX_REF_DIR")


def _skip_or_fail(reason: str):
    # CI sets FTJAX_REQUIRE_REFERENCE=1: there the fidelity tests must run, never skip.
    if os.environ.get("FTJAX_REQUIRE_REFERENCE") == "1":
        pytest.fail(reason + " (FTJAX_REQUIRE_REFERENCE=1)")
    pytest.skip(reason)


def _ref_dir() -> Path:
    if not REF_DIR:
        _skip_or_fail("FTJAX_REF_DIR is not set (run tools/make_reference.py OUT_DIR with torch+transformers, "
                    "then export FTJAX_REF_DIR=OUT_DIR)")
    path = Path(REF_DIR)
    if not all((path / n / "reference.npz").is_file() for n in NAMES):
        _skip_or_fail(f"FTJAX_REF_DIR={path} does not hold {NAMES} with reference.npz (run tools/make_reference.py)")
    return path


def load_model(ckpt_dir: Path, work_dir: Path):
    """(cfg, nested params, resident expert state): the HF checkpoint through ``ftjax convert`` (fp32)
    into an FTW store, then the store loader, as a user would run it."""
    store = convert(ckpt_dir, work_dir / "store", dtype="fp32", progress=False)
    m = load_store(store, verify="full")
    return m.config, m.params, ResidentExperts.init_state(m.experts)


def load_reference(ref: Path) -> dict:
    data = np.load(ref / "reference.npz")
    n = len(json.loads((ref / "meta.json").read_text())["prompt_lengths"])
    return {k: [data[f"{k}_{i}"] for i in range(n)]
            for k in ("prompt", "prefill_logits", "decode_tokens", "decode_logits")}


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def run_ours(cfg, params, experts, ref: dict, chunks: tuple[int, ...], backend) -> tuple[list, list]:
    """Prefill (in ``chunks`` of the padded prompt length) + decode with HF's tokens.

    Returns per-prompt prefill logits ``[n_i, V]`` and decode logits ``[steps, V]``.
    """
    experts = jax.tree_util.tree_map(jnp.copy, experts)  # the step functions donate their inputs
    prompts = ref["prompt"]
    B, T = len(prompts), max(len(p) for p in prompts)
    steps = len(ref["decode_tokens"][0])
    tokens = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    lens = np.array([len(p) for p in prompts])
    max_len = T + steps + 3
    state = get_family(cfg).init_state(cfg, B, max_len, jnp.float32)
    prefill_logits = [[] for _ in range(B)]
    start = 0
    for size in chunks:
        prefill, _ = make_step_fns(cfg, backend, B, size, max_len, all_logits=True)
        n_new = np.clip(lens - start, 0, size).astype(np.int32)
        chunk = np.zeros((B, size), np.int32)
        chunk[:, :min(size, T - start)] = tokens[:, start:start + size]
        logits, state, experts = prefill(params, experts, state, jnp.asarray(chunk), jnp.asarray(n_new))
        logits = np.asarray(logits)
        for b in range(B):
            prefill_logits[b].append(logits[b, :n_new[b]])
        start += size
    assert start >= T
    np.testing.assert_array_equal(np.asarray(state["lengths"]), lens)
    _, decode = make_step_fns(cfg, backend, B, 1, max_len)
    decode_logits = []
    ones = jnp.ones((B,), jnp.int32)
    for s in range(steps):
        tok = jnp.asarray([[int(ref["decode_tokens"][b][s])] for b in range(B)], jnp.int32)
        logits, state, experts = decode(params, experts, state, tok, ones)
        decode_logits.append(np.asarray(logits))
    return ([np.concatenate(p) for p in prefill_logits],
            [np.stack([d[b] for d in decode_logits]) for b in range(B)])


def check_against_reference(ours_prefill, ours_decode, ref: dict, label: str) -> float:
    """Max relative error over every prefill position and decode step; then greedy tokens must agree."""
    errs = []
    for b in range(len(ref["prompt"])):
        assert ours_prefill[b].shape == ref["prefill_logits"][b].shape, label
        errs += [rel_err(o, r) for o, r in zip(ours_prefill[b], ref["prefill_logits"][b])]
        errs += [rel_err(o, r) for o, r in zip(ours_decode[b], ref["decode_logits"][b])]
    worst = max(errs)
    print(f"{label}: max rel err {worst:.2e}")
    assert worst <= MAX_REL_ERR, f"{label}: max relative logit error {worst:.3e} > {MAX_REL_ERR}"
    for b in range(len(ref["prompt"])):
        np.testing.assert_array_equal(ours_prefill[b].argmax(-1), ref["prefill_logits"][b].argmax(-1),
                                      err_msg=f"{label} prompt {b}: prefill argmax differs")
        # decode step s is fed HF's token s and must predict HF's token s+1
        np.testing.assert_array_equal(ours_decode[b].argmax(-1), ref["decode_logits"][b].argmax(-1),
                                      err_msg=f"{label} prompt {b}: decode argmax differs")
        np.testing.assert_array_equal(ours_decode[b].argmax(-1)[:-1], ref["decode_tokens"][b][1:])
    return worst


@pytest.fixture(scope="module", params=NAMES)
def family_case(request, tmp_path_factory):
    ref_dir = _ref_dir() / request.param
    cfg, params, experts = load_model(ref_dir, tmp_path_factory.mktemp(request.param))
    return request.param, cfg, params, experts, load_reference(ref_dir)


@pytest.mark.parametrize("chunks", [(37,), (20, 20)], ids=["one_prefill", "two_chunks"])
def test_matches_hf(family_case, chunks):
    name, cfg, params, experts, ref = family_case
    backend = ResidentExperts(cfg.num_experts)
    pre, dec = run_ours(cfg, params, experts, ref, chunks, backend)
    check_against_reference(pre, dec, ref, f"{name} chunks={chunks}")


def test_expert_paths_agree(tmp_path):
    """Gather-only and ragged-only expert execution give the same logits (within fp32 rounding)."""
    name = "qwen3_next"
    cfg, params, experts = load_model(_ref_dir() / name, tmp_path)
    ref = load_reference(_ref_dir() / name)
    outs = {p: run_ours(cfg, params, experts, ref, (37,), ResidentExperts(cfg.num_experts, path=p))
            for p in ("gather", "ragged")}
    for b in range(len(ref["prompt"])):
        for i in range(2):
            a, r = outs["gather"][i][b], outs["ragged"][i][b]
            assert rel_err(a, r) <= 1e-5, f"{name}: expert paths differ"


def _rewrite_layout(src: Path, dst: Path) -> None:
    """Re-save a text checkpoint as a sharded multimodal one with fused experts plus vision/MTP tensors."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    ckpt = HFCheckpoint(src)
    cfg = ckpt.config
    tensors = {}
    for f in ckpt.files:  # the reference checkpoints are fp32, which numpy reads directly
        with safe_open(str(src / f), framework="numpy") as handle:
            tensors.update({k: handle.get_tensor(k) for k in handle.keys()})
    out = {}
    for name, arr in tensors.items():
        if ".mlp.experts." in name:
            continue
        out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = arr
    for layer in range(cfg.num_layers):
        ex = [ckpt.expert(layer, e) for e in range(cfg.num_experts)]
        p = f"model.language_model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = np.stack([x["gate_up"] for x in ex])
        out[p + "down_proj"] = np.stack([x["down"] for x in ex])
    out["model.visual.blocks.0.attn.qkv.weight"] = np.ones((6, 2), np.float32)
    out["mtp.layers.0.input_layernorm.weight"] = np.ones((cfg.hidden_size,), np.float32)
    dst.mkdir(parents=True)
    names = sorted(out)
    weight_map = {}
    for k in range(2):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        part = names[k::2]
        save_file({n: np.ascontiguousarray(out[n]) for n in part}, str(dst / fname))
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text = json.loads((src / "config.json").read_text())
    outer = {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 1},
             "tie_word_embeddings": text.get("tie_word_embeddings", False)}
    (dst / "config.json").write_text(json.dumps(outer))
    shutil.copy(src / "generation_config.json", dst / "generation_config.json")


def test_multimodal_sharded_fused_layout(tmp_path):
    """The same Qwen3.5 weights read from the outer multimodal, sharded, fused-expert layout match HF."""
    src = _ref_dir() / "qwen3_5_moe_text"
    dst = tmp_path / "mm"
    _rewrite_layout(src, dst)
    ckpt = HFCheckpoint(dst)
    assert ckpt.fused_experts and ckpt.config.model_type == "qwen3_5_moe"
    assert [p.name for p in ckpt.tokenizer_files] == ["generation_config.json"]
    cfg, params, experts = load_model(dst, tmp_path)
    ref = load_reference(src)
    pre, dec = run_ours(cfg, params, experts, ref, (37,), ResidentExperts(cfg.num_experts))
    check_against_reference(pre, dec, ref, "qwen3_5_moe multimodal layout")


def test_reader_errors_name_file_and_tensor(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from ftjax.ftw.hf import CheckpointError

    src = _ref_dir() / "qwen3_next"
    with safe_open(str(src / "model.safetensors"), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    (tmp_path / "missing").mkdir()
    shutil.copy(src / "config.json", tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if "layers.2.mlp.experts.5.up_proj" not in k},
              str(tmp_path / "missing" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.layers\.2\.mlp\.experts\.5\.up_proj"):
        HFCheckpoint(tmp_path / "missing")
    (tmp_path / "shape").mkdir()
    shutil.copy(src / "config.json", tmp_path / "shape")
    bad = dict(tensors)
    bad["model.layers.0.linear_attn.in_proj_ba.weight"] = bad["model.layers.0.linear_attn.in_proj_ba.weight"][:-1]
    save_file(bad, str(tmp_path / "shape" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.linear_attn\.in_proj_ba"):
        dict(HFCheckpoint(tmp_path / "shape").dense_tensors())
