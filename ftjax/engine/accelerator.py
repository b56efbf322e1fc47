"""The accelerator side of the engine: a few verbs over a fixed set of slots (JetStream's split).

An ``Accelerator`` owns the device state of ``max_slots`` rows (KV cache, recurrent state, the expert
state) and exposes:

- ``prefill(tokens [S, T], n_new [S]) -> logits [S, V]``: append a chunk of prompt tokens to the rows
  with ``n_new > 0`` (logits at each row's last new token). ``ModelAccelerator`` prefills row by row
  at batch 1 into the slot (JetStream's prefill + insert): no compute on idle rows, and a row's numbers
  do not depend on the other rows;
- ``decode(tokens [S], n_new [S]) -> logits [S, V]``: append one token to the rows with ``n_new == 1``;
- ``reset(mask [S])``: empty the masked rows so a new request can use them.

Rows with ``n_new == 0`` are untouched by every verb, so idle and prefilling slots sit inside a decode
batch. The scheduler (``ftjax.engine.scheduler``) drives it; ``ftjax.engine.fake`` is a scripted
stand-in for tests. ``ModelAccelerator`` runs a loaded model with every expert resident.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ftjax.experts.resident import ResidentExperts
from ftjax.models import get_family, make_step_fns

log = logging.getLogger(__name__)

MIN_PREFILL_BUCKET = 8


class Accelerator(Protocol):
    max_slots: int
    max_len: int
    vocab_size: int

    def prefill(self, tokens: np.ndarray, n_new: np.ndarray) -> Any: ...

    def decode(self, tokens: np.ndarray, n_new: np.ndarray) -> Any: ...

    def reset(self, mask: np.ndarray) -> None: ...

    def warmup(self) -> None: ...

    def memory(self) -> dict[str, int]: ...

    # Optional (the engine calls them where present):
    def check_step(self) -> None: ...  # after the host read a step's outputs: raise if it went wrong

    def drain(self) -> None: ...  # before the states are dropped: no device work still writes them


def pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def prefill_buckets(prefill_chunk: int, max_len: int) -> list[int]:
    """Chunk lengths with an executable each: powers of two from 8, capped by the chunk and max_len."""
    top = min(prefill_chunk, max_len)
    out, b = [], min(MIN_PREFILL_BUCKET, top)
    while b < top:
        out.append(b)
        b *= 2
    return out + [top]


def _reset_rows_impl(state, mask):
    """Zero ``lengths`` and the recurrent (GDN conv/rec) rows of the masked slots. KV rows stay:
    attention reads only positions below the row's length."""
    def clear(x):
        m = mask.reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.where(m, jnp.zeros_like(x), x)

    layers = [{k: (clear(v) if k in ("conv", "rec") else v) for k, v in layer.items()}
              for layer in state["layers"]]
    return {"lengths": clear(state["lengths"]), "layers": layers}


reset_rows = jax.jit(_reset_rows_impl, donate_argnums=(0,))


def make_row_prefill(cfg, backend, length: int):
    """Jitted ``(params, expert_state, state, row, tokens [1, length], n_new [1]) -> (logits [V], state,
    expert_state)``: prefill one slot of the batched state in place (state and expert state donated)."""
    fwd = functools.partial(get_family(cfg).forward, cfg=cfg, backend=backend)

    def step(params, expert_state, state, row, tokens, n_new):
        sub = jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, row, 1), state)
        logits, sub, expert_state = fwd(params, expert_state, sub, tokens, n_new)
        state = jax.tree.map(lambda x, y: lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), row, 0), state, sub)
        return logits[0], state, expert_state

    return jax.jit(step, donate_argnums=(1, 2))


