"""``Engine``: the serving engine's Python API over the scheduler and an accelerator.

>>> with Engine.from_store(path, EngineConfig(max_slots=4)) as engine:
...     handle = engine.submit(Request(prompt="Hello", sampling=SamplingParams(max_tokens=16)))
...     for event in handle:
...         print(event.text, end="")

``submit`` validates a request (InvalidRequestError naming the field) and queues it (QueueFullError
past ``max_queue``); the scheduler thread (``ftjax.engine.scheduler``) batches it with the others.
``from_store_async`` returns at once and loads in a thread, so a server can report NOT_SERVING and
``load_progress`` meanwhile; requests submitted while loading wait in the queue.
"""
from __future__ import annotations

import logging
import operator
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence as Seq

import numpy as np

from ftjax.engine.api import (EngineConfig, EngineError, InvalidRequestError, QueueFullError, Request, RequestResult,
                              StreamEvent)
from ftjax.engine.handle import RequestHandle
from ftjax.engine.sampling import SamplingParams
from ftjax.engine.scheduler import Scheduler
from ftjax.engine.sequence import Sequence
from ftjax.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model=None, tokenizer: Tokenizer | None = None, config: EngineConfig | None = None, *,
                 accelerator=None, model_config=None, store_path: str | Path | None = None):
        """``Engine(loaded_model, tokenizer=None, config=None)`` runs a ``LoadedModel`` with every expert
        resident; ``Engine(accelerator=..., tokenizer=...)`` drives any Accelerator (e.g. the fake)."""
        self.config = config or EngineConfig()
        if not isinstance(self.config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(self.config).__name__}")
        if model is not None:
            model_config, store_path = model.config, model.path
            tokenizer = tokenizer or Tokenizer.from_dir(model.path)
        if tokenizer is None:
            raise ValueError("a tokenizer is needed (pass tokenizer=, or a model loaded from a store)")
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.store_path = None if store_path is None else str(store_path)
        if model_config is not None:
            self.max_len = self.config.resolve_max_len(model_config.max_position_embeddings)
            self.vocab_size = model_config.vocab_size
        elif accelerator is not None:
            self.max_len, self.vocab_size = accelerator.max_len, accelerator.vocab_size
        else:
            raise ValueError("pass a model, or an accelerator")
        eos = set(tokenizer.eos_token_ids) | set(model_config.eos_token_ids if model_config else ())
        self.eos_token_ids = frozenset(eos)
        self.scheduler = Scheduler(self.config.max_slots, self.config.prefill_chunk, self.config.max_queue)
        self.accelerator = None
        self._load_progress = 0.0
        self._ready = threading.Event()
        self._loader: threading.Thread | None = None
        self.load_error: BaseException | None = None
        if accelerator is None and model is not None:
            accelerator = self._build_accelerator(model)
        if accelerator is not None:
            self._attach(accelerator)

    # ---- construction ----
    @classmethod
    def from_store(cls, path: str | Path, config: EngineConfig | None = None) -> "Engine":
        """Load the FTW store at ``path`` (blocking) and build the engine."""
        from ftjax.ftw import load_store

        config = config or EngineConfig()
        return cls(load_store(path, dtype=config.dtype), config=config)

    @classmethod
    def from_store_async(cls, path: str | Path, config: EngineConfig | None = None) -> "Engine":
        """Read the manifest and tokenizer now, load the weights and compile in a thread: ``ready``
        turns True when done (``load_progress`` rises meanwhile; ``load_error`` is set on failure)."""
        from ftjax.ftw.load import open_store

        config = config or EngineConfig()
        root, _, cfg = open_store(path)
        engine = cls(None, Tokenizer.from_dir(root), config, model_config=cfg, store_path=root)
        engine._load_progress = 0.05
        engine._loader = threading.Thread(target=engine._load, args=(root,), name="ftjax-load", daemon=True)
        engine._loader.start()
        return engine

    def _load(self, root: Path) -> None:
        from ftjax.ftw import load_store

        try:
            model = load_store(root, dtype=self.config.dtype)
            self._load_progress = 0.7
            accel = self._build_accelerator(model)
            self._load_progress = 0.8
            accel.warmup()
            self._attach(accel)
            log.info("engine ready: %s", root)
        except Exception as e:
            log.exception("loading %s failed", root)
            self.load_error = e
            self.scheduler.fail(e)

    def _build_accelerator(self, model):
        from ftjax.engine.accelerator import ModelAccelerator

        from ftjax.experts.runtime import OffloadConfig

        return ModelAccelerator(model, self.config.max_slots, self.max_len, self.config.prefill_chunk,
                                self.config.dtype, OffloadConfig(self.config.policy, self.config.vram_gib,
                                                              online=self.config.online_split,
                                                              kernel=self.config.expert_kernel,
                                                              background_fills=self.config.background_fills,
                                                              unit_split=self.config.unit_split,
                                                              down_layout=self.config.down_layout))

    def _attach(self, accelerator) -> None:
        if accelerator.max_slots != self.config.max_slots:
            raise ValueError(f"the accelerator has {accelerator.max_slots} slots, the config max_slots="
                             f"{self.config.max_slots}")
        self.accelerator = accelerator
        self.scheduler.attach(accelerator)
        self._load_progress = 1.0
        self._ready.set()

    # ---- lifecycle ----
    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def load_progress(self) -> float:
        return self._load_progress

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def warmup(self) -> None:
        """Compile every executable now (else the first requests compile them)."""
        if self.accelerator is None:
            raise EngineError("the model is not loaded yet")
        self.accelerator.warmup()

    def start(self) -> "Engine":
        self.scheduler.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        self.scheduler.stop(timeout)
        drain = getattr(self.accelerator, "drain", None)  # optional verb (Accelerator)
        if drain is not None:  # no step runs now: let the last background fills land
            drain()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- requests ----
    def submit(self, request: Request) -> RequestHandle:
        """Validate and queue ``request`` (starting the engine if needed); returns its handle (iterate it
        for StreamEvents)."""
        return self._enqueue(self._sequence(request))

    def _enqueue(self, seq: Sequence) -> RequestHandle:
        self.start()
        handle = RequestHandle(seq.request_id, seq.prompt_len, self.scheduler.cancel)
        self.scheduler.enqueue(seq, handle)
        return handle

    def generate(self, prompts: Seq[str | Seq[int]], sampling: SamplingParams | Seq[SamplingParams] | None = None,
                 on_event: Callable[[int, StreamEvent], Any] | None = None) -> list[RequestResult]:
        """Run every prompt (text or ids) to the end; results in prompt order. Starts the engine if needed.
        ``on_event(i, event)`` sees the stream of prompt ``i`` (prompt by prompt, in order)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        plist = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError("sampling", f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        reqs = [Request(prompt=p, sampling=sp) if isinstance(p, str) else Request(prompt_ids=list(p), sampling=sp)
                for p, sp in zip(prompts, plist)]
        seqs = [self._sequence(r) for r in reqs]  # validate every request before running any
        handles: list[RequestHandle] = []
        for seq in seqs:
            while True:
                try:
                    handles.append(self._enqueue(seq))
                    break
                except QueueFullError:  # wait for one of ours to finish, then retry
                    next(h for h in handles if not h.done).result()
        if on_event is not None:
            for i, h in enumerate(handles):
                for event in h:
                    on_event(i, event)
        return [h.result() for h in handles]

    def _sequence(self, r: Request) -> Sequence:
        if not isinstance(r, Request):
            raise TypeError(f"submit takes a Request, got {type(r).__name__}")
        if not isinstance(r.sampling, SamplingParams):
            raise InvalidRequestError("sampling", f"must be a SamplingParams, got {type(r.sampling).__name__}")
        if r.request_id is not None and (not isinstance(r.request_id, str) or not r.request_id):
            raise InvalidRequestError("request_id", f"must be a non-empty string, got {r.request_id!r}")
        if r.deadline_s is not None and (isinstance(r.deadline_s, bool) or not isinstance(r.deadline_s, (int, float))):
            raise InvalidRequestError("deadline_s", f"must be a time.monotonic() time, got {r.deadline_s!r}")
        if (r.prompt is None) == (r.prompt_ids is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt (text) and prompt_ids")
        if r.prompt is not None:
            field = "prompt"
            if not isinstance(r.prompt, str):
                raise InvalidRequestError(field, f"must be a string, got {type(r.prompt).__name__}")
            ids = self.tokenizer.encode(r.prompt)
        else:
            field = "prompt_ids"
            ids = _as_ids(r.prompt_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(field, f"token ids outside [0, {self.vocab_size}): {bad[:5]}")
        if not ids:
            raise InvalidRequestError(field, "the prompt is empty (0 tokens)")
        if len(ids) >= self.max_len:
            raise InvalidRequestError(field, f"the prompt has {len(ids)} tokens, longer than the context of "
                                      f"{self.max_len} tokens minus one generated token (max_len)")
        if len(ids) + r.sampling.max_tokens > self.max_len:
            raise InvalidRequestError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens "
                                      f"({r.sampling.max_tokens}) is over the context of {self.max_len} tokens "
                                      f"(max_len); max_tokens must be <= {self.max_len - len(ids)}")
        return Sequence(r.request_id or uuid.uuid4().hex, ids, r.sampling, self.tokenizer.detokenizer(),
                        self.eos_token_ids, time.monotonic(), r.deadline_s)

    # ---- introspection ----
    def model_info(self) -> dict[str, Any]:
        cfg = self.model_config
        dtype = self.config.dtype or (str(self.accelerator.dtype) if hasattr(self.accelerator, "dtype") else None)
        return {
            "model_type": cfg.model_type if cfg else "fake", "family": cfg.family if cfg else "fake",
            "layers": cfg.num_layers if cfg else 0, "experts": cfg.num_experts if cfg else 0,
            "top_k": cfg.num_experts_per_tok if cfg else 0, "vocab": self.vocab_size, "max_len": self.max_len,
            "max_slots": self.config.max_slots, "dtype": dtype, "store_path": self.store_path,
        }

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        counts = dict(s.counts)
        out: dict[str, Any] = s.snapshot()
        for key in ("completed", "cancelled", "errors", "tokens_generated", "prompt_tokens", "steps"):
            out[key] = counts.get(key, 0)
        out["uptime_s"] = time.monotonic() - s.t_start
        cfg = self.model_config
        routes = counts.get("model_tokens", 0) * (cfg.num_experts_per_tok * cfg.num_layers if cfg else 1)
        out["experts"] = {"backend": getattr(self.accelerator, "backend_name", "resident"), "hits": routes,
                          "misses": 0, "fills": 0, "cpu_experts": 0}
        mem = self.accelerator.memory() if self.accelerator is not None else {}
        out["memory"] = {k: mem.get(k, 0) for k in ("params_bytes", "kv_bytes", "expert_cache_bytes",
                                                    "expert_pool_bytes")}
        out["bandwidth"] = {"b_pcie_gbps": None, "b_host_gbps": None}
        reader = getattr(self.accelerator, "expert_stats", None)
        info = getattr(self.accelerator, "expert_info", {}) or {}
        if reader is not None and info.get("num_slots") is not None:  # the offload runtime's device counters
            out["experts"] = {"backend": self.accelerator.backend_name, "num_slots": info["num_slots"],
                              **reader.summary()}
            out["bandwidth"] = self.accelerator.bandwidth()
        return out


def _as_ids(prompt_ids) -> list[int]:
    """Token ids from a list, a numpy array or a JAX array (1-D, integer)."""
    if hasattr(prompt_ids, "__array__") and not isinstance(prompt_ids, (list, tuple)):
        arr = np.asarray(prompt_ids)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise InvalidRequestError("prompt_ids", f"must be a 1-D array of integers, got {arr.dtype} "
                                      f"{list(arr.shape)}")
        return arr.tolist()
    try:
        ids = [operator.index(t) for t in prompt_ids]
    except TypeError:
        ids = None
    if ids is None or any(isinstance(t, bool) for t in prompt_ids):
        raise InvalidRequestError("prompt_ids", f"must be a list of integer token ids, got {prompt_ids!r:.80}")
    return ids
