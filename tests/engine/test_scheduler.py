"""Scheduling logic with the fake accelerator: admission, chunked prefill between decode steps, slots
freed on finish / cancel / deadline / error, the bounded queue, request validation, no leaks."""
import asyncio
import random
import time

import pytest

from ftjax.engine import (Engine, EngineConfig, EngineError, InvalidRequestError, QueueFullError, Request,
                          SamplingParams)
from ftjax.engine.fake import FakeAccelerator

LONG_RUN = SamplingParams(temperature=0.0, max_tokens=100)


def make_engine(tokenizer, slots=2, max_len=128, chunk=8, queue=8, **fake):
    accel = FakeAccelerator(slots, max_len, 1024, avoid=frozenset(tokenizer.eos_token_ids), **fake)
    return Engine(accelerator=accel, tokenizer=tokenizer,
                  config=EngineConfig(max_slots=slots, prefill_chunk=chunk, max_queue=queue)), accel


def reference(accel, prompt, n):
    """The greedy tokens the fake model gives ``prompt`` run alone."""
    hist, out = list(prompt), []
    for _ in range(n):
        out.append(accel.next_token(hist))
        hist.append(out[-1])
    return out


def prompt_of(n, start=3):
    return [(start + 7 * i) % 1000 for i in range(n)]


