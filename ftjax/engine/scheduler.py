"""The scheduler: one thread, a bounded queue, ``max_slots`` slots, continuous batching.

One iteration (``_iterate``), readable in one screen:

1. end the requests that were cancelled or passed their deadline (their slots are free at once);
2. admit queued requests into free slots (one ``reset`` of their rows);
3. if some slots are still prefilling: one prefill chunk (at most ``prefill_chunk`` prompt tokens per
   slot); the slots whose prompt is complete sample their first token;
4. if some slots are decoding: one decode step over every decoding slot.

So a long prompt is prefilled chunk by chunk between decode steps and running streams keep flowing.
Every shape is fixed (decode is ``[max_slots]``, prefill ``[max_slots, bucket]``); idle slots ride along
with ``n_new = 0``. Sampling keys come from each request's seed and its own token index, so tokens do
not depend on the batch a request shares.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any

import numpy as np

from ftjax.engine.api import EngineError, QueueFullError, StreamEvent
from ftjax.engine.handle import RequestHandle
from ftjax.engine.sampling import sample_rows
from ftjax.engine.sequence import Sequence

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # how often a waiting scheduler checks the deadlines of queued requests


@dataclasses.dataclass
class _Slot:
    seq: Sequence
    handle: RequestHandle
    prefilled: int = 0  # prompt tokens already in the cache
    pending: int | None = None  # the last sampled id, fed by the next decode step

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.seq.prompt_len


class Scheduler:
    def __init__(self, max_slots: int, prefill_chunk: int, max_queue: int):
        self.max_slots, self.prefill_chunk, self.max_queue = max_slots, prefill_chunk, max_queue
        self.accel: Any = None  # set by attach() once the model is loaded
        self.slots: list[_Slot | None] = [None] * max_slots
        self._queue: collections.deque[tuple[Sequence, RequestHandle]] = collections.deque()
        self._cancel: set[RequestHandle] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._load_error: BaseException | None = None
        self.t_start = time.monotonic()
        self.counts = collections.Counter()  # completed, cancelled, errors, tokens_generated, ...

    # ---- control (any thread) ----
    def attach(self, accel) -> None:
        with self._cond:
            self.accel = accel
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The model could not be loaded: end every queued request with "error"."""
        with self._cond:
            self._load_error = error
            queued, self._queue = list(self._queue), collections.deque()
        for seq, handle in queued:
            self._finish(seq, handle, "error")

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            if self._stopping:
                raise EngineError("the engine was stopped; create a new one")
            self._thread = threading.Thread(target=self._run, name="ftjax-scheduler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread; requests still queued or running finish "cancelled"."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._cond:
            queued, self._queue = list(self._queue), collections.deque()
        for seq, handle in queued:
            self._finish(seq, handle, "cancelled")
        for b, slot in enumerate(self.slots):
            if slot is not None:
                self._free(b, "cancelled")

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def enqueue(self, seq: Sequence, handle: RequestHandle) -> None:
        with self._cond:
            if self._stopping:
                raise EngineError("the engine is stopped")
            if self._load_error is not None:
                raise EngineError(f"the model failed to load: {self._load_error}")
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(f"{len(self._queue)} requests are waiting (max_queue={self.max_queue}); "
                                     "retry later")
            self._queue.append((seq, handle))
            self._cond.notify_all()

    def cancel(self, handle: RequestHandle) -> None:
        with self._cond:
            self._cancel.add(handle)
            self._cond.notify_all()

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            active = sum(s is not None for s in self.slots)
            return {"active_slots": active, "free_slots": self.max_slots - active, "queued": len(self._queue)}

    # ---- the scheduler thread ----
    def _run(self) -> None:
        log.info("scheduler started: %d slots, prefill chunk %d", self.max_slots, self.prefill_chunk)
        while True:
            with self._cond:
                while not self._stopping and not self._has_work():
                    self._expire_queued()
                    self._cond.wait(IDLE_POLL_S if self._queue else None)
                if self._stopping:
                    break
                cancels, self._cancel = self._cancel, set()
            try:
                self._iterate(cancels)
            except Exception as e:  # a failed step ends the requests it carried, not the engine
                log.exception("engine step failed")
                self._fail_active(e)
        log.info("scheduler stopped")

    def _has_work(self) -> bool:
        if self.accel is None:
            return False
        return bool(self._queue or self._cancel or any(s is not None for s in self.slots))

    def _iterate(self, cancels: set[RequestHandle]) -> None:
        now = time.monotonic()
        for b, slot in enumerate(self.slots):
            if slot is not None and (slot.handle in cancels or _past(slot.seq, now)):
                self._free(b, "cancelled")
        self._admit(cancels)
        if any(s is not None and s.prefilling for s in self.slots):
            self._prefill_chunk()
        if any(s is not None and s.pending is not None for s in self.slots):
            self._decode_step()

    def _admit(self, cancels: set[RequestHandle]) -> None:
        with self._cond:
            self._expire_queued(cancels)
            fresh = np.zeros(self.max_slots, bool)
            for b in range(self.max_slots):
                if self.slots[b] is None and self._queue:
                    seq, handle = self._queue.popleft()
                    self.slots[b] = _Slot(seq, handle)
                    fresh[b] = True
        if fresh.any():
            self.accel.reset(fresh)

    def _expire_queued(self, cancels: set[RequestHandle] = frozenset()) -> None:
        """Drop cancelled and expired requests from the queue (called holding the lock)."""
        now = time.monotonic()
        gone = [(s, h) for s, h in self._queue if h in cancels or h in self._cancel or _past(s, now)]
        for item in gone:
            self._queue.remove(item)
            self._cancel.discard(item[1])
            self._finish(*item, "cancelled")

    def _prefill_chunk(self) -> None:
        n_new = np.zeros(self.max_slots, np.int32)
        for b, s in enumerate(self.slots):
            if s is not None and s.prefilling:
                n_new[b] = min(self.prefill_chunk, s.seq.prompt_len - s.prefilled)
        tokens = np.zeros((self.max_slots, int(n_new.max())), np.int32)
        for b, s in enumerate(self.slots):
            if n_new[b]:
                tokens[b, :n_new[b]] = s.seq.prompt_ids[s.prefilled:s.prefilled + n_new[b]]
        logits = self.accel.prefill(tokens, n_new)
        self._count_step(n_new)
        self.counts["prompt_tokens"] += int(n_new.sum())
        done = np.zeros(self.max_slots, bool)
        for b, s in enumerate(self.slots):
            if n_new[b]:
                s.prefilled += int(n_new[b])
                done[b] = not s.prefilling
        if done.any():
            self._sample_and_push(logits, done)

    def _decode_step(self) -> None:
        n_new = np.zeros(self.max_slots, np.int32)
        tokens = np.zeros(self.max_slots, np.int32)
        for b, s in enumerate(self.slots):
            if s is not None and s.pending is not None:
                n_new[b], tokens[b] = 1, s.pending
        logits = self.accel.decode(tokens, n_new)
        self._count_step(n_new)
        self._sample_and_push(logits, n_new.astype(bool))

    def _sample_and_push(self, logits, rows: np.ndarray) -> None:
        """Sample one id for each row in ``rows``, publish it and free the rows that finished."""
        S = self.max_slots
        temperature, top_p = np.zeros(S, np.float32), np.ones(S, np.float32)
        top_k, seeds, steps = np.zeros(S, np.int32), np.zeros(S, np.uint32), np.zeros(S, np.int32)
        for b in np.flatnonzero(rows):
            p = self.slots[b].seq.params
            temperature[b], top_k[b], top_p[b], seeds[b] = p.temperature, p.top_k, p.top_p, p.seed
            steps[b] = len(self.slots[b].seq.ids)
        ids = np.asarray(sample_rows(logits, seeds, steps, temperature, top_k, top_p))
        check = getattr(self.accel, "check_step", None)  # optional verb (Accelerator)
        if check is not None:  # the step is done on the device: publish nothing it got wrong
            check()
        now = time.monotonic()
        for b in np.flatnonzero(rows):
            slot = self.slots[b]
            event = slot.seq.push(int(ids[b]), now)
            self.counts["tokens_generated"] += 1
            if event.finished:
                self.slots[b] = None
                self._publish_final(slot.seq, slot.handle, event)
            else:
                slot.pending = int(ids[b])
                slot.handle._publish(event)

    # ---- endings ----
    def _free(self, b: int, reason: str) -> None:
        slot, self.slots[b] = self.slots[b], None
        self._finish(slot.seq, slot.handle, reason)

    def _finish(self, seq: Sequence, handle: RequestHandle, reason: str) -> None:
        self._publish_final(seq, handle, seq.end(reason))

    def _publish_final(self, seq: Sequence, handle: RequestHandle, event: StreamEvent) -> None:
        key = {"stop": "completed", "length": "completed", "cancelled": "cancelled", "error": "errors"}
        self.counts[key[event.finish_reason]] += 1
        handle._publish(event, seq.result())
        log.debug("request %s finished: %s, %d tokens", seq.request_id, event.finish_reason, len(seq.ids))

    def _fail_active(self, error: Exception) -> None:
        for b, slot in enumerate(self.slots):
            if slot is not None:
                log.warning("request %s ends with an error: %s", slot.seq.request_id, error)
                self._free(b, "error")

    def _count_step(self, n_new: np.ndarray) -> None:
        self.counts["steps"] += 1
        self.counts["model_tokens"] += int(n_new.sum())


def _past(seq: Sequence, now: float) -> bool:
    return seq.deadline_s is not None and now >= seq.deadline_s
