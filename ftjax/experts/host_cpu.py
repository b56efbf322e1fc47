"""``HostCPUExperts``: the pure-CPU MoE backend. Every route runs on the CPU worker pool, reading
the experts in place in the host pool (``cpu_experts`` FFI, platform "cpu"); nothing is copied.

``expert_state`` is unused (pass ``{}``): the pool is the only copy of the experts. Runs where JAX's
backend is the CPU (CI, machines without a GPU).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ftjax.host.ffi import cpu_experts
from ftjax.host.pool import HostPool


@dataclasses.dataclass(frozen=True, eq=False)
class HostCPUExperts:
    """All routes of layer ``layer`` computed by ``cpu_experts`` over the pool's flat ids ``layer*E + e``.

    Hashable by identity (the jitted steps take backends as static arguments); holding the pool
    keeps its id registered for as long as the backend lives.
    """

    pool: HostPool
    num_experts: int

    def __post_init__(self):
        if self.num_experts < 1 or self.pool.n_experts % self.num_experts:
            raise ValueError(f"num_experts {self.num_experts} does not divide the pool's "
                             f"{self.pool.n_experts} experts")

    @staticmethod
    def init_state(*_args, **_kwargs) -> dict:
        return {}

    def __call__(self, expert_state, layer: int, x, expert_ids, gate_weights, token_valid, *, decode: bool = False):
        T, k = expert_ids.shape
        if not 0 <= layer < self.pool.n_experts // self.num_experts:
            raise ValueError(f"layer {layer} outside the pool's {self.pool.n_experts // self.num_experts} layers")
        tokens = jnp.repeat(jnp.arange(T, dtype=jnp.int32), k)
        flat = (layer * self.num_experts + expert_ids.astype(jnp.int32)).reshape(-1)
        weights = gate_weights.astype(jnp.float32).reshape(-1)
        valid = jnp.repeat(token_valid, k)
        # Valid routes first (stable), so padded tokens cost nothing: n_valid cuts them off.
        order = jnp.argsort(~valid, stable=True)
        n_valid = jnp.sum(valid, dtype=jnp.int32)
        y = cpu_experts(x, tokens[order], flat[order], weights[order], n_valid, self.pool)
        return y.astype(x.dtype), expert_state
