"""Batch text generation on a loaded model with all experts resident (``ResidentExperts``).

Shapes are bucketed so a handful of executables serve every request: the batch is padded to a
power of two (at most ``batch``), prompts are prefilled in chunks whose length is a power of two
(at most ``prefill_chunk``), and decode runs one token per row per step. Rows that finished, and the
padding rows, are fed ``n_new = 0`` so their state is left untouched.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.engine.sampling import SamplingParams, batch_arrays, row_keys, sample
from ftjax.experts.resident import ResidentExperts
from ftjax.models import get_family, make_step_fns
from ftjax.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_LEN = 4096
MIN_PREFILL_BUCKET = 8

TextCallback = Callable[[int, str], None]  # (prompt index, text delta)


@dataclasses.dataclass
class Result:
    text: str
    token_ids: list[int]  # generated ids, including the stop token if one ended generation
    finish_reason: str  # "stop" (eos / stop id / stop string) | "length" (max_tokens or context full)
    prompt_tokens: int
    ttft_s: float  # from the start of the batch to this row's first token on the host
    decode_tok_s: float  # tokens after the first, per second (0 when fewer than two)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@jax.jit
def _sample_rows(logits, seeds, step, temperature, top_k, top_p):
    return sample(logits, row_keys(seeds, step), temperature, top_k, top_p)


class _Row:
    """Host-side progress of one request: ids, text released so far, stop checks."""

    def __init__(self, prompt_len: int, params: SamplingParams, detok: IncrementalDetokenizer,
                 stop_ids: frozenset[int], budget: int):
        self.prompt_len, self.params, self.detok = prompt_len, params, detok
        self.stop_ids, self.budget = stop_ids, budget
        self.ids: list[int] = []
        self.emitted = 0  # characters of detok.text already released
        self.finish: str | None = None
        self.t_first = self.t_last = 0.0
        self._hold = max((len(s) for s in params.stop), default=1) - 1  # a stop string may be mid-way

    def push(self, tid: int, now: float) -> str:
        """Record one sampled id; return the text it releases."""
        if not self.ids:
            self.t_first = now
        self.t_last = now
        self.ids.append(tid)
        if tid in self.stop_ids:
            self.finish = "stop"
            return self._release(self.detok.flush(), final=True)
        delta = self.detok.add(tid)
        if len(self.ids) >= self.budget:
            self.finish = "length"
            delta += self.detok.flush()
        return self._release(delta, final=self.finish is not None)

    def _release(self, delta: str, final: bool) -> str:
        text = self.detok.text
        if delta and self.params.stop:
            start = max(0, self.emitted - self._hold)
            hits = [i for i in (text.find(s, start) for s in self.params.stop) if i >= 0]
            if hits:
                self.detok.text = text = text[:min(hits)]
                self.finish, final = "stop", True
        end = len(text) if final else max(self.emitted, len(text) - self._hold)
        out, self.emitted = text[self.emitted:end], end
        return out

    def result(self, t0: float) -> Result:
        n = len(self.ids)
        rate = (n - 1) / (self.t_last - self.t_first) if n > 1 and self.t_last > self.t_first else 0.0
        return Result(text=self.detok.text, token_ids=list(self.ids), finish_reason=self.finish or "length",
                      prompt_tokens=self.prompt_len, ttft_s=self.t_first - t0, decode_tok_s=rate)


class TextStream:
    """Iterator of text deltas of one request; ``result`` is set once it is exhausted."""

    def __init__(self, events: Iterator):
        self._events = events
        self.result: Result | None = None

    def __iter__(self) -> Iterator[str]:
        while True:
            try:
                _, delta = next(self._events)
            except StopIteration as done:
                self.result = done.value[0]
                return
            yield delta


class Generator:
    """Generate text from a ``LoadedModel`` (``ftjax.ftw.load_store``) with every expert on the device."""

    def __init__(self, model, tokenizer: Tokenizer | None = None, *, batch: int = 1, max_len: int | None = None,
                 prefill_chunk: int = 256):
        cfg = model.config
        if batch < 1:
            raise ValueError(f"batch={batch} must be >= 1")
        if max_len is None:
            max_len = min(cfg.max_position_embeddings, DEFAULT_MAX_LEN)
        if not 1 <= max_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_len={max_len} must be in [1, {cfg.max_position_embeddings}] "
                             f"(the model's max_position_embeddings)")
        if prefill_chunk < 1 or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk={prefill_chunk} must be a power of two")
        self.cfg, self.batch, self.max_len = cfg, batch, max_len
        self.prefill_chunk = min(prefill_chunk, _pow2_at_least(max_len))
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_dir(model.path)
        self.params = model.params
        self.backend = ResidentExperts(cfg.num_experts)
        self.expert_state = ResidentExperts.init_state(model.experts)
        self.dtype = jnp.asarray(model.params["embed"]).dtype
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(cfg.eos_token_ids)
        self._prefill: dict[tuple[int, int], Callable] = {}
        self._decode: dict[int, Callable] = {}

    # ---- public API ----
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_text: TextCallback | None = None) -> list[Result]:
        """Generate for every prompt (text, or token ids); ``on_text(i, delta)`` streams the text."""
        ids, plist = self._prepare(prompts, params)
        results: list[Result] = []
        for start in range(0, len(ids), self.batch):
            events = self._run(ids[start:start + self.batch], plist[start:start + self.batch])
            while True:
                try:
                    i, delta = next(events)
                except StopIteration as done:
                    results += done.value
                    break
                if on_text is not None and delta:
                    on_text(start + i, delta)
        return results

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> TextStream:
        """Text deltas of one prompt as they are decoded; the stream's ``result`` is set at the end."""
        ids, plist = self._prepare([prompt], params)
        return TextStream(self._run(ids, plist))

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    # ---- internals ----
    def _prepare(self, prompts, params) -> tuple[list[list[int]], list[SamplingParams]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        plist = [params or SamplingParams()] * len(prompts) if not isinstance(params, (list, tuple)) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [self.encode_prompt(p) for p in prompts]
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"prompt {i} is empty (0 tokens)")
            if len(row) > self.max_len:
                raise ValueError(f"prompt {i} has {len(row)} tokens, longer than the context of {self.max_len} "
                                 f"tokens (max_len; the model allows {self.cfg.max_position_embeddings})")
            bad = [t for t in row if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
        return ids, plist

    def _steps(self, batch: int, length: int) -> tuple[Callable, Callable]:
        if (batch, length) not in self._prefill:
            prefill, decode = make_step_fns(self.cfg, self.backend, batch, length, self.max_len)
            self._prefill[(batch, length)] = prefill
            self._decode.setdefault(batch, decode)  # one decode executable per batch bucket
        return self._prefill[(batch, length)], self._decode[batch]

    def _prefill_rows(self, state, prompts: list[list[int]], B: int):
        """Prefill every prompt chunk by chunk; returns (logits at each row's last prompt token, state)."""
        lens = np.zeros(B, np.int64)
        lens[:len(prompts)] = [len(p) for p in prompts]
        done, last_logits = 0, None
        while done < lens.max():
            n_new = np.clip(lens - done, 0, None)
            L = min(self.prefill_chunk, max(MIN_PREFILL_BUCKET, _pow2_at_least(n_new.max())), self.max_len)
            n_new = np.minimum(n_new, L)
            tokens = np.zeros((B, L), np.int32)
            for b, p in enumerate(prompts):
                chunk = p[done:done + n_new[b]]
                tokens[b, :len(chunk)] = chunk
            prefill, _ = self._steps(B, L)
            logits, state, self.expert_state = prefill(self.params, self.expert_state, state,
                                                       jnp.asarray(tokens), jnp.asarray(n_new, jnp.int32))
            ends_here = jnp.asarray((lens > done) & (lens <= done + L))
            last_logits = logits if last_logits is None else jnp.where(ends_here[:, None], logits, last_logits)
            done += L
        return last_logits, state

    def _run(self, prompts: list[list[int]], plist: list[SamplingParams]):
        """Generator: yields (row, text delta); returns the list of Results."""
        t0 = time.perf_counter()
        n = len(prompts)
        B = min(_pow2_at_least(n), _pow2_at_least(self.batch))
        rows = [_Row(len(p), sp, self.tokenizer.detokenizer(), self.eos_token_ids | frozenset(sp.stop_token_ids),
                     budget=min(sp.max_tokens, self.max_len - len(p) + 1)) for p, sp in zip(prompts, plist)]
        arrays = batch_arrays(plist, B)
        state = get_family(self.cfg).init_state(self.cfg, B, self.max_len, self.dtype)
        logits, state = self._prefill_rows(state, prompts, B)
        decode = self._decode[B]
        step = 0
        while True:
            ids = _sample_rows(logits, arrays["seeds"], jnp.int32(step), arrays["temperature"],
                               arrays["top_k"], arrays["top_p"])
            host_ids = np.asarray(ids)
            now = time.perf_counter()
            for b, row in enumerate(rows):
                if row.finish is None:
                    delta = row.push(int(host_ids[b]), now)
                    if delta:
                        yield b, delta
            active = np.array([row.finish is None for row in rows] + [False] * (B - n))
            if not active.any():
                break
            step += 1
            logits, state, self.expert_state = decode(self.params, self.expert_state, state, ids[:, None],
                                                      jnp.asarray(active, jnp.int32))
        return [row.result(t0) for row in rows]
