"""Model configuration parsed from a Hugging Face ``config.json``.

One frozen dataclass describes every supported family; ``family`` selects the model file.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

FAMILIES = ("qwen3_moe", "qwen3_5_moe")
# HF model_type -> (our family, checkpoint flavour). The flavour decides tensor-name mapping.
MODEL_TYPES = {
    "qwen3_moe": ("qwen3_moe", "qwen3_moe"),
    "qwen3_next": ("qwen3_5_moe", "qwen3_next"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "qwen3_5_moe"),
    "qwen3_5_moe": ("qwen3_5_moe", "qwen3_5_moe"),  # outer multimodal config with text_config
}
LAYER_TYPES = ("full_attention", "linear_attention")


class ConfigError(ValueError):
    """A config.json that ftjax cannot serve, with the field and the accepted values."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "qwen3_moe" | "qwen3_5_moe"
    model_type: str  # the HF model_type as found (outer one for multimodal checkpoints)
    flavour: str  # "qwen3_moe" | "qwen3_next" | "qwen3_5_moe": checkpoint tensor layout
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    # qwen3_5_moe only (0 / False for qwen3_moe)
    shared_expert_intermediate_size: int = 0
    attn_output_gate: bool = False
    linear_conv_kernel_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    # ---- derived sizes ----
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def zero_centered_norm(self) -> bool:
        return self.family == "qwen3_5_moe"

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def num_flat_experts(self) -> int:
        """Size of the flat expert id space ``l*E + e``."""
        return self.num_layers * self.num_experts

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields {sorted(unknown)}")
        d = dict(d)
        d["layer_types"] = tuple(d["layer_types"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


def _need(cfg: dict, key: str, where: str):
    if key not in cfg:
        raise ConfigError(f"{where}: required field '{key}' is missing")
    return cfg[key]


def _rope(cfg: dict) -> tuple[float, float | None]:
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rp.get("rope_type", rp.get("type", "default")) not in ("default", "mrope"):
        raise ConfigError(
            f"rope type {rp.get('rope_type', rp.get('type'))!r} is not supported (supported: default)"
        )
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    prf = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    return float(theta), (None if prf is None else float(prf))


def parse_hf_config(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Parse an HF config dict; raise ConfigError naming the problem for anything unsupported."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"{where}: unknown model_type {model_type!r}; supported: {sorted(MODEL_TYPES)}"
        )
    family, flavour = MODEL_TYPES[model_type]
    cfg = raw
    if model_type == "qwen3_5_moe":
        cfg = raw.get("text_config")
        if not isinstance(cfg, dict):
            raise ConfigError(f"{where}: model_type 'qwen3_5_moe' needs a 'text_config' object")
        inner = cfg.get("model_type", "qwen3_5_moe_text")
        if inner != "qwen3_5_moe_text":
            raise ConfigError(f"{where}: text_config.model_type {inner!r}, expected 'qwen3_5_moe_text'")
    theta, prf = _rope(cfg)
    n_layers = int(_need(cfg, "num_hidden_layers", where))
    if family == "qwen3_moe":
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
            raise ConfigError(f"{where}: dense MLP layers (mlp_only_layers / decoder_sparse_step) are not supported")
        layer_types = ("full_attention",) * n_layers
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        extra: dict[str, Any] = {}
        prf = 1.0 if prf is None else prf
        n_exp = cfg.get("num_experts", cfg.get("num_local_experts"))
    else:
        if cfg.get("mlp_only_layers"):
            raise ConfigError(f"{where}: dense MLP layers (mlp_only_layers) are not supported")
        lt = cfg.get("layer_types")
        if lt is None:
            interval = int(cfg.get("full_attention_interval", 4))
            lt = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        if len(lt) != n_layers or any(t not in LAYER_TYPES for t in lt):
            raise ConfigError(f"{where}: layer_types must list {n_layers} entries from {LAYER_TYPES}, got {lt}")
        layer_types = tuple(lt)
        hd = int(cfg.get("head_dim", 256))
        prf = 0.25 if prf is None else prf
        n_exp = cfg.get("num_experts")
        extra = dict(
            shared_expert_intermediate_size=int(_need(cfg, "shared_expert_intermediate_size", where)),
            attn_output_gate=bool(cfg.get("attn_output_gate", True)),
            linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
            linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        )
        if extra["linear_num_value_heads"] % extra["linear_num_key_heads"]:
            raise ConfigError(f"{where}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    if n_exp is None:
        raise ConfigError(f"{where}: required field 'num_experts' is missing")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported (supported: silu)")
    if cfg.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true is not supported")
    eos = raw.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    # Qwen3.5 always renormalises top-k (the field was removed); Qwen3-Next and Qwen3-MoE read it.
    norm_topk = bool(cfg.get("norm_topk_prob", True)) if flavour != "qwen3_5_moe" else True
    mc = ModelConfig(
        family=family, model_type=model_type, flavour=flavour,
        vocab_size=int(_need(cfg, "vocab_size", where)),
        hidden_size=int(_need(cfg, "hidden_size", where)),
        num_layers=n_layers,
        num_heads=int(_need(cfg, "num_attention_heads", where)),
        num_kv_heads=int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])),
        head_dim=int(hd), rope_theta=theta, partial_rotary_factor=float(prf),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        num_experts=int(n_exp),
        num_experts_per_tok=int(_need(cfg, "num_experts_per_tok", where)),
        moe_intermediate_size=int(_need(cfg, "moe_intermediate_size", where)),
        norm_topk_prob=norm_topk,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        layer_types=layer_types,
        eos_token_ids=eos_ids,
        torch_dtype=str(cfg.get("dtype", cfg.get("torch_dtype", raw.get("dtype", "float32")))),
        **extra,
    )
    if mc.num_heads % mc.num_kv_heads:
        raise ConfigError(f"{where}: num_attention_heads {mc.num_heads} not a multiple of num_key_value_heads {mc.num_kv_heads}")
    if not 1 <= mc.num_experts_per_tok <= mc.num_experts:
        raise ConfigError(f"{where}: num_experts_per_tok {mc.num_experts_per_tok} must be in [1, {mc.num_experts}]")
    if mc.rotary_dim % 2:
        raise ConfigError(f"{where}: rotary dim {mc.rotary_dim} (head_dim*partial_rotary_factor) must be even")
    return mc


def load_hf_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"no config.json at {p}")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from e
    return parse_hf_config(raw, where=str(p))
