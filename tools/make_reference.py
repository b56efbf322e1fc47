"""Build tiny random HF reference checkpoints and their logits for ftjax's fidelity tests.

Run with the reference environment (torch + transformers 5.x):

    python tools/make_reference.py OUT_DIR

For each family (qwen3_moe, qwen3_next, qwen3_5_moe_text) it writes ``OUT_DIR/<name>/`` with the
``save_pretrained`` checkpoint, ``reference.npz`` (3 prompts run alone through HF with its cache:
prefill logits at every position, then 8 greedy decode steps) and ``meta.json``. Before saving the
outputs it checks that HF's cached greedy decode equals a full re-forward of the whole sequence.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

PROMPT_LENGTHS = (37, 30, 23)
DECODE_STEPS = 8
VOCAB = 256
SANITY_RTOL = 1e-4

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=48, norm_topk_prob=True, hidden_act="silu", attention_bias=False,
    pad_token_id=None, bos_token_id=None, eos_token_id=None,
)
_HYBRID = dict(
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    shared_expert_intermediate_size=40, linear_conv_kernel_dim=4, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
)


def build_configs() -> dict[str, tuple[type, object]]:
    qwen3_moe = Qwen3MoeConfig(
        **_COMMON, intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    qwen3_next = Qwen3NextConfig(
        **_COMMON, **_HYBRID, intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    common = {k: v for k, v in _COMMON.items() if k != "norm_topk_prob"}
    qwen3_5 = Qwen3_5MoeTextConfig(
        **common, **_HYBRID, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [4, 2, 2], "mrope_interleaved": True},
    )
    return {
        "qwen3_moe": (Qwen3MoeForCausalLM, qwen3_moe),
        "qwen3_next": (Qwen3NextForCausalLM, qwen3_next),
        "qwen3_5_moe_text": (Qwen3_5MoeForCausalLM, qwen3_5),
    }


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter at a scale that gives non-degenerate logits and decisive routing."""
    gen = torch.Generator().manual_seed(seed)
    zero_centred = "qwen3_next" in type(model).__module__ or "qwen3_5" in type(model).__module__
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("embed_tokens.weight"):
                v = 0.5 * r  # small enough that a tied lm_head does not just echo the input token
            elif name.endswith("A_log"):
                # Moderate decays (A in [0.02, 1]) keep a real memory over the prompt and keep the
                # chunked form's cumulative log-decays small enough for fp32 to compare at 1e-4.
                v = torch.log(torch.rand(p.shape, generator=gen) * 0.98 + 0.02)
            elif name.endswith("dt_bias"):
                v = 0.5 * r
            elif name.endswith("linear_attn.norm.weight"):
                v = 1.0 + 0.2 * r  # gated norm: plain weight
            elif "norm" in name:
                v = 0.2 * r if zero_centred else 1.0 + 0.2 * r
            elif name.endswith("conv1d.weight"):
                v = r / p.shape[-1] ** 0.5
            elif name.endswith("mlp.gate.weight"):
                v = 3.0 * r / p.shape[-1] ** 0.5
            elif name.endswith("lm_head.weight"):
                v = 0.4 * r
            else:  # [.., out, in] linear weights, incl. fused expert banks
                v = r / p.shape[-1] ** 0.5
            p.copy_(v.to(p.dtype))


def run_prompt(model, ids: torch.Tensor) -> dict[str, np.ndarray]:
    """Prefill one prompt with HF's cache, then greedy-decode through the cache."""
    with torch.no_grad():
        out = model(input_ids=ids[None], use_cache=True)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        prefill = out.logits[0].float().numpy()
        tok = int(prefill[-1].argmax())
        seq = ids.tolist()
        tokens, logits = [], []
        for _ in range(DECODE_STEPS):
            seq.append(tok)
            tokens.append(tok)
            out = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True)
            cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
            step = out.logits[0, -1].float().numpy()
            logits.append(step)
            tok = int(step.argmax())
        # Sanity: the cached path must equal a full re-forward of the whole sequence.
        full = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float().numpy()
    n = len(ids)
    check = np.concatenate([prefill, np.stack(logits)])
    ref = full[: n + DECODE_STEPS]
    err = float(np.abs(check - ref).max() / np.abs(ref).max())
    if err > SANITY_RTOL:
        raise RuntimeError(f"HF cached decode differs from a full re-forward: max rel err {err:.3e}")
    return {"prefill_logits": prefill, "decode_tokens": np.array(tokens, np.int32),
            "decode_logits": np.stack(logits), "sanity_err": np.float64(err)}


def make_one(name: str, cls, config, out: Path, seed: int) -> dict:
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = cls(config).eval().to(torch.float32)
    randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d)
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    errs = []
    for i, n in enumerate(PROMPT_LENGTHS):
        ids = rng.integers(0, VOCAB, size=n)
        res = run_prompt(model, torch.tensor(ids, dtype=torch.long))
        arrays[f"prompt_{i}"] = ids.astype(np.int32)
        for k, v in res.items():
            if k == "sanity_err":
                errs.append(float(v))
            else:
                arrays[f"{k}_{i}"] = v
    np.savez(d / "reference.npz", **arrays)
    meta = {
        "name": name, "model_type": config.model_type, "seed": seed, "prompt_lengths": list(PROMPT_LENGTHS),
        "decode_steps": DECODE_STEPS, "dtype": "float32", "attn_implementation": "eager",
        "transformers": transformers.__version__, "torch": torch.__version__,
        "sanity_cached_vs_full_rel_err": errs,
    }
    (d / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    for seed, (name, (cls, config)) in enumerate(build_configs().items(), start=1234):
        t0 = time.time()
        meta = make_one(name, cls, config, out, seed)
        print(f"{name}: {time.time() - t0:.1f}s, sanity rel err {max(meta['sanity_cached_vs_full_rel_err']):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
