"""Tiny Qwen3.5-MoE HF checkpoints for tests, written with numpy in HF naming.

``write_tiny_hf(dir, variant)`` writes one of VARIANTS and returns a ``TinyCheckpoint`` holding the
expected internal tensors (docs/internals.md names) and expert banks. Values are random but exactly
representable in bfloat16, so every variant converts to identical stores (bf16 or fp32).

Variants: "single" (one model.safetensors), "sharded" (3 shards + model.safetensors.index.json),
"fused" (experts as ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]),
"multimodal" (``model_type: qwen3_5_moe`` with ``text_config``, weights under
``model.language_model.``, plus ``model.visual.*`` tensors to skip), "bf16" (BF16 safetensors).
"""
from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

VARIANTS = ("single", "sharded", "fused", "multimodal", "bf16")
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_ST_NP = {v: np.dtype(ml_dtypes.bfloat16) if k == "bfloat16" else np.dtype(k) for k, v in _ST_DTYPES.items()}


@dataclasses.dataclass
class TinyCheckpoint:
    path: Path
    config: dict[str, Any]  # the text config (HF field names)
    dense: dict[str, np.ndarray]  # internal name -> float32
    gate_up: np.ndarray  # [L*E, 2I, H] float32
    down: np.ndarray  # [L*E, H, I] float32


def tiny_config(**overrides) -> dict[str, Any]:
    cfg = {
        "model_type": "qwen3_5_moe_text", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24, "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "layer_types": ["linear_attention", "full_attention"],
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "attn_output_gate": True,
        "tie_word_embeddings": False, "max_position_embeddings": 256, "eos_token_id": 3,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "dtype": "bfloat16",
    }
    cfg.update(overrides)
    return cfg


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(ml_dtypes.bfloat16).astype(np.float32)


def make_weights(cfg: dict[str, Any], seed: int = 0):
    """(dense {internal name: fp32}, gate_up [L*E,2I,H], down [L*E,H,I]) for a text config."""
    rng = np.random.default_rng(seed)
    H, V, L, E = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"], cfg["num_experts"]
    I, Is, hd = cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, K = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    conv = 2 * hk * dk + hv * dv
    d = {"embed": _rand(rng, V, H), "final_norm": _rand(rng, H), "lm_head": _rand(rng, V, H)}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"layers.{i}."
        d[p + "input_norm"], d[p + "post_attn_norm"] = _rand(rng, H), _rand(rng, H)
        if kind == "full_attention":
            shapes = {"q_proj": (2 * nh * hd, H), "k_proj": (nkv * hd, H), "v_proj": (nkv * hd, H),
                      "o_proj": (H, nh * hd), "q_norm": (hd,), "k_norm": (hd,)}
            d.update({f"{p}attn.{k}": _rand(rng, *s) for k, s in shapes.items()})
        else:
            shapes = {"in_proj_qkv": (conv, H), "in_proj_z": (hv * dv, H), "in_proj_b": (hv, H),
                      "in_proj_a": (hv, H), "conv1d": (conv, K), "dt_bias": (hv,), "A_log": (hv,),
                      "norm": (dv,), "out_proj": (H, hv * dv)}
            d.update({f"{p}gdn.{k}": _rand(rng, *s) for k, s in shapes.items()})
        shapes = {"router": (E, H), "shared_gate_proj": (Is, H), "shared_up_proj": (Is, H),
                  "shared_down_proj": (H, Is), "shared_expert_gate": (1, H)}
        d.update({f"{p}moe.{k}": _rand(rng, *s) for k, s in shapes.items()})
    return d, _rand(rng, L * E, 2 * I, H), _rand(rng, L * E, H, I)


_GDN = {"in_proj_qkv": "in_proj_qkv.weight", "in_proj_z": "in_proj_z.weight", "in_proj_b": "in_proj_b.weight",
        "in_proj_a": "in_proj_a.weight", "conv1d": "conv1d.weight", "dt_bias": "dt_bias", "A_log": "A_log",
        "norm": "norm.weight", "out_proj": "out_proj.weight"}
_MOE = {"router": "gate.weight", "shared_gate_proj": "shared_expert.gate_proj.weight",
        "shared_up_proj": "shared_expert.up_proj.weight", "shared_down_proj": "shared_expert.down_proj.weight",
        "shared_expert_gate": "shared_expert_gate.weight"}


