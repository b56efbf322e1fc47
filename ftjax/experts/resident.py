"""``ResidentExperts``: every routed expert bank lives on the device (no offloading).

The reference backend: the dense model's numbers that every offloading policy must reproduce, and
the fast path when the whole pool fits. Two execution paths, chosen statically from the shape:

- gather: few routes (decode). Gather the routed experts' weights per route and run batched GEMVs.
- ragged: many routes (prefill). Sort the routes by expert and run ``lax.ragged_dot_general`` over
  the layer's banks (each expert's weights are read once).

Both produce per-route outputs and share :func:`combine_routes`, so they agree up to matmul rounding.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ftjax.experts.interface import combine_routes, expert_mlp
from ftjax.experts.kernels import check_kernel, decode_routes, prefill_layer

PATHS = ("auto", "gather", "ragged")


@dataclasses.dataclass(frozen=True)
class ResidentExperts:
    """All banks resident: ``expert_state = {"gate_up": [L*E, 2I, H], "down": [L*E, H, I]}``.

    ``path`` forces one execution path; ``"auto"`` gathers while ``T*k <= gather_max_routes``
    (default: the number of experts per layer, where gathering stops being cheaper than reading
    every expert of the layer once). ``kernel``: ``"jnp"`` or ``"pallas"`` (``ftjax.experts.kernels``).
    """

    num_experts: int
    path: str = "auto"
    gather_max_routes: int | None = None
    kernel: str = "jnp"

    def __post_init__(self):
        check_kernel(self.kernel)
        if self.path not in PATHS:
            raise ValueError(f"ResidentExperts path {self.path!r} is not one of {PATHS}")
        if self.num_experts < 1:
            raise ValueError(f"ResidentExperts num_experts must be >= 1, got {self.num_experts}")

    @staticmethod
    def init_state(banks: Mapping[str, np.ndarray | jax.Array], dtype=None) -> dict[str, jax.Array]:
        """Put host banks (``expert_bank_shapes`` layout) on the default device."""
        missing = {"gate_up", "down"} - set(banks)
        if missing:
            raise KeyError(f"expert banks {sorted(missing)} are missing (have {sorted(banks)})")
        return {k: jnp.asarray(banks[k], dtype=dtype) for k in ("gate_up", "down")}

    def choose_path(self, n_routes: int) -> str:
        if self.path != "auto":
            return self.path
        limit = self.num_experts if self.gather_max_routes is None else self.gather_max_routes
        return "gather" if n_routes <= limit else "ragged"

    def __call__(self, expert_state, layer: int, x, expert_ids, gate_weights, token_valid, *, decode: bool = False):
        T, k = expert_ids.shape
        E = self.num_experts
        gate_up, down = expert_state["gate_up"], expert_state["down"]
        if self.kernel == "pallas":
            check_kernel(self.kernel, x.shape[1], down.shape[-1], gate_up.dtype)
            if self.choose_path(T * k) == "gather":
                out = decode_routes(x, (layer * E + expert_ids).reshape(-1).astype(jnp.int32), gate_up, down)
                return combine_routes(out.astype(x.dtype).reshape(T, k, -1), expert_ids, gate_weights,
                                      token_valid), expert_state
            y = prefill_layer(x, expert_ids, gate_weights, token_valid, gate_up, down,
                              layer * E + jnp.arange(E, dtype=jnp.int32))
            return jnp.where(token_valid[:, None], y.astype(x.dtype), jnp.zeros((), x.dtype)), expert_state
        if self.choose_path(T * k) == "gather":
            flat = (layer * E + expert_ids).reshape(-1)
            out = expert_mlp(jnp.repeat(x, k, axis=0), gate_up[flat], down[flat])
        else:
            out = _ragged_routes(x, expert_ids, gate_up[layer * E:(layer + 1) * E],
                                 down[layer * E:(layer + 1) * E])
        out = out.astype(x.dtype).reshape(T, k, -1)
        return combine_routes(out, expert_ids, gate_weights, token_valid), expert_state


def _ragged_dot_nt(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``lhs [M, K]`` rows grouped by expert times ``rhs [E, N, K]`` (torch orientation) -> ``[M, N]``."""
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    return lax.ragged_dot_general(lhs, rhs, group_sizes, dims)


def _ragged_routes(x, expert_ids, gate_up, down):
    """Per-route SwiGLU outputs ``[T*k, H]`` (route order ``t*k + j``) via sort-by-expert + ragged dots."""
    T, k = expert_ids.shape
    E, two_i = gate_up.shape[0], gate_up.shape[1]
    ids = expert_ids.reshape(-1)
    order = jnp.argsort(ids, stable=True)
    xs = x[order // k]
    group_sizes = jnp.bincount(ids, length=E).astype(jnp.int32)
    h = _ragged_dot_nt(xs, gate_up, group_sizes)
    act = jax.nn.silu(h[:, :two_i // 2]) * h[:, two_i // 2:]
    ys = _ragged_dot_nt(act, down, group_sizes)
    return jnp.zeros_like(ys).at[order].set(ys)
