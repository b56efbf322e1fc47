"""Which code computes the device-side expert MLPs of a backend: ``jnp`` or the ``pallas`` kernels.

- ``jnp`` (default): gather the routed experts' weights and run batched GEMVs (decode), or sort the
  routes and run ``lax.ragged_dot`` (prefill). Any dtype, any size, every platform.
- ``pallas``: the Mosaic GPU kernels of ``ftjax.pallas`` (Hopper): the decode grouped GEMV over
  cache slots (routes compacted so the valid ones come first; the count is a device scalar) and the
  prefill grouped expert MLP (routes sorted by expert, padded row tiles, the slot map feeding the
  weights). bf16 banks only. Off the GPU they run in Mosaic GPU interpret mode (tests).

Both produce the same numbers up to bf16 rounding of the matmuls; decode returns per-route outputs
for ``combine_routes`` (HF's summation order), prefill the fp32 weighted sum over each token's routes.
On the H200 (bench/RESULTS.md, 2026-11-30) the decode kernel was still slower than the jnp gather at 1
token and the prefill kernel 0.32-0.62 of the matmul ceiling at 8K tokens (jnp's ragged_dot ~0.02):
``jnp`` stays the default until the decode kernel is tuned.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

KERNELS = ("jnp", "pallas")


def check_kernel(kernel: str, hidden: int = 0, inter: int = 0, dtype=None) -> None:
    """ValueError naming the problem when ``kernel`` is unknown or (with ``dtype``) cannot run banks of
    that dtype and size."""
    if kernel not in KERNELS:
        raise ValueError(f"expert kernel {kernel!r} unknown; valid: {KERNELS}")
    if kernel == "pallas" and dtype is not None:
        if jnp.dtype(dtype) != jnp.bfloat16:
            raise ValueError(f"expert kernel 'pallas' needs bf16 expert banks, these are {jnp.dtype(dtype).name} "
                             "(use kernel='jnp', or a bf16 store / --dtype bf16)")
        prefill_tiles(hidden, inter, interpret=False)  # raises for sizes the kernels cannot tile
        if hidden % 64 or inter % 32:
            raise ValueError(f"expert kernel 'pallas' needs hidden % 64 == 0 and intermediate % 32 == 0 "
                             f"(decode GEMV), got hidden={hidden}, intermediate={inter}")


def interpret_mode() -> bool:
    """Mosaic GPU kernels compile for the GPU backend only; elsewhere they run interpreted."""
    return jax.default_backend() != "gpu"


def prefill_tiles(hidden: int, inter: int, *, interpret: bool) -> dict:
    """The largest tiles the prefill kernel accepts for ``(hidden, inter)`` (small ones interpreted)."""
    def pick(options, ok):
        for t in options:
            if ok(t):
                return t
        return None

    tile_k = pick((64, 32), lambda t: hidden % t == 0 and inter % t == 0)
    tile_gu = pick((64, 32, 16, 8), lambda t: inter % (2 * t) == 0)
    tile_dn = pick((128, 64, 32, 16, 8), lambda t: hidden % (2 * t) == 0)
    if None in (tile_k, tile_gu, tile_dn):
        raise ValueError(f"the Pallas prefill kernel cannot tile hidden={hidden}, intermediate={inter}: "
                         "both must be multiples of 32 and the intermediate size of 16")
    if interpret:
        return dict(tile_m=64, tile_n_gate_up=min(tile_gu, 32), tile_n_down=min(tile_dn, 32), tile_k=32,
                    stages=2, num_sms=2, interpret=True)
    return dict(tile_m=128, tile_n_gate_up=tile_gu, tile_n_down=tile_dn, tile_k=tile_k)


def decode_routes(x, route_slot, gate_up, down, units=None):
    """Per-route SwiGLU outputs ``[R, H]`` (route ``t*k + j`` on row ``t*k + j``) of the routes with
    ``route_slot >= 0``, zeros elsewhere, through the decode grouped GEMV. ``x [T, H]``; ``units [R]``
    (optional, the unit split): a route computes only its expert's units ``[0, units[r])``."""
    from ftjax.pallas.decode_gemv import decode_experts

    num_routes = route_slot.shape[0]
    k = num_routes // x.shape[0]
    on = route_slot >= 0
    order = jnp.argsort(~on, stable=True).astype(jnp.int32)  # valid routes first, in route order
    n_valid = on.sum().astype(jnp.int32)
    y = decode_experts(x.astype(jnp.bfloat16), jnp.maximum(route_slot[order], 0), order // k, n_valid,
                       gate_up, down, None if units is None else units[order], interpret=interpret_mode())
    return jnp.zeros_like(y).at[order].set(y)


def prefill_layer(x, expert_ids, gate_weights, route_valid, gate_up, down, slot_of_expert):
    """``y [T, H]`` fp32: the weighted sum over each token's routes with ``route_valid [T, k]``, expert
    ``e``'s weights in slot ``slot_of_expert[e]`` of the banks, through the prefill kernel."""
    from ftjax.pallas.prefill_gemm import prefill_experts

    tiles = prefill_tiles(x.shape[1], down.shape[-1], interpret=interpret_mode())
    return prefill_experts(x.astype(jnp.bfloat16), expert_ids.astype(jnp.int32), gate_weights, route_valid,
                           gate_up, down, slot_of_expert.astype(jnp.int32), **tiles)
