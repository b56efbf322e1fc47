"""Internal parameter names and shapes (docs/internals.md, "Parameter names").

Flat names are dotted (``layers.3.attn.q_proj``); the nested form is what the model functions take:
``{"embed", "final_norm", "lm_head", "layers": [{"input_norm", "post_attn_norm", "attn"|"gdn": {...},
"moe": {...}}, ...]}``. Routed experts are not parameters: they live in the expert banks.
"""
from __future__ import annotations

from typing import Any, Mapping

from ftjax.config import ModelConfig

Shape = tuple[int, ...]


def _attn_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    H, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_out = nh * hd * (2 if cfg.attn_output_gate else 1)
    return {
        "q_proj": (q_out, H), "k_proj": (nkv * hd, H), "v_proj": (nkv * hd, H),
        "o_proj": (H, nh * hd), "q_norm": (hd,), "k_norm": (hd,),
    }


def _gdn_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    H, hv = cfg.hidden_size, cfg.linear_num_value_heads
    return {
        "in_proj_qkv": (cfg.gdn_conv_dim, H), "in_proj_z": (cfg.gdn_value_dim, H),
        "in_proj_b": (hv, H), "in_proj_a": (hv, H),
        "conv1d": (cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim),
        "dt_bias": (hv,), "A_log": (hv,), "norm": (cfg.linear_value_head_dim,),
        "out_proj": (H, cfg.gdn_value_dim),
    }


def _moe_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    H = cfg.hidden_size
    shapes = {"router": (cfg.num_experts, H)}
    if cfg.family == "qwen3_5_moe":
        Is = cfg.shared_expert_intermediate_size
        shapes.update(shared_gate_proj=(Is, H), shared_up_proj=(Is, H), shared_down_proj=(H, Is),
                      shared_expert_gate=(1, H))
    return shapes


def param_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    """Every non-expert parameter of ``cfg`` as ``{flat name: shape}``, in a stable order."""
    V, H = cfg.vocab_size, cfg.hidden_size
    out: dict[str, Shape] = {"embed": (V, H), "final_norm": (H,), "lm_head": (V, H)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        out[p + "input_norm"] = (H,)
        out[p + "post_attn_norm"] = (H,)
        mixer, shapes = ("attn", _attn_shapes(cfg)) if kind == "full_attention" else ("gdn", _gdn_shapes(cfg))
        out.update({f"{p}{mixer}.{k}": s for k, s in shapes.items()})
        out.update({f"{p}moe.{k}": s for k, s in _moe_shapes(cfg).items()})
    return out


def expert_bank_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    """Shapes of the routed-expert banks, indexed by the flat id ``l*E + e``."""
    n, H, I = cfg.num_flat_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return {"gate_up": (n, 2 * I, H), "down": (n, H, I)}


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"layers.0.attn.q_proj": a, ...}`` -> nested form; layers are a list indexed by layer."""
    nested: dict[str, Any] = {}
    layers: dict[int, dict[str, Any]] = {}
    for name, value in flat.items():
        parts = name.split(".")
        if parts[0] != "layers":
            if len(parts) != 1:
                raise KeyError(f"parameter name {name!r}: expected a top-level name or 'layers.<i>....'")
            nested[name] = value
            continue
        if len(parts) not in (3, 4) or not parts[1].isdigit():
            raise KeyError(f"parameter name {name!r}: expected 'layers.<i>.<name>' or 'layers.<i>.<group>.<name>'")
        layer = layers.setdefault(int(parts[1]), {})
        if len(parts) == 3:
            layer[parts[2]] = value
        else:
            layer.setdefault(parts[2], {})[parts[3]] = value
    if layers:
        missing = sorted(set(range(max(layers) + 1)) - set(layers))
        if missing:
            raise KeyError(f"parameters of layers {missing} are missing (have layers {sorted(layers)})")
        nested["layers"] = [layers[i] for i in range(len(layers))]
    return nested


def flatten(nested: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`unflatten`."""
    flat = {k: v for k, v in nested.items() if k != "layers"}
    for i, layer in enumerate(nested.get("layers", ())):
        for key, value in layer.items():
            if isinstance(value, Mapping):
                flat.update({f"layers.{i}.{key}.{k}": v for k, v in value.items()})
            else:
                flat[f"layers.{i}.{key}"] = value
    return flat
