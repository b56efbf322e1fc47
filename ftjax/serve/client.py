"""Python clients of an ``ftjax serve`` server: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

>>> with Client("127.0.0.1:50051") as c:
...     c.wait_ready()
...     for chunk in c.stream("The lighthouse", max_tokens=32, temperature=0):
...         print(chunk.text, end="")
...     print(c.chat([{"role": "user", "content": "Hi"}], max_tokens=16).text)

Sampling keywords: temperature, top_k, top_p, seed, max_tokens, stop, stop_token_ids (unset = the
server's defaults). ``timeout`` is the call's gRPC deadline in seconds (the server frees the request's
slot when it passes). ``stream.cancel()`` (or a ``with`` block, or dropping the stream) cancels a
call early, which frees its slot too. Failures raise ``grpc.RpcError`` (``.code()``, ``.details()``;
INVALID_ARGUMENT details name the bad field).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ftjax.engine.api import RequestResult
from ftjax.serve.stubs import is_repeated, load

log = logging.getLogger(__name__)

pb, pb_grpc = load()
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop", "stop_token_ids")
DEFAULT_TARGET = "127.0.0.1:50051"


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One streamed message: new token ids and their text; ``finish_reason`` and usage on the last."""
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "deadline" | "error"
    usage: dict[str, Any] | None = None  # prompt_tokens, completion_tokens, ttft_s, decode_tok_s


# A finished call: the same record the engine returns for a request.
Completion = RequestResult


def _reason(value: int) -> str | None:
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def _chunk(resp) -> Chunk:
    usage = None
    if resp.HasField("usage"):
        u = resp.usage
        usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "ttft_s": u.ttft_s,
                 "decode_tok_s": u.decode_tok_s}
    return Chunk(resp.request_id, list(resp.token_ids), resp.text, _reason(resp.finish_reason), usage)


class _Collector:
    def __init__(self):
        self.request_id, self.text, self.ids, self.last = "", [], [], None

    def add(self, ch: Chunk) -> None:
        self.request_id = ch.request_id or self.request_id
        self.text.append(ch.text)
        self.ids += ch.token_ids
        if ch.finish_reason is not None:
            self.last = ch

    def completion(self) -> Completion:
        if self.last is None:
            raise RuntimeError("the stream ended without a final message")
        u = self.last.usage or {}
        return Completion(self.request_id, "".join(self.text), self.ids, self.last.finish_reason,
                          u.get("prompt_tokens", 0), u.get("completion_tokens", len(self.ids)),
                          u.get("ttft_s", 0.0), u.get("decode_tok_s", 0.0))


def _sampling(kw: dict[str, Any]):
    unknown = set(kw) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling keyword(s) {sorted(unknown)}; valid: {', '.join(SAMPLING_FIELDS)}")
    msg = pb.SamplingParams()
    for name, value in kw.items():
        if value is None:
            continue
        if name == "stop":
            msg.stop.extend([value] if isinstance(value, str) else value)
        elif name == "stop_token_ids":
            msg.stop_token_ids.extend(value)
        else:
            setattr(msg, name, value)
    return msg


def _messages(messages: Iterable[dict[str, Any]]) -> list:
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        out.append(pb.ChatMessage(role=m.get("role", ""), content=m.get("content") or "",
                                  reasoning_content=m.get("reasoning_content") or "",
                                  tool_calls_json=json.dumps(calls) if calls else ""))
    return out


def generate_request(prompt: str | Sequence[int], request_id: str | None = None, **sampling):
    req = pb.GenerateRequest(sampling=_sampling(sampling), request_id=request_id or "")
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_ids.extend(int(t) for t in prompt)
    return req


def chat_request(messages, request_id: str | None = None, enable_thinking: bool | None = None,
                 tools: list[dict] | None = None, **sampling):
    req = pb.ChatRequest(messages=_messages(messages), sampling=_sampling(sampling), request_id=request_id or "",
                         tools_json=json.dumps(tools) if tools else "")
    if enable_thinking is not None:
        req.enable_thinking = enable_thinking
    return req


def _tokenize_request(text, messages, add_generation_prompt, enable_thinking):
    req = pb.TokenizeRequest(text=text or "", add_generation_prompt=add_generation_prompt)
    if messages is not None:
        req.messages.extend(_messages(messages))
    if enable_thinking is not None:
        req.enable_thinking = enable_thinking
    return req