def hf_name(name: str, prefix: str = "model.") -> str:
    """Internal non-expert name -> HF tensor name (prefix "model." or "model.language_model.")."""
    top = {"embed": prefix + "embed_tokens.weight", "final_norm": prefix + "norm.weight", "lm_head": "lm_head.weight"}
    if name in top:
        return top[name]
    _, i, *rest = name.split(".")
    p = f"{prefix}layers.{i}."
    if rest == ["input_norm"]:
        return p + "input_layernorm.weight"
    if rest == ["post_attn_norm"]:
        return p + "post_attention_layernorm.weight"
    group, leaf = rest
    if group == "attn":
        return f"{p}self_attn.{leaf}.weight"
    if group == "gdn":
        return f"{p}linear_attn.{_GDN[leaf]}"
    return f"{p}mlp.{_MOE[leaf]}"


def hf_tensors(cfg: dict[str, Any], dense, gate_up, down, *, fused: bool = False,
               prefix: str = "model.") -> dict[str, np.ndarray]:
    """All HF tensors of the checkpoint (fp32), in HF naming and layout."""
    E, I = cfg["num_experts"], cfg["moe_intermediate_size"]
    out = {}
    for name, x in dense.items():
        out[hf_name(name, prefix)] = x[:, None, :] if name.endswith("gdn.conv1d") else x
    for layer in range(cfg["num_hidden_layers"]):
        p = f"{prefix}layers.{layer}.mlp.experts."
        gu, dn = gate_up[layer * E:(layer + 1) * E], down[layer * E:(layer + 1) * E]
        if fused:
            out[p + "gate_up_proj"], out[p + "down_proj"] = gu, dn
            continue
        for e in range(E):
            out[f"{p}{e}.gate_proj.weight"] = gu[e, :I]
            out[f"{p}{e}.up_proj.weight"] = gu[e, I:]
            out[f"{p}{e}.down_proj.weight"] = dn[e]
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Minimal safetensors writer (the safetensors numpy API has no bfloat16)."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset, blobs = 0, []
    for name, x in tensors.items():
        blob = np.ascontiguousarray(x).tobytes()
        header[name] = {"dtype": _ST_DTYPES[x.dtype.name], "shape": list(x.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for blob in blobs:
            f.write(blob)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Minimal reader (memory-mapped), enough for tests and the HFCheckpoint stand-in."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    has_data = Path(path).stat().st_size > 8 + n
    data = np.memmap(path, np.uint8, mode="r", offset=8 + n) if has_data else np.zeros(0, np.uint8)
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        lo, hi = h["data_offsets"]
        out[name] = data[lo:hi].view(_ST_NP[h["dtype"]]).reshape(h["shape"])
    return out


def _write_extras(path: Path) -> None:
    (path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))


def write_tiny_hf(path: str | Path, variant: str = "single", seed: int = 0, **overrides) -> TinyCheckpoint:
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r} unknown; valid: {VARIANTS}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(**overrides)
    dense, gate_up, down = make_weights(cfg, seed)
    multimodal = variant == "multimodal"
    tensors = hf_tensors(cfg, dense, gate_up, down, fused=variant == "fused",
                         prefix="model.language_model." if multimodal else "model.")
    if variant == "bf16":
        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    if multimodal:
        rng = np.random.default_rng(seed + 1)
        tensors["model.visual.patch_embed.proj.weight"] = _rand(rng, 16, 3, 2, 2)
        tensors["model.visual.blocks.0.attn.qkv.weight"] = _rand(rng, 48, 16)
        tensors["model.visual.merger.linear_fc1.weight"] = _rand(rng, 32, 64)
        outer = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                 "text_config": cfg, "vision_config": {"depth": 1, "hidden_size": 16},
                 "tie_word_embeddings": False}
        (path / "config.json").write_text(json.dumps(outer, indent=1))
    else:
        (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3_5MoeForCausalLM"]}, indent=1))
    if variant == "sharded":
        names = list(tensors)
        parts = [names[k::3] for k in range(3)]
        weight_map = {}
        for k, part in enumerate(parts):
            fname = f"model-{k + 1:05d}-of-00003.safetensors"
            write_safetensors(path / fname, {n: tensors[n] for n in part})
            weight_map.update({n: fname for n in part})
        total = sum(t.nbytes for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    else:
        write_safetensors(path / "model.safetensors", tensors)
    _write_extras(path)
    return TinyCheckpoint(path=path, config=cfg, dense=dense, gate_up=gate_up, down=down)
