"""Model families. ``get_family(cfg)`` returns the module with ``init_state`` and ``forward``."""
from __future__ import annotations

import functools
import importlib
from types import ModuleType

import jax

from ftjax.config import FAMILIES, ModelConfig


def get_family(cfg: ModelConfig) -> ModuleType:
    """The model module of ``cfg.family`` (``ftjax.models.qwen3_moe`` or ``ftjax.models.qwen3_5_moe``)."""
    if cfg.family not in FAMILIES:
        raise ValueError(f"unknown model family {cfg.family!r}; supported: {FAMILIES}")
    return importlib.import_module(f"ftjax.models.{cfg.family}")


def make_step_fns(cfg: ModelConfig, backend, batch: int, length: int, max_len: int, *,
                  all_logits: bool = False):
    """Jitted ``(prefill, decode)`` step functions with ``cfg``/``backend`` static and both the state
    and the expert state donated (updated in place: the caller must use the returned ones).

    Both take ``(params, expert_state, state, tokens, n_new)`` and return ``(logits, state,
    expert_state)``; prefill expects ``tokens [batch, length]``, decode ``tokens [batch, 1]``, and
    the state from ``init_state(cfg, batch, max_len, dtype)``. Shapes are checked before dispatch so
    a wrong bucket fails loudly instead of compiling a new executable.
    """
    if min(batch, length, max_len) < 1 or length > max_len:
        raise ValueError(f"need 1 <= length <= max_len and batch >= 1, got batch={batch}, "
                         f"length={length}, max_len={max_len}")
    fwd = get_family(cfg).forward

    def make(t: int, logits_all: bool):
        step = jax.jit(functools.partial(fwd, cfg=cfg, backend=backend, all_logits=logits_all),
                       donate_argnums=(1, 2))

        def run(params, expert_state, state, tokens, n_new):
            if tokens.shape != (batch, t):
                raise ValueError(f"tokens shape {tokens.shape}, this step function takes {(batch, t)}")
            kv_len = state["lengths"].shape
            if kv_len != (batch,):
                raise ValueError(f"state lengths shape {kv_len}, expected {(batch,)}")
            return step(params, expert_state, state, tokens, n_new)

        run.jitted = step
        return run

    return make(length, all_logits), make(1, False)
