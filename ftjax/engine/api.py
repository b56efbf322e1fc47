"""The engine's public data types: configuration, requests, stream events, results, errors.

These are the contract between the engine, the gRPC server (``ftjax.serve``) and the CLI; change
them only compatibly (new fields with defaults).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ftjax.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_MAX_LEN = 4096
FINISH_REASONS = ("stop", "length", "cancelled", "error")
DTYPES = {None: None, "bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}


class EngineError(RuntimeError):
    """The engine cannot serve (not loaded, stopped, failed to load)."""


class QueueFullError(EngineError):
    """``max_queue`` requests are already waiting for a slot; retry later."""


class InvalidRequestError(ValueError):
    """A request that can never run: ``field`` names the offending field (``prompt``, ``prompt_ids``,
    ``max_tokens``, ``sampling``, ``deadline_s``, ``request_id``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine batches.

    max_slots: requests decoded together (the batch of the one decode executable).
    max_len: context length per slot (prompt + generated tokens); None = min(4096, the model's
        max_position_embeddings).
    prefill_chunk: most prompt tokens per slot in one prefill step; longer prompts are prefilled
        in chunks between decode steps so running streams keep flowing.
    max_queue: most requests waiting for a slot; ``submit`` raises QueueFullError beyond it.
    dtype: cast the weights and the KV state ("bf16" | "fp32"); None = the store's dtype.
    policy: expert placement (``ftjax.experts.policies``: lru-split, lru-fill, cpu, static, resident);
        None = every expert resident as plain device banks (lru-split when ``vram_gib`` is set).
    vram_gib: GPU memory for the expert slot cache; None = room for the whole pool.
    online_split: under lru-split, refine the fill fraction from measured decode step times
        (``ftjax.experts.bandwidth.SplitController``); False keeps the calibration profile's.
    expert_kernel: device-side expert code, "jnp" (default) or "pallas" (Mosaic GPU kernels, bf16).
    background_fills: under lru-split, a decode call the CPU serves faster than the split computes its
        misses on the CPU and fills them beside the next step (``OffloadExperts.defer_fills``); None =
        on the GPU, off on the CPU.
    unit_split: with background fills, such a call fills its experts' first units now and the CPU computes
        the rest (``OffloadExperts.unit_split``); None = on the GPU with the jnp kernel (bf16/f32 pools).
    down_layout: the host expert pool's down bank, "hi" (torch's [H, I]) or "ih" (stored transposed: the unit
        split's CPU share reads whole rows, gate/up and down in one pass); None = "hi".
    """

    max_slots: int = 4
    max_len: int | None = None
    prefill_chunk: int = 256
    max_queue: int = 64
    dtype: str | None = None
    policy: str | None = None
    vram_gib: float | None = None
    online_split: bool = True
    expert_kernel: str = "jnp"
    background_fills: bool | None = None
    unit_split: bool | None = None
    down_layout: str | None = None

    def __post_init__(self):
        from ftjax.experts.runtime import OffloadConfig

        OffloadConfig(self.policy, self.vram_gib, kernel=self.expert_kernel,  # validates them
                      background_fills=self.background_fills, unit_split=self.unit_split,
                      down_layout=self.down_layout)
        _check_int("max_slots", self.max_slots, 1)
        if self.max_len is not None:
            _check_int("max_len", self.max_len, 2)
        _check_int("prefill_chunk", self.prefill_chunk, 1)
        _check_int("max_queue", self.max_queue, 1)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not valid; dtype must be one of "
                             f"{[d for d in DTYPES if d]} or None (the store's dtype)")

    def resolve_max_len(self, max_position_embeddings: int) -> int:
        if self.max_len is None:
            return min(DEFAULT_MAX_LEN, max_position_embeddings)
        if self.max_len > max_position_embeddings:
            raise ValueError(f"max_len={self.max_len} is out of range; max_len must be in "
                             f"[2, {max_position_embeddings}] (the model's max_position_embeddings)")
        return self.max_len


def _check_int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} is not valid; {name} must be an integer >= {lo}")
    if value < lo:
        raise ValueError(f"{name}={value!r} is out of range; {name} must be an integer >= {lo}")


@dataclasses.dataclass
class Request:
    """One generation request: a text prompt or token ids (exactly one of them).

    deadline_s: absolute ``time.monotonic()`` time; past it the request finishes "cancelled".
    """

    prompt: str | None = None
    prompt_ids: list[int] | None = None
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    request_id: str | None = None
    deadline_s: float | None = None


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """One step of a request's stream: the new token ids, the text they release (a delta; text may
    lag the ids while a stop string or a multi-byte character is pending), and on the last event
    ``finished=True`` with a ``finish_reason`` in FINISH_REASONS."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None


@dataclasses.dataclass(frozen=True)
class RequestResult:
    """A finished request. ``token_ids`` are the generated ids (including a stop id that ended it);
    ``text`` is their text, cut before a stop string. ``ttft_s`` runs from submit to the first token;
    ``decode_tok_s`` counts the tokens after the first per second (0 with fewer than two)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    decode_tok_s: float
