"""Writes the demo model as a real Hugging Face checkpoint (``qwen3_5_moe_text``).

The tokenizer is a byte-level BPE trained by ``tokenizers`` on ``ftjax/data/corpus.txt`` with the
Qwen pre-tokenizer and special tokens. The weights are seeded random, with one twist so the demo
prints English-looking text: the embedding and ``lm_head`` encode the corpus' bigram statistics
(the residual stream is dominated by the current token's embedding; the random attention, Gated
DeltaNet and MoE layers perturb it), and one embedding coordinate is constant so the matching
``lm_head`` column acts as a per-token bias (log unigram frequency; padding ids never win).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import struct
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import ml_dtypes
import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tqdm import tqdm

from ftjax.data import corpus_text

log = logging.getLogger(__name__)

# The Qwen2/Qwen3 pre-tokenizer regex (tokenizer.json of the Qwen3 family).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # "special": skipped by skip_special_tokens
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
BIGRAM_WEIGHT = 4.0  # r in log(1 + r P(b|a) / u(b)): how much a seen pair beats the unigram prior
UNIGRAM_WEIGHT = 0.05  # a weak prior: the full log u(b) would let "," and " the" win after every token
NEVER_LOGIT = -30.0  # padding ids and tokens absent from the corpus

# A Qwen3-style ChatML template (written for ftjax): system + tools block, <think> reasoning shown only
# after the last user turn, JSON tool calls, tool results grouped into one user turn.
CHAT_TEMPLATE = r"""{%- if messages and messages[0].role == 'system' %}
    {%- set system_text = messages[0].content %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set system_text = '' %}
    {%- set rest = messages %}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if system_text %}{{- system_text + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou can call the functions whose JSON signatures are listed inside <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nTo call one, answer with its name and arguments as JSON inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif system_text %}
    {{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' }}
{%- endif %}
{%- set state = namespace(last_user=-1) %}
{%- for m in rest %}
    {%- if m.role == 'user' %}{%- set state.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for m in rest %}
    {%- if m.role == 'user' or m.role == 'system' %}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set answer = m.content or '' %}
        {%- set thought = m.reasoning_content or '' %}
        {%- if not thought and '</think>' in answer %}
            {%- set thought = answer.split('</think>')[0].split('<think>')[-1] %}
            {%- set answer = answer.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > state.last_user and (thought or loop.last) %}
            {{- '<think>\n' + thought.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- answer }}
        {%- for call in m.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if answer or not loop.first %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' }}
            {%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
        {%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('unknown message role: ' + m.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""


@dataclasses.dataclass(frozen=True)
class DemoSpec:
    """Sizes of the synthetic demo model (defaults: ~120 M parameters, ~240 MB in bf16)."""
    num_layers: int = 8
    full_attention_interval: int = 4
    num_experts: int = 64
    num_experts_per_tok: int = 4
    hidden_size: int = 512
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 128
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    tokenizer_vocab: int = 4096  # BPE target including the added tokens (the corpus may give fewer)
    max_position_embeddings: int = 32768
    seed: int = 0

    @classmethod
    def tiny(cls) -> "DemoSpec":
        """A few-MB variant for tests."""
        return cls(num_layers=4, num_experts=8, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32, num_heads=4, num_kv_heads=2, head_dim=32,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=16, tokenizer_vocab=1024)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def train_tokenizer(spec: DemoSpec) -> tokenizers.Tokenizer:
    """Byte-level BPE with the Qwen pre-tokenizer; the added tokens get the last ids, as in Qwen."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False)
    n_added = len(SPECIAL_TOKENS) + len(MARKUP_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=spec.tokenizer_vocab - n_added, min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tok


def hf_config(spec: DemoSpec, vocab_size: int, eos_id: int) -> dict[str, Any]:
    layer_types = ["full_attention" if (i + 1) % spec.full_attention_interval == 0 else "linear_attention"
                   for i in range(spec.num_layers)]
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab_size, "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "layer_types": layer_types, "full_attention_interval": spec.full_attention_interval,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "attn_output_gate": True, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": spec.max_position_embeddings, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "num_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "shared_expert_intermediate_size": spec.shared_expert_intermediate_size,
        "linear_conv_kernel_dim": spec.linear_conv_kernel_dim,
        "linear_num_key_heads": spec.linear_num_key_heads, "linear_num_value_heads": spec.linear_num_value_heads,
        "linear_key_head_dim": spec.linear_head_dim, "linear_value_head_dim": spec.linear_head_dim,
        "tie_word_embeddings": False, "eos_token_id": eos_id, "dtype": "bfloat16",
    }


def write_tokenizer_files(out: Path, tok: tokenizers.Tokenizer) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": t in SPECIAL_TOKENS}
             for t in SPECIAL_TOKENS + MARKUP_TOKENS}
    tcfg = {"tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, "add_prefix_space": False,
            "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
            "errors": "replace", "clean_up_tokenization_spaces": False, "split_special_tokens": False,
            "model_max_length": 32768, "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n")
    gen = {"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
           "pad_token_id": tok.token_to_id("<|endoftext|>"), "do_sample": True,
           "temperature": 0.7, "top_k": 20, "top_p": 0.8}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


# ---- weights ----
Init = Callable[[np.random.Generator], np.ndarray]


def _normal(shape: tuple[int, ...], std: float) -> Init:
    return lambda rng: rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def _const(shape: tuple[int, ...], value: float) -> Init:
    return lambda rng: np.full(shape, value, np.float32)


def _bigram_embeddings(tok: tokenizers.Tokenizer, vocab: int, hidden: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """embed [V,H] and lm_head [V,H] with lm_head @ rmsnorm(embed[a]) scoring the tokens that follow a.

    The target is w log u(b) + log(1 + r P(b|a) / u(b)) (a weak unigram prior plus a PMI-like bigram
    score). The first term goes into the constant coordinate; the second is sparse (seen pairs) and is
    stored as lm_head[b] = sum_a M[a, b] d_a over token directions d_a, orthonormal for the H-1 most
    frequent tokens (exact there) and random unit vectors for the rest (approximate).
    """
    rng = np.random.default_rng([seed, 1])
    ids = np.asarray(tok.encode(corpus_text()).ids, np.int64)
    d = rng.standard_normal((vocab, hidden - 1)).astype(np.float32)
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    freq = np.bincount(ids, minlength=vocab)
    frequent = np.argsort(-freq, kind="stable")[:hidden - 1]
    d[frequent] = np.eye(hidden - 1, dtype=np.float32)[:len(frequent)]
    # rms 1 rows: rmsnorm leaves them as they are; the last coordinate is the constant 1.
    embed = np.concatenate([d * np.sqrt(hidden - 1), np.ones((vocab, 1), np.float32)], axis=1)
    pairs, counts = np.unique(np.stack([ids[:-1], ids[1:]], axis=1), axis=0, return_counts=True)
    unigram = freq / len(ids)
    p_next = counts / np.bincount(ids[:-1], minlength=vocab)[pairs[:, 0]]
    m = np.log1p(BIGRAM_WEIGHT * p_next / unigram[pairs[:, 1]]).astype(np.float32)
    head = np.zeros((vocab, hidden), np.float32)
    np.add.at(head[:, :-1], pairs[:, 1], m[:, None] * d[pairs[:, 0]] / np.sqrt(hidden - 1))
    head[:, -1] = np.where(freq > 0, UNIGRAM_WEIGHT * np.log(np.maximum(unigram, 1e-12)), NEVER_LOGIT)
    return embed, head


def weight_inits(spec: DemoSpec, cfg: dict[str, Any], tok: tokenizers.Tokenizer) -> Iterator[tuple[str, tuple, Init]]:
    """(HF name, shape, init) in checkpoint order. Input projections std 0.02; output projections
    smaller so the embedding dominates the residual stream; zero-centred norms near 0."""
    H, V = spec.hidden_size, cfg["vocab_size"]
    w_in, w_out, w_norm = 0.02, 0.004, 0.02  # norms are zero-centred: (1 + w) ~ 1
    embed, head = _bigram_embeddings(tok, V, H, spec.seed)
    yield "model.embed_tokens.weight", (V, H), lambda rng: embed
    hd, nh, nkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    hk, hv, dh, K = spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_head_dim, spec.linear_conv_kernel_dim
    conv_dim = 2 * hk * dh + hv * dh
    I, Is, E = spec.moe_intermediate_size, spec.shared_expert_intermediate_size, spec.num_experts
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (H,), _normal((H,), w_norm)
        if kind == "full_attention":
            a = p + "self_attn."
            yield a + "q_proj.weight", (2 * nh * hd, H), _normal((2 * nh * hd, H), w_in)
            yield a + "k_proj.weight", (nkv * hd, H), _normal((nkv * hd, H), w_in)
            yield a + "v_proj.weight", (nkv * hd, H), _normal((nkv * hd, H), w_in)
            yield a + "o_proj.weight", (H, nh * hd), _normal((H, nh * hd), w_out)
            yield a + "q_norm.weight", (hd,), _normal((hd,), w_norm)
            yield a + "k_norm.weight", (hd,), _normal((hd,), w_norm)
        else:
            g = p + "linear_attn."
            yield g + "in_proj_qkv.weight", (conv_dim, H), _normal((conv_dim, H), w_in)
            yield g + "in_proj_z.weight", (hv * dh, H), _normal((hv * dh, H), w_in)
            yield g + "in_proj_b.weight", (hv, H), _normal((hv, H), w_in)
            yield g + "in_proj_a.weight", (hv, H), _normal((hv, H), w_in)
            yield g + "conv1d.weight", (conv_dim, 1, K), _normal((conv_dim, 1, K), 1.0 / np.sqrt(K))
            yield g + "dt_bias", (hv,), _const((hv,), 1.0)
            yield g + "A_log", (hv,), lambda rng: np.log(rng.uniform(1.0, 16.0, hv)).astype(np.float32)
            yield g + "norm.weight", (dh,), _const((dh,), 1.0)  # gated norm: plain weight, not 1+w
            yield g + "out_proj.weight", (H, hv * dh), _normal((H, hv * dh), w_out)
        yield p + "post_attention_layernorm.weight", (H,), _normal((H,), w_norm)
        m = p + "mlp."
        yield m + "gate.weight", (E, H), _normal((E, H), w_in)
        for e in range(E):
            yield f"{m}experts.{e}.gate_proj.weight", (I, H), _normal((I, H), w_in)
            yield f"{m}experts.{e}.up_proj.weight", (I, H), _normal((I, H), w_in)
            yield f"{m}experts.{e}.down_proj.weight", (H, I), _normal((H, I), w_out)
        yield m + "shared_expert.gate_proj.weight", (Is, H), _normal((Is, H), w_in)
        yield m + "shared_expert.up_proj.weight", (Is, H), _normal((Is, H), w_in)
        yield m + "shared_expert.down_proj.weight", (H, Is), _normal((H, Is), w_out)
        yield m + "shared_expert_gate.weight", (1, H), _normal((1, H), w_in)
    yield "model.norm.weight", (H,), _normal((H,), w_norm)
    yield "lm_head.weight", (V, H), lambda rng: head


def write_safetensors(path: Path, entries: list[tuple[str, tuple, Init]], seed: int, progress: bool) -> int:
    """Stream bf16 tensors into one safetensors file (header first, then each tensor as generated)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        nbytes = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f, tqdm(total=offset, unit="B", unit_scale=True, desc="demo weights",
                                      disable=not progress, dynamic_ncols=True) as bar:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape, init in entries:
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])  # independent of tensor order
            x = np.ascontiguousarray(init(rng), dtype=np.float32).astype(ml_dtypes.bfloat16)
            if x.shape != tuple(shape):
                raise RuntimeError(f"demo init of {name} gave shape {x.shape}, expected {shape}")
            f.write(x.tobytes())
            bar.update(x.nbytes)
    return offset


def write_hf_checkpoint(out: Path, spec: DemoSpec, progress: bool = True) -> Path:
    """Write config.json, generation_config.json, tokenizer files and model.safetensors into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(spec)
    vocab = -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64
    cfg = hf_config(spec, vocab, tok.token_to_id("<|endoftext|>"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tokenizer_files(out, tok)
    nbytes = write_safetensors(out / "model.safetensors", list(weight_inits(spec, cfg, tok)), spec.seed, progress)
    log.info("wrote the demo HF checkpoint %s (%.0f MB, tokenizer %d ids, vocab %d)", out, nbytes / 1e6,
             tok.get_vocab_size(with_added_tokens=True), vocab)
    return out
