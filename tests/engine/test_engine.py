"""The Engine end to end on the tiny demo model: determinism across runs and batches, seeded sampling,
chunked prefill beside a running stream, streaming, cancellation, async loading, introspection."""
import asyncio
import time

import pytest

from ftjax.engine import Engine, EngineConfig, Request, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = ["The lighthouse", "Once upon a time there was a clockmaker on Hollow Street who fixed a watch",
           "In the morning", "A small boat"]


@pytest.fixture(scope="module")
def engine(tiny_model):
    with Engine(tiny_model, config=EngineConfig(max_slots=4, max_len=128, prefill_chunk=16)) as eng:
        yield eng


@pytest.fixture(scope="module")
def solo(tiny_model):
    with Engine(tiny_model, config=EngineConfig(max_slots=1, max_len=128, prefill_chunk=64)) as eng:
        yield eng


def test_greedy_deterministic_across_runs_and_batch_sizes(engine, solo):
    batched = engine.generate(PROMPTS, GREEDY)
    again = engine.generate(PROMPTS, GREEDY)
    alone = [solo.generate([p], GREEDY)[0] for p in PROMPTS]
    assert [r.token_ids for r in batched] == [r.token_ids for r in again] == [r.token_ids for r in alone]
    assert [r.text for r in batched] == [r.text for r in alone]
    assert all(r.completion_tokens == 12 and r.finish_reason == "length" for r in batched)


def test_seeded_sampling_reproducible_alone_or_batched(engine, solo):
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=123, max_tokens=10)
    a = solo.generate([PROMPTS[1]], p)[0]
    others = [SamplingParams(temperature=0.8, seed=5, max_tokens=3), p, GREEDY, p]
    b = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]], others)
    assert a.token_ids == b[1].token_ids == b[3].token_ids
    c = solo.generate([PROMPTS[1]], SamplingParams(temperature=1.0, top_k=50, seed=124, max_tokens=10))[0]
    assert c.token_ids != a.token_ids


def test_chunked_prefill_beside_a_running_stream(engine, solo):
    long_prompt = " ".join(PROMPTS * 3)
    n_long = len(engine.tokenizer.encode(long_prompt))
    assert n_long > 3 * 16  # several chunks of 16
    alone = solo.generate([long_prompt], GREEDY)[0]
    running = engine.submit(Request(prompt=PROMPTS[0], sampling=SamplingParams(temperature=0.0, max_tokens=40)))
    it = iter(running)
    [next(it) for _ in range(2)]
    late = engine.submit(Request(prompt=long_prompt, sampling=GREEDY)).result(60)
    assert late.token_ids == alone.token_ids and late.prompt_tokens == n_long
    first = running.result(60)
    assert first.token_ids == solo.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=40))[0].token_ids


def test_streaming_equals_non_streaming(engine):
    sp = SamplingParams(temperature=0.7, seed=9, max_tokens=16)
    ref = engine.generate([PROMPTS[2]], sp)[0]
    h = engine.submit(Request(prompt=PROMPTS[2], sampling=sp))
    events = list(h)
    assert "".join(e.text for e in events) == ref.text == h.result().text
    assert [t for e in events for t in e.token_ids] == ref.token_ids

    async def consume():
        h2 = engine.submit(Request(prompt=PROMPTS[2], sampling=sp))
        return "".join([e.text async for e in h2.aiter()])

    assert asyncio.run(consume()) == ref.text


def test_stop_strings_and_ids(engine):
    ref = engine.generate([PROMPTS[0]], GREEDY)[0]
    stop_id = ref.token_ids[3]
    r = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]))[0]
    assert r.finish_reason == "stop" and r.token_ids == ref.token_ids[:ref.token_ids.index(stop_id) + 1]
    target = ref.text[5:9]
    h = engine.submit(Request(prompt=PROMPTS[0], sampling=SamplingParams(temperature=0.0, max_tokens=12,
                                                                        stop=[target])))
    streamed = "".join(e.text for e in h)
    r = h.result()
    assert r.finish_reason == "stop" and r.text == streamed == ref.text[:ref.text.index(target)]


def test_cancel_frees_the_slot(engine):
    h = engine.submit(Request(prompt=PROMPTS[3], sampling=SamplingParams(temperature=0.0, max_tokens=100)))
    next(iter(h))
    h.cancel()
    r = h.result(30)
    assert r.finish_reason == "cancelled" and r.completion_tokens < 100
    assert engine.stats()["active_slots"] == 0 and engine.stats()["free_slots"] == 4


def test_stats_and_model_info(engine, tiny_model):
    cfg = tiny_model.config
    before = engine.stats()
    r = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=5))[0]
    after = engine.stats()
    fed = r.prompt_tokens + r.completion_tokens - 1
    assert after["experts"]["hits"] - before["experts"]["hits"] == fed * cfg.num_experts_per_tok * cfg.num_layers
    assert after["tokens_generated"] - before["tokens_generated"] == 5
    assert after["prompt_tokens"] - before["prompt_tokens"] == r.prompt_tokens
    mem = after["memory"]
    assert mem["params_bytes"] > 0 and mem["kv_bytes"] > 0 and mem["expert_pool_bytes"] > 0
    info = engine.model_info()
    assert info["model_type"] == cfg.model_type and info["layers"] == cfg.num_layers
    assert info["experts"] == cfg.num_experts and info["top_k"] == cfg.num_experts_per_tok
    assert info["max_len"] == 128 and info["max_slots"] == 4 and info["vocab"] == cfg.vocab_size


def test_async_load_serves_when_ready(tiny_store, tiny_model):
    eng = Engine.from_store_async(tiny_store, EngineConfig(max_slots=1, max_len=64, prefill_chunk=64))
    assert 0.0 <= eng.load_progress <= 1.0
    with eng:
        h = eng.submit(Request(prompt=PROMPTS[0], sampling=GREEDY))  # waits in the queue while loading
        assert eng.wait_ready(120) and eng.ready and eng.load_progress == 1.0
        assert h.result(60).completion_tokens == 12
        assert eng.model_info()["store_path"] == str(tiny_store)


def test_default_max_len_and_bad_max_len(tiny_model):
    cfg = tiny_model.config
    eng = Engine(tiny_model, config=EngineConfig(max_slots=1, max_len=None, prefill_chunk=8))
    assert eng.max_len == min(4096, cfg.max_position_embeddings)
    with pytest.raises(ValueError, match="max_len"):
        Engine(tiny_model, config=EngineConfig(max_len=cfg.max_position_embeddings + 1))


def test_deadline_on_the_real_model(engine):
    h = engine.submit(Request(prompt=PROMPTS[1], sampling=SamplingParams(temperature=0.0, max_tokens=100),
                              deadline_s=time.monotonic() + 0.02))
    assert h.result(30).finish_reason == "cancelled"
    assert engine.stats()["active_slots"] == 0
