"""``FakeAccelerator``: a scripted stand-in for the model so the scheduler is testable fast.

Each row keeps the ids it was fed; the logits put all mass on ``next_token(history)``, a fixed
function of the row's whole history, so a correct scheduler produces the same tokens for a request
whatever else is batched with it and however its prompt is chunked. Every call is logged in
``calls`` (``("prefill", n_new)``, ``("decode", n_new)``, ``("reset", mask)``) for tests about
interleaving; ``step_delay_s`` slows steps down (cancellation, deadlines); ``fail_after`` makes the
n-th model step raise (error handling); ``fail_check_after`` makes `check_step` raise after the n-th
step (a fault found once the step's outputs were read, like a background fill that did not land).
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np

log = logging.getLogger(__name__)


class FakeAcceleratorError(RuntimeError):
    """The scripted failure of ``FakeAccelerator(fail_after=n)``."""


class FakeAccelerator:
    backend_name = "resident"

    def __init__(self, max_slots: int = 4, max_len: int = 128, vocab_size: int = 1024, *,
                 step_delay_s: float = 0.0, fail_after: int | None = None, fail_check_after: int | None = None,
                 avoid: frozenset[int] = frozenset()):
        self.max_slots, self.max_len, self.vocab_size = max_slots, max_len, vocab_size
        self.step_delay_s = step_delay_s
        self.fail_after = fail_after
        self.fail_check_after = fail_check_after
        self.avoid = avoid  # ids never produced (e.g. the tokenizer's eos), so streams run to max_tokens
        self.history: list[list[int]] = [[] for _ in range(max_slots)]
        self.calls: list[tuple[str, list]] = []
        self.steps = 0
        self._lock = threading.Lock()

    def next_token(self, history: list[int]) -> int:
        h = 7
        for t in history:
            h = (h * 131 + t + 1) % 1_000_003
        tid = h % self.vocab_size
        while tid in self.avoid:
            tid = (tid + 1) % self.vocab_size
        return tid

    def _step(self, kind: str, tokens: np.ndarray, n_new: np.ndarray) -> np.ndarray:
        with self._lock:
            self.steps += 1
            self.calls.append((kind, [int(n) for n in n_new]))
            if self.fail_after is not None and self.steps > self.fail_after:
                raise FakeAcceleratorError(f"scripted failure at step {self.steps}")
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            logits = np.zeros((self.max_slots, self.vocab_size), np.float32)
            for b in range(self.max_slots):
                n = int(n_new[b])
                if n == 0:
                    continue
                self.history[b].extend(int(t) for t in tokens[b, :n])
                if len(self.history[b]) > self.max_len:
                    raise FakeAcceleratorError(f"row {b} overflows max_len={self.max_len}")
                logits[b, self.next_token(self.history[b])] = 30.0
            return logits

    def prefill(self, tokens: np.ndarray, n_new: np.ndarray) -> np.ndarray:
        return self._step("prefill", np.asarray(tokens), np.asarray(n_new))

    def decode(self, tokens: np.ndarray, n_new: np.ndarray) -> np.ndarray:
        return self._step("decode", np.asarray(tokens)[:, None], np.asarray(n_new))

    def check_step(self) -> None:
        with self._lock:
            if self.fail_check_after is not None and self.steps > self.fail_check_after:
                raise FakeAcceleratorError(f"scripted fault found after step {self.steps}")

    def drain(self) -> None:
        self.calls.append(("drain", []))

    def reset(self, mask: np.ndarray) -> None:
        with self._lock:
            self.calls.append(("reset", [bool(m) for m in mask]))
            for b, m in enumerate(mask):
                if m:
                    self.history[b] = []

    def warmup(self) -> None:
        pass

    def memory(self) -> dict[str, int]:
        return {"params_bytes": 0, "kv_bytes": 0, "expert_cache_bytes": 0, "expert_pool_bytes": 0}
