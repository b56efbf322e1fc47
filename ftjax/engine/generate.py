"""``Generator``: the CLI's batch/stream front end, a thin facade over :class:`ftjax.engine.Engine`.

There is one decode loop, the engine's scheduler; this module only adapts the older call style
(``generate(prompts, params, on_text)``, ``stream(prompt, params)``) and clips ``max_tokens`` to the
room left in the context, so a long prompt ends with finish_reason "length" instead of an error.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterator, Sequence

from ftjax.engine.api import DEFAULT_MAX_LEN, EngineConfig, InvalidRequestError, Request, RequestResult
from ftjax.engine.engine import Engine
from ftjax.engine.handle import RequestHandle
from ftjax.engine.sampling import SamplingParams
from ftjax.tokenizer import Tokenizer

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_LEN", "Generator", "Result", "TextStream"]

Result = RequestResult  # the older name
TextCallback = Callable[[int, str], None]  # (prompt index, text delta)


class TextStream:
    """Iterator of the text deltas of one request; ``result`` is set once it is exhausted."""

    def __init__(self, handle: RequestHandle):
        self._handle = handle
        self.result: RequestResult | None = None

    def __iter__(self) -> Iterator[str]:
        for event in self._handle:
            if event.text:
                yield event.text
        self.result = self._handle.result()


class Generator:
    """Generate text from a ``LoadedModel`` (``ftjax.ftw.load_store``) with every expert on the device;
    ``batch`` requests are decoded together (the engine's slots)."""

    def __init__(self, model, tokenizer: Tokenizer | None = None, *, batch: int = 1, max_len: int | None = None,
                 prefill_chunk: int = 256, policy: str | None = None, vram_gib: float | None = None,
                 online_split: bool = True, expert_kernel: str = "jnp", background_fills: bool | None = None,
                 unit_split: bool | None = None, down_layout: str | None = None):
        config = EngineConfig(max_slots=batch, max_len=max_len, prefill_chunk=prefill_chunk, policy=policy,
                              vram_gib=vram_gib, online_split=online_split, expert_kernel=expert_kernel,
                              background_fills=background_fills, unit_split=unit_split, down_layout=down_layout)
        self.engine = Engine(model, tokenizer, config)
        self.cfg, self.batch, self.max_len = model.config, batch, self.engine.max_len
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_text: TextCallback | None = None) -> list[RequestResult]:
        """Generate for every prompt (text, or token ids); ``on_text(i, delta)`` streams the text."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError("sampling", f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [self.encode_prompt(p) for p in prompts]
        events = None if on_text is None else (lambda i, ev: ev.text and on_text(i, ev.text))
        return self.engine.generate(ids, [self._fit(p, sp) for p, sp in zip(ids, plist)], on_event=events)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> TextStream:
        """Text deltas of one prompt as they are decoded; the stream's ``result`` is set at the end."""
        ids = self.encode_prompt(prompt)
        self.engine.start()
        return TextStream(self.engine.submit(Request(prompt_ids=ids, sampling=self._fit(ids, params))))

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    def close(self) -> None:
        self.engine.stop()

    def _fit(self, ids: list[int], params: SamplingParams | None) -> SamplingParams:
        params = params or SamplingParams()
        room = self.max_len - len(ids)
        return dataclasses.replace(params, max_tokens=room) if 1 <= room < params.max_tokens else params