def wait_for(cond, timeout=5.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        time.sleep(0.002)


@pytest.fixture
def engine(tokenizer):
    eng, accel = make_engine(tokenizer)
    eng.accel = accel
    with eng:
        yield eng


def test_tokens_match_the_model_alone(engine):
    p = prompt_of(5)
    r = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert r.token_ids == reference(engine.accel, p, 12)
    assert (r.finish_reason, r.prompt_tokens, r.completion_tokens) == ("length", 5, 12)
    assert r.text == engine.tokenizer.decode(r.token_ids) and r.ttft_s > 0
    s = engine.stats()
    assert s["active_slots"] == 0 and s["free_slots"] == 2 and s["completed"] == 1
    assert s["tokens_generated"] == 12 and s["prompt_tokens"] == 5
    assert s["experts"]["hits"] == 5 + 11  # no model config: one route per token fed


def test_stream_equals_result_sync_and_async(engine):
    h = engine.submit(Request(prompt_ids=prompt_of(4), sampling=SamplingParams(temperature=0.0, max_tokens=20)))
    events = list(h)
    r = h.result()
    assert [t for e in events for t in e.token_ids] == r.token_ids
    assert "".join(e.text for e in events) == r.text
    assert [e.finished for e in events] == [False] * 19 + [True] and events[-1].finish_reason == "length"

    async def consume():
        h2 = engine.submit(Request(prompt_ids=prompt_of(4), sampling=SamplingParams(temperature=0.0, max_tokens=20)))
        return [e async for e in h2.aiter()]

    assert asyncio.run(consume()) == events


def test_chunked_prefill_interleaves_with_decode(tokenizer):
    eng, accel = make_engine(tokenizer, slots=2, chunk=4, step_delay_s=0.002)
    with eng:
        a = eng.submit(Request(prompt_ids=prompt_of(3), sampling=SamplingParams(temperature=0.0, max_tokens=40)))
        it = iter(a)
        [next(it) for _ in range(3)]  # a is decoding
        long_prompt = prompt_of(22, start=11)
        b = eng.submit(Request(prompt_ids=long_prompt, sampling=SamplingParams(temperature=0.0, max_tokens=5)))
        rb, ra = b.result(5), a.result(5)
    assert rb.token_ids == reference(accel, long_prompt, 5)
    assert ra.token_ids == reference(accel, prompt_of(3), 40)
    # b's prompt went in chunks of <= 4 tokens, each followed by a decode step of a.
    b_calls = [i for i, (kind, n) in enumerate(accel.calls) if kind == "prefill" and n[1] > 0]
    assert [accel.calls[i][1][1] for i in b_calls] == [4, 4, 4, 4, 4, 2]
    for i in b_calls:
        assert accel.calls[i + 1][0] == "decode" and accel.calls[i + 1][1][0] == 1


def test_cancel_frees_the_slot_at_once(tokenizer):
    eng, _ = make_engine(tokenizer, slots=1, step_delay_s=0.005)
    with eng:
        h = eng.submit(Request(prompt_ids=prompt_of(3), sampling=LONG_RUN))
        queued = eng.submit(Request(prompt_ids=prompt_of(3), sampling=LONG_RUN))
        it = iter(h)
        [next(it) for _ in range(2)]
        assert eng.stats()["active_slots"] == 1 and eng.stats()["queued"] == 1
        queued.cancel()  # a queued request is dropped without ever taking a slot
        rq = queued.result(5)
        assert rq.finish_reason == "cancelled" and rq.completion_tokens == 0
        h.cancel()
        r = h.result(5)
        assert r.finish_reason == "cancelled" and 2 <= r.completion_tokens < 100
        s = eng.stats()
        assert s["active_slots"] == 0 and s["free_slots"] == 1 and s["cancelled"] == 2 and s["queued"] == 0
        events = list(h)
        assert events[-1].finished and events[-1].finish_reason == "cancelled"
        assert "".join(e.text for e in events) == r.text
        h.cancel()  # cancelling a finished request is a no-op
        ok = eng.generate([prompt_of(2)], SamplingParams(temperature=0.0, max_tokens=3))[0]
        assert ok.finish_reason == "length"


def test_deadline_frees_the_slot(tokenizer):
    eng, _ = make_engine(tokenizer, slots=1, step_delay_s=0.005)
    with eng:
        running = eng.submit(Request(prompt_ids=prompt_of(3), sampling=LONG_RUN,
                                     deadline_s=time.monotonic() + 0.1))
        waiting = eng.submit(Request(prompt_ids=prompt_of(3), sampling=LONG_RUN,
                                     deadline_s=time.monotonic() + 0.05))
        r, w = running.result(5), waiting.result(5)
        assert r.finish_reason == "cancelled" and r.completion_tokens < 100
        assert w.finish_reason == "cancelled" and w.completion_tokens == 0
        s = eng.stats()
        assert s["active_slots"] == 0 and s["cancelled"] == 2


def test_queue_full(tokenizer):
    eng, _ = make_engine(tokenizer, slots=1, queue=2, step_delay_s=0.005)
    with eng:
        first = eng.submit(Request(prompt_ids=prompt_of(3), sampling=LONG_RUN))
        next(iter(first))  # admitted: the queue is empty again
        waiting = [eng.submit(Request(prompt_ids=prompt_of(3), sampling=LONG_RUN)) for _ in range(2)]
        with pytest.raises(QueueFullError, match="max_queue=2"):
            eng.submit(Request(prompt_ids=prompt_of(3), sampling=LONG_RUN))
        for h in [first] + waiting:
            h.cancel()
        wait_for(lambda: eng.stats()["queued"] == 0 and eng.stats()["active_slots"] == 0)
        eng.submit(Request(prompt_ids=prompt_of(3), sampling=SamplingParams(max_tokens=2))).result(5)


@pytest.mark.parametrize("kwargs, field", [
    ({"prompt": ""}, "prompt"),
    ({"prompt_ids": []}, "prompt_ids"),
    ({"prompt_ids": [1, 1024]}, "prompt_ids"),
    ({"prompt_ids": [1, -1]}, "prompt_ids"),
    ({"prompt_ids": [1, True]}, "prompt_ids"),
    ({"prompt_ids": [1.5]}, "prompt_ids"),
    ({"prompt_ids": 7}, "prompt_ids"),
    ({}, "prompt"),
    ({"prompt": "hi", "prompt_ids": [1]}, "prompt"),
    ({"prompt_ids": list(range(128))}, "prompt_ids"),
    ({"prompt_ids": [1] * 100, "sampling": SamplingParams(max_tokens=29)}, "max_tokens"),
    ({"prompt_ids": [1], "sampling": {"temperature": 0}}, "sampling"),
    ({"prompt_ids": [1], "deadline_s": "soon"}, "deadline_s"),
    ({"prompt_ids": [1], "request_id": 5}, "request_id"),
])
def test_bad_requests_name_the_field(engine, kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        engine.submit(Request(**kwargs))
    assert e.value.field == field and str(e.value).startswith(field)
    assert engine.stats()["queued"] == 0


def test_prompt_plus_max_tokens_may_fill_the_context(engine):
    r = engine.generate([[1] * 100], SamplingParams(temperature=0.0, max_tokens=28))[0]
    assert r.completion_tokens == 28


def test_stop_token_ids(engine):
    p = prompt_of(4)
    ref = reference(engine.accel, p, 10)
    r = engine.generate([p], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[ref[4]]))[0]
    assert r.finish_reason == "stop" and r.token_ids == ref[:ref.index(ref[4]) + 1]


def test_step_failure_ends_its_requests_with_error(tokenizer):
    eng, accel = make_engine(tokenizer, slots=2, fail_after=3)
    with eng:
        rs = eng.generate([prompt_of(3), prompt_of(4)], SamplingParams(temperature=0.0, max_tokens=10))
        assert [r.finish_reason for r in rs] == ["error", "error"]
        assert eng.stats()["errors"] == 2 and eng.stats()["active_slots"] == 0
        accel.fail_after = None  # the engine keeps serving
        assert eng.generate([prompt_of(3)], SamplingParams(temperature=0.0, max_tokens=4))[0].finish_reason == "length"


def test_fault_found_after_a_step_publishes_none_of_its_tokens(tokenizer):
    """A fault the accelerator finds once a step's outputs are read (a background expert fill that did
    not land) ends the requests with an error before any token of that step reaches them."""
    eng, accel = make_engine(tokenizer, slots=1, fail_check_after=4)
    with eng:
        r = eng.submit(Request(prompt_ids=prompt_of(3), sampling=LONG_RUN)).result(5)
        # step 1 prefills the prompt (one chunk) and samples token 1, steps 2-4 decode tokens 2-4; the
        # check after step 5 fails: its token is never published
        assert r.finish_reason == "error"
        assert list(r.token_ids) == reference(accel, prompt_of(3), 4)
        accel.fail_check_after = None  # the engine keeps serving
        assert eng.generate([prompt_of(3)], SamplingParams(temperature=0.0, max_tokens=4))[0].finish_reason == "length"
    assert accel.calls[-1] == ("drain", [])  # stop() let the device finish writing the states


def test_an_accelerator_without_the_optional_verbs(tokenizer):
    """check_step and drain are optional: an accelerator with only the core verbs serves."""
    fake = FakeAccelerator(1, 128, 1024, avoid=frozenset(tokenizer.eos_token_ids))

    class Core:  # the fake's core verbs only
        backend_name, max_slots, max_len, vocab_size = "resident", 1, 128, 1024
        prefill, decode, reset, warmup, memory = fake.prefill, fake.decode, fake.reset, fake.warmup, fake.memory

    with Engine(accelerator=Core(), tokenizer=tokenizer, config=EngineConfig(max_slots=1, prefill_chunk=8)) as eng:
        r = eng.generate([prompt_of(3)], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert r.finish_reason == "length" and list(r.token_ids) == reference(fake, prompt_of(3), 4)


def test_stop_ends_everything_and_refuses_new_work(tokenizer):
    eng, _ = make_engine(tokenizer, slots=1, step_delay_s=0.005)
    eng.start()
    hs = [eng.submit(Request(prompt_ids=prompt_of(3), sampling=LONG_RUN)) for _ in range(3)]
    next(iter(hs[0]))
    eng.stop()
    assert all(h.result(1).finish_reason == "cancelled" for h in hs)
    with pytest.raises(EngineError):
        eng.submit(Request(prompt_ids=prompt_of(3)))


def test_no_leaked_slots_after_many_random_requests(tokenizer):
    rng = random.Random(0)
    eng, accel = make_engine(tokenizer, slots=3, chunk=8, queue=64)
    with eng:
        jobs = []
        for i in range(60):
            p = prompt_of(rng.randint(1, 40), start=rng.randint(0, 999))
            sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 30))
            deadline = time.monotonic() + 0.01 if rng.random() < 0.1 else None
            jobs.append((p, sp, eng.submit(Request(prompt_ids=p, sampling=sp, deadline_s=deadline))))
            if rng.random() < 0.15:
                jobs[-1][2].cancel()
            if rng.random() < 0.3:
                time.sleep(0.002)
        results = [(p, sp, h.result(10)) for p, sp, h in jobs]
        wait_for(lambda: eng.stats()["active_slots"] == 0)
        s = eng.stats()
    assert s["free_slots"] == 3 and s["queued"] == 0
    assert s["completed"] + s["cancelled"] == 60 and s["errors"] == 0
    for p, sp, r in results:
        ref = reference(accel, p, sp.max_tokens)
        if r.finish_reason == "cancelled":
            assert r.token_ids == ref[:len(r.token_ids)]
        else:
            assert r.token_ids == ref


