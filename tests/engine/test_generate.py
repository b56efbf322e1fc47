"""The Generator facade (the CLI's) over the Engine on the tiny demo store: determinism, batching,
chunked prefill, stops, streaming, errors."""
import pytest

from ftjax.engine.generate import Generator
from ftjax.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SHORT = "The lighthouse"
LONG = "Once upon a time there was a clockmaker on Hollow Street who fixed a watch"


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def gen(model):
    return Generator(model, batch=2, max_len=128, prefill_chunk=64)


def test_greedy_is_deterministic(gen):
    a, b = gen.generate([SHORT], GREEDY)[0], gen.generate([SHORT], GREEDY)[0]
    assert a.token_ids == b.token_ids and a.text == b.text
    assert len(a.token_ids) == 12 and a.finish_reason == "length"
    assert a.prompt_tokens == len(gen.tokenizer.encode(SHORT))
    assert a.text == gen.tokenizer.decode(a.token_ids)
    assert a.ttft_s > 0 and a.decode_tok_s > 0


def test_batch_equals_each_alone(gen):
    together = gen.generate([SHORT, LONG], GREEDY)
    alone = [gen.generate([p], GREEDY)[0] for p in (SHORT, LONG)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert together[0].prompt_tokens != together[1].prompt_tokens


def test_more_prompts_than_batch_and_token_prompts(gen):
    ids = gen.tokenizer.encode(LONG)
    out = gen.generate([SHORT, ids, SHORT], GREEDY)
    assert len(out) == 3 and out[0].token_ids == out[2].token_ids
    assert out[1].token_ids == gen.generate([LONG], GREEDY)[0].token_ids


def test_chunked_prefill_matches_one_chunk(model, gen):
    small_chunks = Generator(model, batch=1, max_len=128, prefill_chunk=8)
    assert small_chunks.generate([LONG], GREEDY)[0].token_ids == gen.generate([LONG], GREEDY)[0].token_ids


def test_seeded_sampling_reproducible_alone_or_batched(gen):
    p = SamplingParams(temperature=1.0, top_k=50, seed=123, max_tokens=10)
    a = gen.generate([LONG], p)[0]
    b = gen.generate([SHORT, LONG], [SamplingParams(temperature=0.0, max_tokens=3), p])[1]
    assert a.token_ids == b.token_ids
    c = gen.generate([LONG], SamplingParams(temperature=1.0, top_k=50, seed=124, max_tokens=10))[0]
    assert c.token_ids != a.token_ids


def test_stop_token_and_stop_string(gen):
    ref = gen.generate([SHORT], GREEDY)[0]
    stop_id = ref.token_ids[3]
    r = gen.generate([SHORT], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_id,)))[0]
    assert r.finish_reason == "stop" and r.token_ids == ref.token_ids[:ref.token_ids.index(stop_id) + 1]
    target = ref.text[5:9]
    r = gen.generate([SHORT], SamplingParams(temperature=0.0, max_tokens=12, stop=(target,)))[0]
    assert r.finish_reason == "stop" and r.text == ref.text[:ref.text.index(target)]


def test_streaming_matches_and_callback(gen):
    ref = gen.generate([SHORT], GREEDY)[0]
    stream = gen.stream(SHORT, GREEDY)
    deltas = list(stream)
    assert "".join(deltas) == ref.text == stream.result.text
    seen = {}
    gen.generate([SHORT, LONG], GREEDY, on_text=lambda i, d: seen.setdefault(i, []).append(d))
    assert "".join(seen[0]) == ref.text


def test_context_limit(model):
    g = Generator(model, batch=1, max_len=16)
    ids = list(range(10, 25))  # one short of the context: max_tokens is clipped to the one token left
    r = g.generate([ids], SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert len(r.token_ids) == 1 and r.finish_reason == "length"
    with pytest.raises(ValueError, match=r"16 tokens.*context of 16"):
        g.generate([ids + [10]], GREEDY)
    with pytest.raises(ValueError, match="max_position_embeddings|must be in"):
        Generator(model, max_len=model.config.max_position_embeddings + 1)


def test_bad_prompts(gen):
    with pytest.raises(ValueError, match="empty"):
        gen.generate([""], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        gen.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="outside"):
        gen.generate([[10**7]], GREEDY)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        gen.generate([SHORT], [GREEDY, GREEDY])