def _cast_tree(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


class ModelAccelerator:
    """A loaded model (``ftjax.ftw.load_store``) with every expert resident on the device."""

    backend_name = "resident"

    def __init__(self, model, max_slots: int, max_len: int, prefill_chunk: int, dtype: str | None = None,
                 offload=None):
        from ftjax.experts.runtime import OffloadConfig, build_backend
        from ftjax.experts.stats import ExpertStats

        cfg = model.config
        self.cfg, self.max_slots, self.max_len = cfg, max_slots, max_len
        self.vocab_size = cfg.vocab_size
        self.buckets = prefill_buckets(prefill_chunk, max_len)
        jdtype = {None: None, "bf16": jnp.bfloat16, "fp32": jnp.float32}[dtype]
        self.params = model.params if jdtype is None else _cast_tree(model.params, jdtype)
        self.offload = offload or OffloadConfig()
        self.backend, self.expert_state, self.expert_info = build_backend(
            cfg, model.experts, self.offload, pool=getattr(model, "pool", None), max_tokens=prefill_chunk, dtype=jdtype)
        self.backend_name = self.expert_info["policy"] if self.offload.offloaded else "resident"
        self._banks, self._jdtype = model.experts, jdtype
        self.expert_stats = ExpertStats()
        self.split = self._split_controller()
        self._hot_frozen = False
        self.pool_bytes = int(sum(b.nbytes for b in model.experts.values()))
        self.dtype = jnp.asarray(self.params["embed"]).dtype
        self.state = get_family(cfg).init_state(cfg, max_slots, max_len, self.dtype)
        nbytes = lambda tree: int(sum(x.nbytes for x in jax.tree.leaves(tree)))  # noqa: E731
        self._memory = {"params_bytes": nbytes(self.params), "kv_bytes": nbytes(self.state),
                        "expert_cache_bytes": nbytes(self.expert_state), "expert_pool_bytes": self.pool_bytes}
        self._prefill = {length: make_row_prefill(cfg, self.backend, length) for length in self.buckets}
        # stable_io: the step graph is not re-recorded each step; the scheduler samples each step's logits
        # before the next decode call, as that call reuses their buffer.
        _, self._decode = make_step_fns(cfg, self.backend, max_slots, 1, max_len, stable_io=True)

    def _split_controller(self):
        """Online refinement of the miss split (lru-split with ``online``): None for other policies."""
        from ftjax.experts.bandwidth import OnlineSplitTuner, SplitController

        policy = getattr(self.backend, "policy", None)
        if not (self.offload.online and policy is not None and policy.decode_rule == "balance"):
            return None
        split = SplitController(OnlineSplitTuner(self.expert_info["bandwidth"]))
        self._set_fill_fraction(split.fraction)
        return split

    def _set_fill_fraction(self, f: float) -> None:
        self.expert_state = dict(self.expert_state, fill_fraction=jnp.asarray(f, jnp.float32))

    def bandwidth(self) -> dict | None:
        """B_P / B_H in use (online-refined under lru-split), None without an offloaded backend."""
        if self.split is not None:
            return self.split.to_dict()
        band = self.expert_info.get("bandwidth")
        return None if band is None else band.to_dict()

    def prefill(self, tokens: np.ndarray, n_new: np.ndarray):
        if self.split is not None:
            self.split.on_prefill()
        rows = {}
        for b in np.flatnonzero(n_new):
            n = int(n_new[b])
            length = next(L for L in self.buckets if L >= n)
            row_tokens = np.zeros((1, length), np.int32)
            row_tokens[0, :n] = tokens[b, :n]
            rows[b] = self._run(self._prefill[length], jnp.int32(b), row_tokens, np.array([n], np.int32))
        if rows and not self._hot_frozen and hasattr(self.backend, "freeze_hot_set"):
            # static policy: the hot set is taken from the first prefill's histogram, then fixed
            self.expert_state, self._hot_frozen = self.backend.freeze_hot_set(self.expert_state), True
        if not rows:
            return jnp.zeros((self.max_slots, self.vocab_size), jnp.float32)
        zero = jnp.zeros_like(next(iter(rows.values())))
        return jnp.stack([rows.get(b, zero) for b in range(self.max_slots)])

    def decode(self, tokens: np.ndarray, n_new: np.ndarray):
        logits = self._run(self._decode, np.asarray(tokens)[:, None], n_new)
        self.expert_stats.after_step(self.expert_state)
        if self.split is not None:
            f = self.split.after_decode(*self.expert_stats.misses())
            if f is not None:
                self._set_fill_fraction(f)
        return logits

    def _run(self, step, *args):
        *head, tokens, n_new = args
        try:
            logits, self.state, self.expert_state = step(self.params, self.expert_state, self.state, *head,
                                                         jnp.asarray(tokens, jnp.int32), jnp.asarray(n_new, jnp.int32))
        except Exception:
            # The donated state may be gone: start from empty slots (the scheduler fails their requests).
            log.warning("step failed; re-initialising the slot state")
            self._fresh_states()
            raise
        return logits

    def _fresh_states(self) -> None:
        self.state = get_family(self.cfg).init_state(self.cfg, self.max_slots, self.max_len, self.dtype)
        if self.offload.offloaded:
            f = self.split.fraction if self.split is not None else self.expert_info["bandwidth"].fill_fraction
            self.expert_state = self.backend.init_state(f)
        else:
            self.expert_state = ResidentExperts.init_state(self._banks, dtype=self._jdtype)

    def check_step(self) -> None:
        """Called once the host has read a step's outputs: raise if that step (or an earlier one) computed
        with an expert slot whose background fill had not landed (the GPU's wait timed out); the slot and
        expert states then start over, and the scheduler fails the requests they carried."""
        failed = getattr(self.backend, "background_failed", None)  # OffloadExperts only
        if failed is None or not failed():
            return
        log.warning("a background expert fill did not land in time; re-initialising the slot state")
        self._fresh_states()
        raise RuntimeError("a decode step gave up waiting for a background expert fill (timeout): its "
                           "outputs may be wrong; the expert cache was reset")

    def drain(self) -> None:
        """Wait until the background expert fills of the last steps have landed (before the states are
        dropped: a fill still writing a freed bank would write memory reused by someone else)."""
        if hasattr(self.backend, "drain"):
            self.backend.drain(check=False)

    def reset(self, mask: np.ndarray) -> None:
        self.state = reset_rows(self.state, jnp.asarray(mask, bool))

    def warmup(self) -> None:
        """Compile every executable (all rows idle: the state is unchanged)."""
        for length in self.buckets:
            self._run(self._prefill[length], jnp.int32(0), np.zeros((1, length), np.int32), np.zeros(1, np.int32))
        idle = np.zeros(self.max_slots, np.int32)
        jax.block_until_ready(self.decode(np.zeros(self.max_slots, np.int32), idle))
        self.reset(np.zeros(self.max_slots, bool))

    def memory(self) -> dict[str, int]:
        return dict(self._memory)
