"""A fast engine for the server tests: the real ``Engine`` (scheduler, handles, validation) driving
``FakeAccelerator`` (scripted logits, no JAX compile), with the tiny demo model's tokenizer.

Tokens are a fixed function of each row's history, so streams are deterministic and independent of
batching, like greedy decoding of a real model; ``step_delay_s`` makes every step take a while, so
tests can cancel mid-stream and watch the slots.
"""
from __future__ import annotations

from ftjax.engine import Engine, EngineConfig
from ftjax.engine.fake import FakeAccelerator
from ftjax.tokenizer import Tokenizer


def make_fake_engine(tokenizer: Tokenizer, *, max_slots: int = 2, max_len: int = 96, max_queue: int = 4,
                     step_delay_s: float = 0.0) -> Engine:
    accel = FakeAccelerator(max_slots=max_slots, max_len=max_len, vocab_size=tokenizer.vocab_size,
                            step_delay_s=step_delay_s, avoid=frozenset(tokenizer.eos_token_ids))
    config = EngineConfig(max_slots=max_slots, max_len=max_len, max_queue=max_queue, prefill_chunk=32)
    return Engine(accelerator=accel, tokenizer=tokenizer, config=config).start()
