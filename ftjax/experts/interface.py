"""The expert-execution interface between the model files and the FreeToken expert runtime.

A backend computes the routed part of one MoE layer. The model computes the router (ids, top-k and
weights) and never lets a backend change them; a backend only decides where and how the expert
MLPs run (resident banks, GPU slot cache + CPU branch, ...). Every backend must reproduce
:func:`combine_routes` numerics up to float rounding of the matmuls.
"""
from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

ExpertState = Any  # a pytree of device arrays, donated and returned each step


class ExpertBackend(Protocol):
    """``y[t] = sum_j gate_weights[t, j] * expert(layer, expert_ids[t, j])(x[t])``; zeros where not valid.

    ``x [T, H]``, ``expert_ids [T, k]`` i32 (per-layer ids ``0..E-1``), ``gate_weights [T, k]`` in the
    model dtype, ``token_valid [T]`` bool. ``layer`` is a Python int (static). ``decode`` (static): the
    call is a decode step, one new token per sequence (T = batch), as opposed to a prefill chunk; the
    offloaded backend plans decode and prefill differently. Returns ``(y [T, H] in x.dtype,
    expert_state)``. Backends are hashable: the jitted step functions take them as static.
    """

    def __call__(self, expert_state: ExpertState, layer: int, x: jax.Array, expert_ids: jax.Array,
                 gate_weights: jax.Array, token_valid: jax.Array, *,
                 decode: bool = False) -> tuple[jax.Array, ExpertState]: ...


def expert_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, units: jax.Array | None = None) -> jax.Array:
    """SwiGLU of one route per row: ``x [N, H]``, ``gate_up [N, 2I, H]`` (gate rows first), ``down [N, H, I]``.
    ``units [N]`` (optional): row n sums only the intermediate units ``[0, units[n])``."""
    h = jnp.einsum("nh,nih->ni", x, gate_up)
    inter = gate_up.shape[1] // 2
    act = jax.nn.silu(h[:, :inter]) * h[:, inter:]
    if units is not None:  # where, not a multiply: units past u may hold another expert's (finite) rows
        act = jnp.where(jnp.arange(inter)[None, :] < units[:, None], act, jnp.zeros((), act.dtype))
    return jnp.einsum("ni,nhi->nh", act, down)


def combine_routes(route_out: jax.Array, expert_ids: jax.Array, gate_weights: jax.Array,
                   token_valid: jax.Array) -> jax.Array:
    """Weighted sum of per-route outputs ``[T, k, H]`` in the model dtype, HF's order.

    HF scales each route's output by its weight, then adds the experts into a zero buffer in
    ascending expert id; doing the same keeps bf16 results as close to HF as the matmuls allow.
    """
    weighted = route_out * gate_weights[..., None].astype(route_out.dtype)
    order = jnp.argsort(expert_ids, axis=-1, stable=True)
    weighted = jnp.take_along_axis(weighted, order[..., None], axis=1)
    y = jnp.zeros_like(weighted[:, 0])
    for j in range(weighted.shape[1]):
        y = y + weighted[:, j]
    return jnp.where(token_valid[:, None], y, jnp.zeros_like(y))
