"""Host-side progress of one request: its ids, the text released so far, stop checks and timing.

The scheduler pushes each sampled id; ``push`` returns the StreamEvent to publish. Text that could
still turn out to be the start of a stop string is held back until it cannot (or the stream ends),
so the concatenated deltas always equal the final text.
"""
from __future__ import annotations

import logging
import time

from ftjax.engine.api import RequestResult, StreamEvent
from ftjax.engine.sampling import SamplingParams
from ftjax.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 detok: IncrementalDetokenizer, eos_ids: frozenset[int], submit_time: float,
                 deadline_s: float | None = None):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.detok = detok
        self.stop_ids = eos_ids | frozenset(params.stop_token_ids)
        self.submit_time = submit_time
        self.deadline_s = deadline_s
        self.ids: list[int] = []
        self.emitted = 0  # characters of detok.text already released
        self.finish_reason: str | None = None
        self.t_first = self.t_last = 0.0
        self._hold = max((len(s) for s in params.stop), default=1) - 1  # a stop string may be mid-way

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, tid: int, now: float | None = None) -> StreamEvent:
        """Record one sampled id; return the event it makes (finished when it ends the request)."""
        now = time.monotonic() if now is None else now
        if not self.ids:
            self.t_first = now
        self.t_last = now
        self.ids.append(tid)
        if tid in self.stop_ids:
            self.finish_reason = "stop"
            delta = self.detok.flush()
        else:
            delta = self.detok.add(tid)
            if len(self.ids) >= self.params.max_tokens:
                self.finish_reason = "length"
                delta += self.detok.flush()
        text = self._release(delta)
        return StreamEvent([tid], text, self.finished, self.finish_reason)

    def end(self, reason: str) -> StreamEvent:
        """Finish early (cancelled, deadline, error): release the held text with the final event."""
        self.finish_reason = reason
        self.detok.flush()
        return StreamEvent([], self._release(""), True, reason)

    def _release(self, delta: str) -> str:
        text = self.detok.text
        if delta and self.params.stop:
            start = max(0, self.emitted - self._hold)
            hits = [i for i in (text.find(s, start) for s in self.params.stop) if i >= 0]
            if hits:
                self.detok.text = text = text[:min(hits)]
                self.finish_reason = "stop"
        end = len(text) if self.finished else max(self.emitted, len(text) - self._hold)
        out, self.emitted = text[self.emitted:end], end
        return out

    def result(self) -> RequestResult:
        n = len(self.ids)
        rate = (n - 1) / (self.t_last - self.t_first) if n > 1 and self.t_last > self.t_first else 0.0
        ttft = self.t_first - self.submit_time if n else 0.0
        return RequestResult(request_id=self.request_id, text=self.detok.text, token_ids=list(self.ids),
                             finish_reason=self.finish_reason or "length", prompt_tokens=self.prompt_len,
                             completion_tokens=n, ttft_s=ttft, decode_tok_s=rate)