def test_stats_contract(engine):
    s = engine.stats()
    for key in ("active_slots", "free_slots", "queued", "completed", "cancelled", "errors", "tokens_generated",
                "prompt_tokens", "steps", "uptime_s"):
        assert key in s
    assert set(s["experts"]) == {"backend", "hits", "misses", "fills", "cpu_experts"}
    assert set(s["memory"]) == {"params_bytes", "kv_bytes", "expert_cache_bytes", "expert_pool_bytes"}
    assert s["bandwidth"] == {"b_pcie_gbps": None, "b_host_gbps": None}


@pytest.mark.parametrize("field, value", [("max_slots", 0), ("max_len", 1), ("prefill_chunk", 0),
                                          ("max_queue", 0), ("dtype", "int8"), ("max_slots", 2.0),
                                          ("background_fills", "yes"), ("unit_split", "on")])
def test_engine_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_array_prompt_ids_and_submit_starts_the_engine(tokenizer):
    import jax.numpy as jnp
    import numpy as np

    eng, accel = make_engine(tokenizer)
    p = prompt_of(6)
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    a = eng.submit(Request(prompt_ids=jnp.asarray(p, jnp.int32), sampling=sp)).result(5)
    b = eng.submit(Request(prompt_ids=np.asarray(p, np.int64), sampling=sp)).result(5)
    assert a.token_ids == b.token_ids == reference(accel, p, 4)
    with pytest.raises(InvalidRequestError, match="prompt_ids"):
        eng.submit(Request(prompt_ids=np.zeros((2, 2), np.int32)))
    eng.stop()
