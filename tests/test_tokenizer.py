"""Tokenizer: the real Qwen3 tokenizer (if present) and the demo tokenizer; chat templates; streaming."""
import json
from pathlib import Path

import pytest

from ftjax.demo_checkpoint import MARKUP_TOKENS, SPECIAL_TOKENS, DemoSpec, train_tokenizer, write_tokenizer_files
from ftjax.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

QWEN_DIR = Path("/work/shared/data/qwen3-tokenizer")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": '{"temp_c": 21}'},
    {"role": "assistant", "content": "It is 21 °C."},
    {"role": "user", "content": "Thanks!"},
]
TOOLS_JSON = json.dumps(TOOLS[0], ensure_ascii=False)
# The rendering the Qwen3 template defines (tools in the system turn, JSON tool call, the tool result
# inside a user turn, generation prompt).
QWEN_EXPECTED = (
    "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + TOOLS_JSON +
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\n"
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n{\"temp_c\": 21}\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nIt is 21 °C.<|im_end|>\n"
    "<|im_start|>user\nThanks!<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def qwen():
    if not (QWEN_DIR / "tokenizer.json").is_file():
        pytest.skip(f"Qwen3 tokenizer not present at {QWEN_DIR}")
    return Tokenizer.from_dir(QWEN_DIR)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo-tok")
    write_tokenizer_files(d, train_tokenizer(DemoSpec.tiny()))
    return d


@pytest.fixture(scope="module")
def demo(demo_dir):
    return Tokenizer.from_dir(demo_dir)


def _stream(tok: Tokenizer, ids):
    detok = tok.detokenizer()
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


# ---- Qwen3 ----
def test_qwen_special_ids(qwen):
    assert qwen.token_id("<|im_start|>") == 151644
    assert qwen.token_id("<|im_end|>") == 151645
    assert qwen.token_id("<think>") == 151667
    assert qwen.token_id("<tool_call>") == 151657
    assert qwen.added_token_ids()["</think>"] == 151668
    assert qwen.eos_token_ids == (151645,)
    assert qwen.vocab_size == 151669
    assert qwen.encode("<|im_start|>user\nhi<|im_end|>")[0] == 151644


def test_qwen_chat_template_with_tool_call(qwen):
    assert qwen.apply_chat_template(CONVERSATION, tools=TOOLS) == QWEN_EXPECTED


def test_qwen_chat_template_thinking_switch(qwen):
    msgs = [{"role": "user", "content": "hi"}]
    assert qwen.apply_chat_template(msgs).endswith("<|im_start|>assistant\n")
    assert qwen.apply_chat_template(msgs, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not qwen.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")


def test_qwen_streaming_multibyte(qwen):
    text = "naïve café: 世界 🎉🎉 ok"
    ids = qwen.encode(text)
    deltas = _stream(qwen, ids)
    assert "".join(deltas) == text == qwen.decode(ids)
    assert all("\ufffd" not in d for d in deltas)  # a split character is held back, never emitted broken


# ---- demo tokenizer ----
def test_demo_special_tokens_are_single_ids(demo):
    ids = {t: demo.token_id(t) for t in SPECIAL_TOKENS + MARKUP_TOKENS}
    assert len(set(ids.values())) == len(ids)
    assert min(ids.values()) >= demo.vocab_size - len(ids)  # added after the BPE vocabulary, like Qwen
    for t, i in ids.items():
        assert demo.encode(f"x{t}y")[1:-1] == [i] or i in demo.encode(f"x{t}y")
    assert demo.eos_token_ids[0] == ids["<|im_end|>"]
    assert ids["<|endoftext|>"] in demo.eos_token_ids


def test_demo_roundtrip_and_streaming(demo):
    text = "The lighthouse keeper's daughter counted 112 steps.\n\nZürich — 21 °C, 世界 🎉"
    ids = demo.encode(text)
    assert demo.decode(ids) == text
    deltas = _stream(demo, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas)  # bytes of a multi-byte char arrive as separate tokens


def test_demo_chat_template(demo):
    out = demo.apply_chat_template([{"role": "system", "content": "Be brief."}] + CONVERSATION, tools=TOOLS,
                                   enable_thinking=False)
    assert out.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert TOOLS_JSON in out
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
            "</tool_call><|im_end|>\n") in out
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>\n' in out
    assert out.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = demo.apply_chat_template([{"role": "user", "content": "hi"}])
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = demo.encode(plain)
    assert ids[0] == demo.token_id("<|im_start|>") and demo.token_id("<|im_end|>") in ids


def test_demo_chat_template_reasoning_only_after_last_user(demo):
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nold\n</think>\n\nA"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "B", "reasoning_content": "new"}]
    out = demo.apply_chat_template(msgs, add_generation_prompt=False)
    assert "old" not in out
    assert out.endswith("<|im_start|>assistant\n<think>\nnew\n</think>\n\nB<|im_end|>\n")


def test_unknown_role_raises(demo):
    with pytest.raises(ChatTemplateError, match="unknown message role: robot"):
        demo.apply_chat_template([{"role": "robot", "content": "x"}])


# ---- loading variants ----
def _copy(src: Path, dst: Path, config_patch: dict | None = None) -> Path:
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.update(config_patch or {})
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_named_templates_and_jinja_file(demo_dir, tmp_path):
    d = _copy(demo_dir, tmp_path / "named", {"chat_template": [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"}]})
    tok = Tokenizer.from_dir(d)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "Dx"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=TOOLS) == "T1"
    d2 = _copy(demo_dir, tmp_path / "jinja", {"chat_template": None})
    (d2 / "chat_template.jinja").write_text("J{{ messages | length }}{{ raise_exception('boom') if x }}")
    assert Tokenizer.from_dir(d2).apply_chat_template([{"role": "user", "content": "x"}]) == "J1"
    with pytest.raises(ChatTemplateError, match="boom"):
        Tokenizer.from_dir(d2).apply_chat_template([{"role": "user", "content": "x"}], x=True)


def test_missing_files_and_template(tmp_path, demo_dir):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    d = _copy(demo_dir, tmp_path / "notemplate", {"chat_template": None})
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(KeyError, match="not a single token"):
        Tokenizer.from_dir(d).token_id("<|not_a_token|>")
