"""The tiny demo model behind a real server: health while loading, streaming equals non-streaming,
greedy output deterministic across runs and batch sizes, chat, cancellation on the real engine."""
from __future__ import annotations

import concurrent.futures as cf

import grpc

from ftjax.engine import SamplingParams
from ftjax.serve import Client
from serve_helpers import REAL_SLOTS, wait_idle

PROMPTS = ["The lighthouse keeper", "Once upon a time there was a clockmaker", "In the morning",
           "The river ran", "She opened the door and"]
GREEDY = {"temperature": 0.0, "max_tokens": 16}


def test_health_not_serving_while_loading_then_serving(real_server):
    early = real_server.early
    assert early["health"] == "NOT_SERVING"
    assert not early["stats"]["ready"] and early["stats"]["load_progress"] < 1.0
    code, details = early["generate"]
    assert code == grpc.StatusCode.UNAVAILABLE and "loading" in details
    with Client(real_server.target, timeout=10) as c:
        assert c.health() == "SERVING" and c.health("ftjax.v1.InferenceService") == "SERVING"
        s = c.stats()
        assert s["ready"] and s["load_progress"] == 1.0 and s["free_slots"] == REAL_SLOTS
        info = c.model_info()
        assert info["family"] == "qwen3_5_moe" and info["max_slots"] == REAL_SLOTS and info["store_path"]


def test_streaming_equals_non_streaming_and_engine(real_server):
    direct = real_server.engine.generate(PROMPTS[:2], SamplingParams(**GREEDY))
    with Client(real_server.target, timeout=60) as c:
        for prompt, ref in zip(PROMPTS, direct):
            whole = c.generate(prompt, **GREEDY)
            chunks = list(c.stream(prompt, **GREEDY))
            assert "".join(ch.text for ch in chunks) == whole.text == ref.text
            assert [t for ch in chunks for t in ch.token_ids] == whole.token_ids == list(ref.token_ids)
            assert chunks[-1].finish_reason == whole.finish_reason == ref.finish_reason
            assert whole.prompt_tokens == ref.prompt_tokens and whole.completion_tokens == len(ref.token_ids)


def test_greedy_deterministic_across_runs_and_batch_sizes(real_server):
    with Client(real_server.target, timeout=60) as c:
        alone = [c.generate(p, **GREEDY) for p in PROMPTS]
        again = [c.generate(p, **GREEDY) for p in PROMPTS]
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:  # 5 concurrent: batches of 4, then 1
            together = list(pool.map(lambda p: c.generate(p, **GREEDY), PROMPTS))
        ids = [r.token_ids for r in alone]
        assert ids == [r.token_ids for r in again] == [r.token_ids for r in together]
        assert len({tuple(i) for i in ids}) > 1  # the prompts really differ
        seeded = {"temperature": 0.9, "top_k": 20, "seed": 7, "max_tokens": 12}
        assert c.generate(PROMPTS[0], **seeded).token_ids == c.generate(PROMPTS[0], **seeded).token_ids


def test_chat_matches_the_rendered_prompt(real_server):
    engine = real_server.engine
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    with Client(real_server.target, timeout=60) as c:
        chat = c.chat(messages, enable_thinking=False, **GREEDY)
        plain = c.generate(text, **GREEDY)
    assert chat.token_ids == plain.token_ids and chat.prompt_tokens == plain.prompt_tokens


def test_cancel_frees_real_slot(real_server):
    with Client(real_server.target, timeout=60) as c:
        before = wait_idle(c)
        with c.stream(PROMPTS[0], temperature=0.0, max_tokens=120) as s:
            next(s)
        after = wait_idle(c, timeout=2.0)
        assert after["cancelled"] == before["cancelled"] + 1 and after["free_slots"] == REAL_SLOTS
