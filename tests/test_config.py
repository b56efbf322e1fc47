"""ModelConfig parsing: every supported flavour, and clear errors for what we cannot serve."""
import json

import pytest

from ftjax.config import ConfigError, ModelConfig, load_hf_config, parse_hf_config

QWEN35_TEXT = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25},
}


def test_qwen35_text_defaults_layer_types_from_interval():
    c = parse_hf_config(QWEN35_TEXT)
    assert c.family == "qwen3_5_moe" and c.flavour == "qwen3_5_moe"
    assert c.attention_layers == (3, 7)  # (i+1) % 4 == 0
    assert c.rotary_dim == 8 and c.rope_theta == 1e7
    assert c.gdn_conv_dim == 2 * 32 + 64 and c.zero_centered_norm and c.norm_topk_prob


def test_outer_multimodal_config_reads_text_config():
    outer = {"model_type": "qwen3_5_moe", "text_config": QWEN35_TEXT, "vision_config": {"depth": 2},
             "tie_word_embeddings": False}
    c = parse_hf_config(outer)
    assert c.model_type == "qwen3_5_moe" and c.hidden_size == 64


def test_qwen3_next_uses_interval_and_reads_norm_topk():
    raw = dict(QWEN35_TEXT, model_type="qwen3_next", full_attention_interval=2, norm_topk_prob=False)
    c = parse_hf_config(raw)
    assert c.flavour == "qwen3_next" and c.attention_layers == (1, 3, 5, 7) and not c.norm_topk_prob


def test_qwen3_moe():
    raw = {"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16, "rope_theta": 1e6,
           "norm_topk_prob": True, "eos_token_id": 7}
    c = parse_hf_config(raw)
    assert c.family == "qwen3_moe" and c.rotary_dim == 8 and not c.zero_centered_norm
    assert c.eos_token_ids == (7,) and c.layer_types == ("full_attention",) * 2


def test_round_trip_dict():
    c = parse_hf_config(QWEN35_TEXT)
    assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(model_type="llama"), "unknown model_type 'llama'"),
    (lambda d: d.pop("hidden_size"), "'hidden_size' is missing"),
    (lambda d: d.update(hidden_act="gelu"), "hidden_act 'gelu'"),
    (lambda d: d.update(num_experts_per_tok=9), "num_experts_per_tok 9"),
    (lambda d: d.update(layer_types=["full_attention"] * 3), "layer_types must list 8"),
    (lambda d: d.update(linear_num_value_heads=3), "multiple of linear_num_key_heads"),
    (lambda d: d.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "rope type 'yarn'"),
])
def test_bad_configs_name_the_problem(mutate, message):
    raw = json.loads(json.dumps(QWEN35_TEXT))
    mutate(raw)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_hf_config(raw)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hf_config(tmp_path)
