"""Every bad request gets INVALID_ARGUMENT naming the field; a full queue RESOURCE_EXHAUSTED; the
server keeps serving through all of it. Plus the small RPCs, health and reflection (fake engine)."""
from __future__ import annotations

import math
import time

import grpc
import pytest

from ftjax.serve.client import chat_request, generate_request, pb, pb_grpc
from serve_helpers import wait_idle

USER = [{"role": "user", "content": "Hello there"}]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _unknown_varint(field: int, value: int = 1) -> bytes:
    return _varint(field << 3) + _varint(value)


def _code_details(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("prompt, sampling, field", [
    ("", {}, "prompt"),
    ("word " * 300, {}, "prompt"),
    ([5, 99999], {}, "prompt_ids"),
    ("hi", {"temperature": -1.0}, "sampling.temperature"),
    ("hi", {"temperature": math.nan}, "sampling.temperature"),
    ("hi", {"top_p": 0.0}, "sampling.top_p"),
    ("hi", {"top_p": 1.5}, "sampling.top_p"),
    ("hi", {"top_k": -1}, "sampling.top_k"),
    ("hi", {"max_tokens": 0}, "sampling.max_tokens"),
    ("hi", {"max_tokens": 10_000}, "sampling.max_tokens"),
    ("hi", {"seed": -1}, "sampling.seed"),
    ("hi", {"seed": 2**40}, "sampling.seed"),
    ("hi", {"stop": [""]}, "sampling.stop"),
    ("hi", {"stop_token_ids": [-3]}, "sampling.stop_token_ids"),
])
def test_bad_generate_names_the_field(client, prompt, sampling, field):
    code, details = _code_details(lambda: client.generate(prompt, **sampling))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(f"{field}:") or details.startswith(f"{field}="), details


def test_prompt_and_prompt_ids_together(fake_server):
    req = generate_request("hi")
    req.prompt_ids.extend([1, 2])
    with grpc.insecure_channel(fake_server.target) as ch:
        code, details = _code_details(lambda: list(pb_grpc.InferenceServiceStub(ch).Generate(req, timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("prompt:")


@pytest.mark.parametrize("messages, extra, field", [
    ([], {}, "messages"),
    ([{"role": "bot", "content": "x"}], {}, "messages[0].role"),
    (USER + [{"role": "wizard", "content": "x"}], {}, "messages[1].role"),
])
def test_bad_chat_names_the_field(client, messages, extra, field):
    code, details = _code_details(lambda: client.chat(messages, max_tokens=4, **extra))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{field}:"), details


@pytest.mark.parametrize("mutate, field", [
    (lambda r: setattr(r, "tools_json", "[{not json"), "tools_json"),
    (lambda r: setattr(r, "tools_json", '{"a": 1}'), "tools_json"),
    (lambda r: setattr(r.messages[0], "tool_calls_json", "nope"), "messages[0].tool_calls_json"),
])
def test_bad_chat_json_fields(fake_server, mutate, field):
    req = chat_request(USER, max_tokens=4)
    mutate(req)
    with grpc.insecure_channel(fake_server.target) as ch:
        code, details = _code_details(lambda: list(pb_grpc.InferenceServiceStub(ch).Chat(req, timeout=10)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{field}:"), details


@pytest.mark.parametrize("method, payload, where", [
    ("Generate", generate_request("hi", max_tokens=2).SerializeToString() + _unknown_varint(99), "GenerateRequest"),
    ("Generate", generate_request("hi").SerializeToString()
     + b"\x1a" + _varint(len(s := pb.SamplingParams(max_tokens=2).SerializeToString() + _unknown_varint(42)))
     + s, "sampling"),
    ("Chat", chat_request(USER).SerializeToString() + b"\x0a\x06\x0a\x04user" + b"", None),
    ("Chat", chat_request(USER).SerializeToString()
     + b"\x0a" + _varint(len(m := pb.ChatMessage(role="user").SerializeToString() + _unknown_varint(7))) + m,
     "messages[1]"),
], ids=["top-level", "nested", "valid-control", "repeated-nested"])
def test_unknown_fields_are_rejected(fake_server, method, payload, where):
    """proto3 would drop them silently; the server refuses (``where`` None: a valid control)."""
    with grpc.insecure_channel(fake_server.target) as ch:
        call = ch.unary_stream(f"/ftjax.v1.InferenceService/{method}",
                               response_deserializer=pb.GenerateResponse.FromString)(payload, timeout=10)
        if where is None:
            assert list(call)[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
            return
        code, details = _code_details(lambda: list(call))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(f"{where}:") and "unknown field number" in details, details


def test_unknown_field_in_unary_rpc(fake_server):
    with grpc.insecure_channel(fake_server.target) as ch:
        rpc = ch.unary_unary("/ftjax.v1.InferenceService/GetStats", response_deserializer=pb.Stats.FromString)
        code, details = _code_details(lambda: rpc(_unknown_varint(3), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown field number 3" in details


def test_tokenize_detokenize(client, tokenizer):
    ids = client.tokenize("The lighthouse keeper")
    assert ids == tokenizer.encode("The lighthouse keeper")
    assert client.detokenize(ids) == "The lighthouse keeper"
    chat_ids = client.tokenize(messages=USER, add_generation_prompt=True)
    assert chat_ids == tokenizer.encode(tokenizer.apply_chat_template(USER, add_generation_prompt=True))
    code, details = _code_details(lambda: client.detokenize([1, tokenizer.vocab_size + 5]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("token_ids[1]:")
    code, details = _code_details(lambda: client.tokenize("x", messages=USER))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("text:")


def test_queue_full_is_resource_exhausted_and_server_survives(client, fake_server):
    running = [client.stream("The lighthouse", max_tokens=60, temperature=0) for _ in range(2)]
    assert all(next(s).request_id for s in running)  # both slots busy (max_slots 2)
    queued = [client.stream("The lighthouse", max_tokens=60, temperature=0) for _ in range(2)]
    deadline = time.monotonic() + 5
    while client.stats()["queued"] < 2:  # max_queue 2
        assert time.monotonic() < deadline, client.stats()
        time.sleep(0.01)
    streams = running + queued
    code, details = _code_details(lambda: client.generate("one too many", max_tokens=2))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in details
    for s in streams:
        s.close()
    wait_idle(client)
    assert client.generate("still alive", max_tokens=3, temperature=0).completion_tokens == 3
    server = client.stats()["server"]
    assert server["resource_exhausted"] >= 1 and server["invalid_argument"] >= 1


def test_model_info_stats_health_reflection(client, fake_server, tokenizer):
    info = client.model_info()
    assert info["max_slots"] == 2 and info["vocab"] == tokenizer.vocab_size and info["has_chat_template"]
    assert sorted(info["eos_token_ids"]) == sorted(tokenizer.eos_token_ids)
    s = client.stats()
    assert s["ready"] and s["load_progress"] == 1.0 and s["free_slots"] + s["active_slots"] == 2
    assert {"hits", "misses", "fills", "cpu_experts"} <= set(s["experts"])
    assert {"b_pcie_gbps", "b_host_gbps"} <= set(s["bandwidth"]) and "kv_bytes" in s["memory"]
    assert client.health() == "SERVING" and client.health("ftjax.v1.InferenceService") == "SERVING"

    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    with grpc.insecure_channel(fake_server.target) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {"ftjax.v1.InferenceService", "grpc.health.v1.Health"} <= services
