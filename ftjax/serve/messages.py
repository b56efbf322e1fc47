"""Between protobuf messages and the engine's types: validation and conversion.

Every check raises ``InvalidRequestError(field, message)`` naming the field the way a client spells
it (``sampling.top_p``, ``messages[2].role``), which the servicer turns into INVALID_ARGUMENT.

Unknown fields: proto3 parsers keep fields they do not know as "unknown fields" instead of failing.
A client that sets a field this server does not have (a typo'd field number, a newer schema) would
otherwise get a silently different request, so every request is walked (nested messages too) and
any unknown field is rejected, named by its number and the message that holds it.
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any

from ftjax.engine.api import InvalidRequestError, RequestResult
from ftjax.engine.sampling import SamplingParams
from ftjax.serve.stubs import is_repeated

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop_token_ids", "stop")
FINISH_REASONS = {"stop": "FINISH_REASON_STOP", "length": "FINISH_REASON_LENGTH",
                  "cancelled": "FINISH_REASON_CANCELLED", "deadline": "FINISH_REASON_DEADLINE",
                  "error": "FINISH_REASON_ERROR"}
_FIELD_PREFIX = re.compile(r"^(\w+)(?=[= ])")


# ------------------------------------------------------------------------------- unknown fields
def _unknown_numbers(msg) -> list[int]:
    try:
        from google.protobuf.unknown_fields import UnknownFieldSet  # protobuf >= 4.24
        return [f.field_number for f in UnknownFieldSet(msg)]
    except ImportError:  # older protobuf: the (since deprecated) method
        return [f.field_number for f in msg.UnknownFields()]


def check_unknown_fields(msg, path: str = "") -> None:
    """Raise InvalidRequestError for the first unknown field in ``msg`` or a message inside it."""
    numbers = _unknown_numbers(msg)
    if numbers:
        where = path or msg.DESCRIPTOR.name
        raise InvalidRequestError(where, f"unknown field number {numbers[0]} in {msg.DESCRIPTOR.full_name} "
                                  f"(this server's schema has no such field; check the client's .proto)")
    for field, value in msg.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        name = f"{path}.{field.name}" if path else field.name
        if is_repeated(field):
            for i, item in enumerate(value):
                check_unknown_fields(item, f"{name}[{i}]")
        else:
            check_unknown_fields(value, name)


# ------------------------------------------------------------------------------------ requests
def sampling_params(msg, has_msg: bool) -> SamplingParams:
    """SamplingParams from the proto message; unset fields take the engine defaults."""
    if not has_msg:
        return SamplingParams()
    kw: dict[str, Any] = {}
    for name in ("temperature", "top_k", "top_p", "seed", "max_tokens"):
        if msg.HasField(name):
            kw[name] = getattr(msg, name)
    kw["stop_token_ids"] = tuple(msg.stop_token_ids)
    kw["stop"] = tuple(msg.stop)
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        text = str(e)
        m = _FIELD_PREFIX.match(text)
        raise InvalidRequestError(f"sampling.{m.group(1)}" if m else "sampling", text) from None


def generate_inputs(req) -> dict[str, Any]:
    """``Request`` keyword arguments (prompt / prompt_ids, sampling, request_id) of a GenerateRequest."""
    check_unknown_fields(req)
    if req.prompt and len(req.prompt_ids):
        raise InvalidRequestError("prompt", "set only one of prompt and prompt_ids")
    if not req.prompt and not len(req.prompt_ids):
        raise InvalidRequestError("prompt", "the prompt is empty; set prompt (text) or prompt_ids (token ids)")
    kw: dict[str, Any] = {"sampling": sampling_params(req.sampling, req.HasField("sampling")),
                          "request_id": req.request_id or None}
    if req.prompt:
        kw["prompt"] = req.prompt
    else:
        kw["prompt_ids"] = [int(t) for t in req.prompt_ids]
    return kw


def _json_list(text: str, field: str) -> list | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(field, f"not valid JSON ({e})") from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise InvalidRequestError(field, "must be a JSON list of objects")
    return value


def chat_messages(messages, field: str = "messages") -> list[dict[str, Any]]:
    """Template-ready message dicts; the list must not be empty and every role must be known."""
    if not len(messages):
        raise InvalidRequestError(field, "no messages; at least one is required")
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequestError(f"{field}[{i}].role", f"{m.role!r} is not valid; role must be one of "
                                      f"{', '.join(CHAT_ROLES)}")
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        calls = _json_list(m.tool_calls_json, f"{field}[{i}].tool_calls_json")
        if calls is not None:
            d["tool_calls"] = calls
        out.append(d)
    return out


def render_chat(tokenizer, req, add_generation_prompt: bool = True) -> str:
    """The chat template applied to a ChatRequest's (or TokenizeRequest's) messages."""
    from ftjax.tokenizer import TokenizerError

    messages = chat_messages(req.messages)
    tools = _json_list(req.tools_json, "tools_json")
    thinking = req.enable_thinking if req.HasField("enable_thinking") else None
    if not tokenizer.has_chat_template:
        raise InvalidRequestError("messages", "this model has no chat template; use Generate with a prompt")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             enable_thinking=thinking, tools=tools)
    except (TokenizerError, TypeError, KeyError, ValueError) as e:  # the template raised on these messages
        raise InvalidRequestError("messages", f"the chat template cannot render them: {e}") from None


def chat_inputs(req, tokenizer) -> dict[str, Any]:
    """``Request`` keyword arguments of a ChatRequest (the messages rendered as the prompt text)."""
    check_unknown_fields(req)
    prompt = render_chat(tokenizer, req)
    return {"prompt": prompt, "sampling": sampling_params(req.sampling, req.HasField("sampling")),
            "request_id": req.request_id or None}


def token_ids(ids, vocab_size: int, field: str = "token_ids") -> list[int]:
    out = [int(t) for t in ids]
    for i, t in enumerate(out):
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(f"{field}[{i}]", f"{t} is outside the vocabulary [0, {vocab_size})")
    return out


# ----------------------------------------------------------------------------------- responses
def finish_reason(pb, reason: str | None) -> int:
    name = FINISH_REASONS.get(reason or "")
    if name is None:
        log.warning("unknown finish reason %r from the engine", reason)
        return pb.FINISH_REASON_UNSPECIFIED
    return getattr(pb, name)


def usage(pb, result: RequestResult):
    return pb.Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                    ttft_s=result.ttft_s, decode_tok_s=result.decode_tok_s)


def _flat_numbers(d: Any, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flat_numbers(v, f"{prefix}{k}."))
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out[prefix[:-1]] = float(d)
    return out


_STATS_INTS = ("active_slots", "free_slots", "queued", "completed", "cancelled", "errors", "tokens_generated",
               "prompt_tokens", "steps")


def stats_message(pb, stats: dict[str, Any], *, ready: bool, load_progress: float, server: dict[str, int]):
    """A Stats message from ``engine.stats()`` (any missing section stays zero)."""
    msg = pb.Stats(ready=ready, load_progress=load_progress, uptime_s=float(stats.get("uptime_s", 0.0)),
                   server=pb.ServerStats(**server))
    for name in _STATS_INTS:
        setattr(msg, name, int(stats.get(name, 0)))
    experts = stats.get("experts") or {}
    for name in ("hits", "misses", "fills", "cpu_experts"):
        setattr(msg.experts, name, int(experts.get(name, 0)))
    bw = stats.get("bandwidth") or {}
    msg.bandwidth.b_pcie_gbps = float(bw.get("b_pcie_gbps") or 0.0)
    msg.bandwidth.b_host_gbps = float(bw.get("b_host_gbps") or 0.0)
    msg.memory.update(_flat_numbers(stats.get("memory") or {}))
    known = set(_STATS_INTS) | {"uptime_s", "experts", "bandwidth", "memory"}
    extra = {k: v for k, v in stats.items() if k not in known}
    msg.extra.update(_flat_numbers(extra))
    for k, v in _flat_numbers(experts).items():  # expert counters beyond the four named ones
        if k not in ("hits", "misses", "fills", "cpu_experts"):
            msg.extra[f"experts.{k}"] = v
    return msg


_INFO_INTS = ("layers", "experts", "top_k", "vocab", "max_len", "max_slots")


def model_info_message(pb, info: dict[str, Any], tokenizer, version: str):
    info = {k.replace(" ", "_"): v for k, v in info.items() if v is not None}  # "store path" -> store_path
    msg = pb.ModelInfo(model_type=str(info.get("model_type", "")), family=str(info.get("family", "")),
                       dtype=str(info.get("dtype", "")), ftjax_version=version,
                       store_path=str(info.get("store_path", "")))
    for name in _INFO_INTS:
        if name in info:
            setattr(msg, name, int(info[name]))
    msg.eos_token_ids.extend(int(t) for t in sorted(tokenizer.eos_token_ids))
    msg.has_chat_template = bool(tokenizer.has_chat_template)
    known = set(_INFO_INTS) | {"model_type", "family", "dtype", "store_path"}
    msg.extra.update({k: str(v) for k, v in info.items() if k not in known})
    return msg
