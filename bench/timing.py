"""Timing and ceilings for the GPU benchmarks (`bench/kernels.py` and its siblings): a call's wall time one at a
time, back to back and in the steady state, and the ceilings a kernel is measured against in the same run (a plain
bf16 matmul, a device-to-device copy, a device read)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def time_ms(fn, *args, iters, best=False):
    """Median wall time of ``iters`` calls (``best``: the fastest, for ceilings)."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.min(times) if best else np.median(times))


def time_back_to_back_ms(fn, *args, iters):
    """Wall time per call of ``iters`` calls dispatched back to back, the host waiting once at the end (as
    a model's layers run: host work between the kernels overlaps the GPU's). Median of 3 rounds."""
    jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(iters)]
        jax.block_until_ready(outs)
        rounds.append((time.perf_counter() - t0) * 1e3 / iters)
    return float(np.median(rounds))


def time_steady_ms(fn, *args, iters):
    """Steady-state wall time per call: rounds of ``iters`` and of ``2 * iters`` calls back to back, the
    difference over ``iters`` (median of 3 pairs), so what a round pays once (the first call's dispatch,
    the final wait) drops out. A model's prefill runs its layers in one executable: this, not a short
    round's average, is the per-layer figure (session 21: the Qwen-shape call at 8K took 1.16-1.22 ms per
    call in rounds of 5 against 1.05 ms of GPU work; how much of that a round pays once was not measured)."""
    jax.block_until_ready(fn(*args))

    def round_ms(n):
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(n)])
        return (time.perf_counter() - t0) * 1e3

    diffs = [(round_ms(2 * iters) - round_ms(iters)) / iters for _ in range(3)]
    return float(np.median(diffs))


def dense_ceiling_tflops(n=8192, iters=10):
    """A plain bf16 matmul [n, n] @ [n, n]: the best of one call at a time (best of ``iters``),
    ``iters`` calls back to back and the steady form (timed as the prefill's b2b and steady columns,
    so no ratio gains from launch overhead the ceiling paid), after 3 warm-up rounds (the figure moved 564-689 TFLOP/s
    across the device calls of session 11, clocks unexamined)."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    fn = jax.jit(lambda a, b: a @ b)
    for _ in range(3):
        jax.block_until_ready([fn(a, b) for _ in range(iters)])
    ms = min(time_ms(fn, a, b, iters=iters, best=True), time_back_to_back_ms(fn, a, b, iters=iters),
             time_steady_ms(fn, a, b, iters=iters))
    return 2 * n ** 3 / ms / 1e9


def copy_ceiling_gbps(nbytes=2 << 30, iters=10):
    """Device-to-device copy, bytes read + written per second."""
    src = jax.random.bits(jax.random.key(1), (nbytes // 4,), jnp.uint32)
    ms = time_ms(jax.jit(lambda a: a + jnp.uint32(1)), src, iters=iters, best=True)
    return 2 * nbytes / ms / 1e6


def read_ceiling_gbps(nbytes=2 << 30, iters=10):
    """Device read alone: the faster of a full sum and a row sum ([N, 8192] -> [N]) over 2 GiB, the
    fastest of ``iters`` runs. What a kernel that only reads weights can approach (HBM reads alone run
    faster than a copy's mixed reads and writes; session 4's full sum alone read 2.8 TB/s while the
    decode kernel read 3.9 TB/s, so take the best of several forms)."""
    src = jax.random.bits(jax.random.key(2), (nbytes // 4 // 8192, 8192), jnp.uint32)
    ms = min(time_ms(jax.jit(lambda a: jnp.sum(a, dtype=jnp.uint32)), src, iters=iters, best=True),
             time_ms(jax.jit(lambda a: jnp.sum(a, axis=1, dtype=jnp.uint32)), src, iters=iters, best=True))
    return nbytes / ms / 1e6
