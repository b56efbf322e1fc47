"""Bandwidth measurements shared by ``ftjax calibrate`` and ``bench/host_runtime.py``.

B_H: the CPU expert kernel on a rotating window of experts larger than the caches (DRAM-bound),
as weight bytes read per second; its ceiling: a STREAM-like read with the same worker threads.
"""
from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from ftjax import _host
from ftjax.host.pool import HostPool


@dataclasses.dataclass(frozen=True)
class ExpertShape:
    hidden: int
    inter: int
    top_k: int = 8

    def expert_bytes(self, fmt: str) -> int:
        pool = {"bf16": 2.0, "f32": 4.0, "int4": 0.5 + 2.0 / 32}[fmt]
        return int(3 * self.hidden * self.inter * pool)


def _fill_random(view: np.ndarray, rng: np.random.Generator, block_bytes: int = 8 << 20) -> None:
    """Fill a uint8 view with a repeated random block (values do not matter for bandwidth, zeros would)."""
    flat = view.reshape(-1)
    block = rng.integers(0, 256, min(block_bytes, flat.size), dtype=np.uint8)
    for lo in range(0, flat.size, block.size):
        n = min(block.size, flat.size - lo)
        flat[lo:lo + n] = block[:n]


def make_pool(shape: ExpertShape, fmt: str, window_bytes: int, seed: int = 0, down_layout: str = "hi") -> HostPool:
    """A pool of synthetic experts, at least ``window_bytes`` in total. bf16 values are kept finite
    and moderate (random exponent bytes could make infs/NaNs, which are not representative)."""
    n = max(2 * shape.top_k, -(-window_bytes // shape.expert_bytes(fmt)))
    pool = HostPool(n, shape.hidden, shape.inter, fmt, down_layout)
    rng = np.random.default_rng(seed)
    for bank in ("gate_up", "down"):
        raw = pool.raw(bank)
        _fill_random(raw, rng)
        if fmt == "bf16":
            u16 = raw.view(np.uint16)
            u16 &= np.uint16(0x83FF)  # sign + small exponent + mantissa: |w| < 2^-7
            u16 |= np.uint16(0x3800)
        elif fmt == "int4":
            _, scales = pool.int4_parts(bank)
            scales[...] = 0.01
    return pool


def thp_setting() -> str | None:
    """The host's transparent huge page mode (the bracketed word of
    ``/sys/kernel/mm/transparent_hugepage/enabled``: always, madvise or never), None if unreadable.
    The pool asks for huge pages with ``madvise``, so "never" leaves it on 4 KiB pages."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def stream_read_gbps(nbytes: int, reps: int = 3, threads: int | None = None) -> float:
    """Read ceiling: a touched buffer of ``nbytes`` read once (best of reps) by the expert kernels' worker threads
    (the ceiling of a kernel's rate: "the same threads"), or by ``threads`` threads of a pool of its own
    (`host_threads()`: the host's all-thread read, the decode roofline's DRAM bandwidth)."""
    _check_threads(threads)  # before the buffer is made and filled
    return read_gbps(stream_buffer(nbytes), reps, threads)


def _check_threads(threads: int | None) -> None:
    if threads is not None and not 1 <= threads <= 1024:
        raise ValueError(f"threads must be None (the worker pool) or 1..1024, got {threads}")


def stream_buffer(nbytes: int) -> np.ndarray:
    """A 64-byte aligned, touched (random) buffer for `read_gbps`: keep it to read the ceiling again later."""
    if nbytes < 64:
        raise ValueError(f"a stream buffer needs at least 64 bytes, got {nbytes}")
    buf = np.empty(nbytes + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    buf = buf[off:off + nbytes]
    _fill_random(buf, np.random.default_rng(1))
    return buf


def read_gbps(buf: np.ndarray, reps: int = 3, threads: int | None = None) -> float:
    """`stream_read_gbps` over a buffer from `stream_buffer` (best of reps reads of the whole buffer)."""
    _check_threads(threads)
    return buf.nbytes / _host.stream_read_seconds(buf, reps, threads or 0) / 1e9


def host_threads() -> int:
    """The logical CPUs this process may run on (every one: the all-thread read)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_kernel_gbps(pool: HostPool, shape: ExpertShape, tokens: int, calls: int = 20, seed: int = 0,
                    act: str = "bf16") -> dict:
    """Decode-shaped calls (``tokens`` x top-k routes) walking a rotating window through the pool,
    so weights come from DRAM. Returns weight bytes read per second (median call) and the time."""
    return cpu_kernel_variants(pool, shape, tokens, {"": None}, calls, seed, act)[""]


def cpu_kernel_variants(pool: HostPool, shape: ExpertShape, tokens: int, variants: dict, calls: int = 20,
                        seed: int = 0, act: str = "bf16", routing: str = "window") -> dict:
    """`cpu_kernel_gbps` under each of `variants` ({name: kernel_knobs dict to set, or None: as they are}), the
    variants' calls round robin (call i of every variant, then call i + 1: a host's drift over the run falls on all
    of them alike), each call on its own fresh window. {name: result}; the knobs are left as the last variant set.
    `routing`: "window" (each token picks top_k of a fresh window of 2 top_k experts: ~tokens / 2 per expert), "shared"
    (every token routes to the same top_k experts: exactly `tokens` per expert) or "trace" (call i routes as step i of
    a synthetic routing trace of one layer of 256 experts, batch `tokens`, the calibrated defaults of
    ftjax.experts.traces: 8 tokens x top-8 reach ~32 experts, ~2 tokens per expert; the same steps for every
    variant), always onto experts of a fresh window of the pool."""
    from ftjax.host import set_kernel_knobs

    if routing not in ("window", "shared", "trace"):
        raise ValueError(f"routing is window, shared or trace, got {routing!r}")
    trace = None
    if routing == "trace":
        from ftjax.experts.traces import synthetic_trace
        trace = synthetic_trace(calls + 2, 1, 256, shape.top_k, batch=tokens, seed=seed).ids[:, 0]  # [steps, B, k]

    rng = np.random.default_rng(seed)
    n = pool.n_experts
    x = rng.standard_normal((tokens, shape.hidden)).astype(np.float32)
    if act == "bf16":
        x = (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits (truncated), passed as uint16
    runs = {v: ([], [], []) for v in variants}  # times, unique bytes, profiles
    cursor = 0
    for step in range(calls + 2):
        for v, knobs in variants.items():
            if knobs is not None:
                set_kernel_knobs(**knobs)
            if trace is not None:  # the step's distinct experts onto a fresh window, in the trace's pattern
                uniq, inverse = np.unique(trace[step], return_inverse=True)
                window = (cursor + np.arange(uniq.size)) % n
                cursor = (cursor + uniq.size) % n
                eid = window[inverse.reshape(-1)].astype(np.int32)
            else:
                # each token picks top_k distinct experts out of a fresh window of 2*top_k experts (shared: all top_k
                # experts of a fresh window of top_k)
                shared = routing == "shared"
                width = shape.top_k if shared else 2 * shape.top_k
                window = (cursor + np.arange(width)) % n
                cursor = (cursor + width) % n
                eid = np.concatenate([window if shared else rng.choice(window, shape.top_k, replace=False)
                                      for _ in range(tokens)]).astype(np.int32)
            tok = np.repeat(np.arange(tokens, dtype=np.int32), shape.top_k)
            w = np.full(eid.size, 0.125, np.float32)
            t0 = time.perf_counter()
            _host.run_experts(pool._h, x, tok, eid, w, eid.size, x_bf16=act == "bf16")
            times, uniq_bytes, profiles = runs[v]
            times.append(time.perf_counter() - t0)
            profiles.append(_host.last_expert_call())
            uniq_bytes.append(len(np.unique(eid)) * (pool.expert_bytes("gate_up") + pool.expert_bytes("down")))
    out = {}
    for v, (times, uniq_bytes, profiles) in runs.items():
        times, uniq_bytes = np.array(times[2:]), np.array(uniq_bytes[2:])  # first calls warm the threads
        rates = uniq_bytes / times
        # the same bytes over the kernel's own clock (its total: no binding, no y allocation; what a call inside
        # the jitted step pays, the FFI handler passing its buffers straight through)
        kernel_rates = uniq_bytes / (np.array([p["total_us"] for p in profiles[2:]]) * 1e-6)
        # where the calls went (the kernel's own clock, median per field): setup, and per round
        # (layouts, phase1, phase2) the wall time and the caller's wait for the other threads
        profile = {k: float(np.median([p[k] for p in profiles[2:]])) for k in profiles[0]}
        out[v] = {"gbps": float(np.median(rates)) / 1e9, "kernel_gbps": float(np.median(kernel_rates)) / 1e9,
                  "ms": float(np.median(times)) * 1e3,
                  "bytes_per_call": float(np.median(uniq_bytes)), "profile": profile}
    return out