def _as_dict(msg) -> dict[str, Any]:
    """Every field (defaults included) as plain Python values; unlike MessageToDict, int64 stays int."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.name] = dict(value)
        elif f.message_type is not None:
            out[f.name] = [_as_dict(v) for v in value] if is_repeated(f) else _as_dict(value)
        elif is_repeated(f):
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out


class Stream:
    """The Chunks of one Generate/Chat call, as an iterator. ``cancel()`` (also ``close()``, leaving a
    ``with`` block, or dropping the last reference) cancels the call, which frees the server slot."""

    def __init__(self, call):
        self._call = call

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Chunk:
        return _chunk(next(self._call))

    def cancel(self) -> None:
        self._call.cancel()  # a no-op once the call is complete

    close = cancel

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()

    def __del__(self):
        self.cancel()


class AsyncStream:
    """The Chunks of one call, as an async iterator; ``cancel()`` or ``async with`` cancels the call."""

    def __init__(self, call):
        self._call = call

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> Chunk:
        resp = await self._call.read()
        if resp is grpc.aio.EOF:
            raise StopAsyncIteration
        return _chunk(resp)

    def cancel(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class Client:
    """Blocking client; streams are iterators (``for chunk in client.stream(...)``)."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 channel: grpc.Channel | None = None):
        self.target, self.timeout = target, timeout
        self._channel = channel or grpc.insecure_channel(target)
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _t(self, timeout):
        return self.timeout if timeout is None else timeout

    def stream(self, prompt: str | Sequence[int], *, timeout: float | None = None, request_id: str | None = None,
               **sampling) -> "Stream":
        return Stream(self._stub.Generate(generate_request(prompt, request_id, **sampling), timeout=self._t(timeout)))

    def generate(self, prompt: str | Sequence[int], **kw) -> Completion:
        col = _Collector()
        for ch in self.stream(prompt, **kw):
            col.add(ch)
        return col.completion()

    def chat_stream(self, messages: Iterable[dict[str, Any]], *, timeout: float | None = None,
                    request_id: str | None = None, enable_thinking: bool | None = None,
                    tools: list[dict] | None = None, **sampling) -> "Stream":
        req = chat_request(messages, request_id, enable_thinking, tools, **sampling)
        return Stream(self._stub.Chat(req, timeout=self._t(timeout)))

    def chat(self, messages: Iterable[dict[str, Any]], **kw) -> Completion:
        col = _Collector()
        for ch in self.chat_stream(messages, **kw):
            col.add(ch)
        return col.completion()

    def tokenize(self, text: str | None = None, *, messages: Iterable[dict[str, Any]] | None = None,
                 add_generation_prompt: bool = True, enable_thinking: bool | None = None) -> list[int]:
        req = _tokenize_request(text, messages, add_generation_prompt, enable_thinking)
        return list(self._stub.Tokenize(req, timeout=self.timeout).token_ids)

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        req = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._stub.Detokenize(req, timeout=self.timeout).text

    def model_info(self) -> dict[str, Any]:
        return _as_dict(self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout))

    def stats(self) -> dict[str, Any]:
        return _as_dict(self._stub.GetStats(pb.GetStatsRequest(), timeout=self.timeout))

    def health(self, service: str = "") -> str:
        """"SERVING" | "NOT_SERVING" | ... of grpc.health.v1."""
        resp = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout or 10.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 300.0, poll_s: float = 0.2) -> None:
        """Block until health is SERVING; TimeoutError after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while True:
            try:
                if self.health() == "SERVING":
                    return
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
            if time.monotonic() >= end:
                raise TimeoutError(f"{self.target} did not become SERVING within {timeout}s")
            time.sleep(poll_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client (grpc.aio); streams are async iterators (``async for chunk in client.stream(...)``).
    Create it inside the event loop that uses it."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None):
        self.target, self.timeout = target, timeout
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _t(self, timeout):
        return self.timeout if timeout is None else timeout

    def stream(self, prompt: str | Sequence[int], *, timeout: float | None = None, request_id: str | None = None,
               **sampling) -> "AsyncStream":
        return AsyncStream(self._stub.Generate(generate_request(prompt, request_id, **sampling),
                                               timeout=self._t(timeout)))

    async def generate(self, prompt: str | Sequence[int], **kw) -> Completion:
        col = _Collector()
        async for ch in self.stream(prompt, **kw):
            col.add(ch)
        return col.completion()

    def chat_stream(self, messages: Iterable[dict[str, Any]], *, timeout: float | None = None,
                    request_id: str | None = None, enable_thinking: bool | None = None,
                    tools: list[dict] | None = None, **sampling) -> "AsyncStream":
        req = chat_request(messages, request_id, enable_thinking, tools, **sampling)
        return AsyncStream(self._stub.Chat(req, timeout=self._t(timeout)))

    async def chat(self, messages: Iterable[dict[str, Any]], **kw) -> Completion:
        col = _Collector()
        async for ch in self.chat_stream(messages, **kw):
            col.add(ch)
        return col.completion()

    async def tokenize(self, text: str | None = None, *, messages: Iterable[dict[str, Any]] | None = None,
                       add_generation_prompt: bool = True, enable_thinking: bool | None = None) -> list[int]:
        req = _tokenize_request(text, messages, add_generation_prompt, enable_thinking)
        return list((await self._stub.Tokenize(req, timeout=self.timeout)).token_ids)

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        req = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return (await self._stub.Detokenize(req, timeout=self.timeout)).text

    async def model_info(self) -> dict[str, Any]:
        return _as_dict(await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout))

    async def stats(self) -> dict[str, Any]:
        return _as_dict(await self._stub.GetStats(pb.GetStatsRequest(), timeout=self.timeout))

    async def health(self, service: str = "") -> str:
        resp = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout or 10.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
