"""Model families. ``get_family(cfg)`` returns the module with ``init_state`` and ``forward``."""
from __future__ import annotations

import functools
import importlib
from types import ModuleType

import jax
import jax.numpy as jnp

from ftjax.config import FAMILIES, ModelConfig


def get_family(cfg: ModelConfig) -> ModuleType:
    """The model module of ``cfg.family`` (``ftjax.models.qwen3_moe`` or ``ftjax.models.qwen3_5_moe``)."""
    if cfg.family not in FAMILIES:
        raise ValueError(f"unknown model family {cfg.family!r}; supported: {FAMILIES}")
    return importlib.import_module(f"ftjax.models.{cfg.family}")


def make_step_fns(cfg: ModelConfig, backend, batch: int, length: int, max_len: int, *,
                  all_logits: bool = False, stable_io: bool = False):
    """Jitted ``(prefill, decode)`` step functions with ``cfg``/``backend`` static and both the state
    and the expert state donated (updated in place: the caller must use the returned ones).

    Both take ``(params, expert_state, state, tokens, n_new)`` and return ``(logits, state,
    expert_state)``; prefill expects ``tokens [batch, length]``, decode ``tokens [batch, 1]``, and
    the state from ``init_state(cfg, batch, max_len, dtype)``. Shapes are checked before dispatch so
    a wrong bucket fails loudly instead of compiling a new executable.

    ``stable_io`` (decode): every buffer of the step keeps its device address from one step to the
    next, so XLA launches the step's CUDA graph as recorded instead of re-recording the commands
    whose buffers moved (docs/internals.md, Model API; bench/RESULTS.md, session 6). The tokens
    and n_new are first copied into a persistent device buffer (a tiny donated executable), and the
    logits are written into one persistent buffer that every call donates: **the logits a call
    returns are valid until the next decode call** (read them, or hand them to a device computation,
    before it; afterwards the array is deleted).
    """
    if min(batch, length, max_len) < 1 or length > max_len:
        raise ValueError(f"need 1 <= length <= max_len and batch >= 1, got batch={batch}, "
                         f"length={length}, max_len={max_len}")
    fwd = get_family(cfg).forward

    def check(tokens, n_new, state, t):
        if tokens.shape != (batch, t):
            raise ValueError(f"tokens shape {tokens.shape}, this step function takes {(batch, t)}")
        if n_new.shape != (batch,):
            raise ValueError(f"n_new shape {n_new.shape}, this step function takes {(batch,)}")
        kv_len = state["lengths"].shape
        if kv_len != (batch,):
            raise ValueError(f"state lengths shape {kv_len}, expected {(batch,)}")

    def make(t: int, logits_all: bool):
        step = jax.jit(functools.partial(fwd, cfg=cfg, backend=backend, all_logits=logits_all),
                       donate_argnums=(1, 2))

        def run(params, expert_state, state, tokens, n_new):
            check(tokens, n_new, state, t)
            return step(params, expert_state, state, tokens, n_new)

        run.jitted = step
        run.lower = step.lower
        return run

    if not stable_io:
        return make(length, all_logits), make(1, False)
    return make(length, all_logits), _stable_decode(fwd, cfg, backend, batch, check)


def _stable_decode(fwd, cfg, backend, batch, check):
    """The ``stable_io`` decode step (see `make_step_fns`)."""
    def step_io(params, expert_state, state, io, logits_buf):
        del logits_buf  # donated: the logits output takes its place
        return fwd(params, expert_state, state, io["tokens"], io["n_new"], cfg=cfg, backend=backend)

    step = jax.jit(step_io, donate_argnums=(1, 2, 4), keep_unused=True)
    stage = jax.jit(lambda io, tokens, n_new: {"tokens": tokens.astype(jnp.int32), "n_new": n_new.astype(jnp.int32)},
                    donate_argnums=(0,))
    held = {}

    def buffers(params, expert_state, state):
        if not held:
            io = {"tokens": jnp.zeros((batch, 1), jnp.int32), "n_new": jnp.zeros((batch,), jnp.int32)}
            out = jax.eval_shape(functools.partial(fwd, cfg=cfg, backend=backend), params, expert_state, state,
                                 io["tokens"], io["n_new"])[0]
            held.update(io=io, logits=jnp.zeros(out.shape, out.dtype))
        return held["io"], held["logits"]

    def run(params, expert_state, state, tokens, n_new):
        check(tokens, n_new, state, 1)
        io, buf = buffers(params, expert_state, state)
        try:
            io = held["io"] = stage(io, jnp.asarray(tokens), jnp.asarray(n_new))
            logits, state, expert_state = step(params, expert_state, state, io, buf)
        except Exception:
            held.clear()  # the donated buffers may be gone: start afresh on the next call
            raise
        held["logits"] = logits
        return logits, state, expert_state

    def lower(params, expert_state, state, tokens, n_new):
        io, buf = buffers(params, expert_state, state)
        return step.lower(params, expert_state, state, io, buf)

    run.jitted, run.lower = step, lower
    return run
