"""Sampling parameters and the jit-able token sampler.

``sample`` takes per-row parameters as arrays, so one compiled function serves a batch whose
requests asked for different temperatures / top-k / top-p. ``temperature == 0`` is greedy (argmax).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature: 0 = greedy, else logits are divided by it (>= 0).
    top_k: keep the k most likely tokens (0 = off).
    top_p: keep the smallest set of tokens whose probability reaches top_p (nucleus; 1 = off).
    seed: per-request PRNG seed; the same seed and prompt give the same tokens.
    max_tokens: most tokens to generate (>= 1).
    stop_token_ids: extra ids that end generation (the model's eos ids always do).
    stop: strings that end generation; the text is cut before the first one.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        # Lists are accepted for convenience and frozen into tuples.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        _check_number("temperature", self.temperature, float, 0.0, math.inf, ">= 0 (0 = greedy)")
        _check_number("top_k", self.top_k, int, 0, math.inf, "an integer >= 0 (0 = off)")
        _check_number("top_p", self.top_p, float, 0.0, 1.0, "in (0, 1] (1 = off)", low_open=True)
        _check_number("seed", self.seed, int, 0, 2**32 - 1, "an integer in [0, 2**32 - 1]")
        _check_number("max_tokens", self.max_tokens, int, 1, math.inf, "an integer >= 1")
        for i in self.stop_token_ids:
            _check_number("stop_token_ids", i, int, 0, math.inf, "a list of token ids >= 0")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_number(name: str, value, kind: type, lo: float, hi: float, valid: str, low_open: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ValueError(f"{name}={value!r} is not valid; {name} must be {valid}")
    if math.isnan(value) or value < lo or value > hi or (low_open and value == lo):
        raise ValueError(f"{name}={value!r} is out of range; {name} must be {valid}")


def row_keys(seeds: jax.Array, step: jax.Array) -> jax.Array:
    """One raw PRNG key per row from its request seed and the decode step (a scalar, or one per row
    ``[B]``: each request's own token index): independent of the batch the request runs in, so a
    request samples the same tokens alone or batched."""
    seeds = seeds.astype(jnp.uint32)
    steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), seeds.shape)
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(seeds, steps)


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> jax.Array:
    """Pick one token per row of ``logits [B, V]``.

    ``key``: one PRNG key (split over the rows) or one per row (``[B, 2]`` raw / ``[B]`` typed; see
    :func:`row_keys`).
    ``temperature [B]`` f32 (0 = greedy), ``top_k [B]`` i32 (0 = off), ``top_p [B]`` f32 (1 = off).
    Returns ``[B]`` int32 ids. Top-k and top-p are applied after temperature scaling, like HF.
    """
    B, V = logits.shape
    logits = logits.astype(jnp.float32)
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    single = key.ndim == (0 if typed else 1)
    keys = jax.random.split(key, B) if single else key
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    scaled = logits / t[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # descending; ties keep the lower id first
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V, dtype=jnp.int32)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V).astype(jnp.int32)
    keep = rank < k[:, None]
    # Nucleus over the top-k survivors: keep a token while the mass before it is below top_p.
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & ((mass_before < top_p[:, None]) | (rank == 0))
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    choice = jax.vmap(lambda kk, row: jax.random.categorical(kk, row))(keys, masked)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy_ids)


def batch_arrays(params: Sequence[SamplingParams], batch: int) -> dict[str, jax.Array]:
    """Per-row parameter arrays for :func:`sample`, padded to ``batch`` rows (padding rows greedy)."""
    pad = batch - len(params)
    if pad < 0:
        raise ValueError(f"{len(params)} requests do not fit a batch of {batch}")
    return {
        "temperature": jnp.asarray([p.temperature for p in params] + [0.0] * pad, jnp.float32),
        "top_k": jnp.asarray([p.top_k for p in params] + [0] * pad, jnp.int32),
        "top_p": jnp.asarray([p.top_p for p in params] + [1.0] * pad, jnp.float32),
        "seeds": jnp.asarray([p.seed for p in params] + [0] * pad, jnp.uint32),
    }


@jax.jit
def sample_rows(logits: jax.Array, seeds: jax.Array, steps: jax.Array, temperature: jax.Array,
                top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """:func:`sample` with per-row keys from ``seeds [B]`` and per-row token indices ``steps [B]``."""
    return sample(logits, row_keys(seeds, steps), temperature, top_k, top_p)
