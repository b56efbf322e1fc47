"""XLA FFI targets of the host runtime and their JAX wrappers.

``cpu_experts`` (platform "cpu") runs the expert task list on the worker pool inside a jitted
program: ``y[t] = sum over valid tasks (t, e, w) of w * expert_e(x[t])``, f32 output.
"""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

from ftjax import _host

_lock = threading.Lock()
_registered: set[str] = set()


def register_targets() -> None:
    """Register every FFI handler this build has with JAX (idempotent)."""
    with _lock:
        for platform, handlers in _host.ffi_handlers().items():
            for name, capsule in handlers.items():
                if (platform, name) in _registered:
                    continue
                kwargs = {}
                if platform == "CUDA":
                    from ftjax.host import cuda  # traits live with the CUDA wrappers
                    kwargs = cuda.registration_kwargs(name)
                jax.ffi.register_ffi_target(name, capsule, platform=platform, api_version=1, **kwargs)
                _registered.add((platform, name))


def _pool_id(pool) -> np.uint64:
    return np.uint64(pool if isinstance(pool, (int, np.integer)) else pool.id)


def cpu_experts(x, token_idx, expert_ids, weights, n_valid, pool, unit_start=None):
    """CPU expert computation over a task list, usable inside ``jax.jit`` on the CPU backend.

    x [T, H] f32 or bf16; token_idx, expert_ids (flat ids ``l*E + e``) [N] i32; weights [N] f32;
    n_valid: scalar i32, the number of valid leading tasks; pool: a ``HostPool`` (or its id);
    unit_start [N] i32 (optional, default 0): each task computes only its expert's intermediate
    units ``[u, I)``. Returns y [T, H] f32. Bad ids, counts or unit starts raise when the computation runs.
    """
    register_targets()
    x = jnp.asarray(x)
    if x.ndim != 2 or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"x must be [T, H] float32 or bfloat16, got {x.dtype}{list(x.shape)}")
    token_idx = jnp.asarray(token_idx, jnp.int32).reshape(-1)
    expert_ids = jnp.asarray(expert_ids, jnp.int32).reshape(-1)
    weights = jnp.asarray(weights, jnp.float32).reshape(-1)
    if not token_idx.shape == expert_ids.shape == weights.shape:
        raise ValueError(f"task arrays differ in length: token_idx {token_idx.shape}, expert_ids "
                         f"{expert_ids.shape}, weights {weights.shape}")
    n_valid = jnp.asarray(n_valid, jnp.int32).reshape(())
    unit_start = (jnp.zeros_like(token_idx) if unit_start is None
                  else jnp.asarray(unit_start, jnp.int32).reshape(-1))
    if unit_start.shape != token_idx.shape:
        raise ValueError(f"unit_start {unit_start.shape} must match the tasks {token_idx.shape}")
    call = jax.ffi.ffi_call("ftjax_cpu_experts", jax.ShapeDtypeStruct(x.shape, jnp.float32),
                            vmap_method="sequential")
    return call(x, token_idx, expert_ids, weights, n_valid, unit_start, pool=_pool_id(pool))
