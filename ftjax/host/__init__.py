"""Python face of the native host runtime (``ftjax._host``): the host expert pool, the worker pool
and CPU expert kernels, the XLA FFI targets (CPU; CUDA where built) and calibration."""
from __future__ import annotations

import operator

from ftjax import _host
from ftjax.host.ffi import cpu_experts, register_targets
from ftjax.host.pool import HostPool

__all__ = ["HostPool", "cpu_experts", "register_targets", "cpu_features", "cpu_brand", "available_tiers",
           "active_tier", "set_tier", "prefetch_bytes", "set_prefetch_bytes", "configure_workers",
           "tune_workers_for_gpu", "gpu_workers", "expert_call_totals", "expert_call_time_totals", "worker_info",
           "cuda_built", "cuda_device_count", "kernel_knobs", "set_kernel_knobs", "parse_knobs",
           "knob_variants"]


def cpu_features() -> dict[str, bool]:
    """SIMD features of this CPU as detected by the native module."""
    return dict(_host.cpu_features())


def cpu_brand() -> str:
    return _host.cpu_brand()


def available_tiers() -> list[str]:
    """CPU kernel tiers compiled in and supported here, in order ("scalar", "avx2", "avx512bf16", "amx").
    "auto" takes the last (amx hands calls of fewer than 3 tokens per expert to the avx512bf16 loops)."""
    return list(_host.available_tiers())


def active_tier() -> str:
    return _host.active_tier()


def set_tier(name: str) -> None:
    """Force a kernel tier ("auto" = the best available); ValueError naming the valid ones."""
    _host.set_tier(name)


def prefetch_bytes() -> int:
    """How far ahead (bytes) the AVX-512 and AMX kernels prefetch each weight row (0 = off)."""
    return _host.prefetch_bytes()


def set_prefetch_bytes(nbytes: int) -> None:
    """Set the weight-row prefetch distance of the AVX-512 and AMX kernels, 0 .. 1 MiB (0 = hardware
    prefetch only); ValueError outside that range. Results do not depend on it, only speed."""
    _host.set_prefetch_bytes(int(nbytes))


# The CPU expert kernels' speed knobs (no result depends on them): name -> (read, set, kind).
_KNOBS = {
    "gate_up_rows": (_host.gate_up_item_rows, _host.set_gate_up_item_rows, int),  # rows per gate/up work item
    "down_rows": (_host.down_item_rows, _host.set_down_item_rows, int),  # output rows per down work item
    "prefetch_bytes": (_host.prefetch_bytes, _host.set_prefetch_bytes, int),  # in-row prefetch distance
    "short_row_bytes": (_host.short_row_bytes, _host.set_short_row_bytes, int),  # rows prefetching a tile ahead
    "window_prefetch": (_host.window_prefetch, _host.set_window_prefetch, bool),  # stop at a column window's end
    "tile_prefetch": (_host.tile_prefetch, _host.set_tile_prefetch, bool),  # long rows warm the next tile
    # int4 x bf16 on the AVX2 and AVX-512 loops, up to this many tokens per expert: q15 activations and integer
    # products (more: bf16 or f32 products); the two agree within 2^-14 of each activation lane's largest element, not
    # bit for bit. Default per CPU: 5 with AMX, 2 with AVX-512, 64 (every count) where AVX2 is the best tier
    "int4_vnni_tokens": (_host.int4_vnni_tokens, _host.set_int4_vnni_tokens, int),
    # 8: those calls quantise each activation lane of 8 columns to int8 (opt-in, off by at most m / 254 per element);
    # 15: the exact q15 layout (default)
    "int4_act_bits": (_host.int4_act_bits, _host.set_int4_act_bits, int),
    # with int4_act_bits 8, up to this many tokens per expert on the VNNI loop (instead of int4_vnni_tokens); default 8,
    # 64 where AVX2 is the best tier
    "int4_q8_tokens": (_host.int4_q8_tokens, _host.set_int4_q8_tokens, int),
    # down's round: a token's lone experts summed in one pass (on) or one call and store each (off); f32 rounding
    "down_sum": (_host.down_sum, _host.set_down_sum, bool),
}


def kernel_knobs() -> dict:
    """The CPU expert kernels' speed knobs as set now: gate_up_rows / down_rows (rows per work item of the
    two rounds), prefetch_bytes, short_row_bytes, window_prefetch, tile_prefetch, int4_vnni_tokens,
    int4_act_bits, int4_q8_tokens, down_sum (cpp/kernels.h, cpp/moe.h). No result depends on them, except the last
    bits with int4_vnni_tokens (int4 weights, bf16 activations) and down_sum (its summation order), and int4_act_bits=8
    (opt-in, lossy: int4 x bf16 activations as int8 per lane of 8 columns, each off by up to 1/254 of its lane's
    largest; int4_q8_tokens is then the VNNI loop's limit)."""
    return {name: read() for name, (read, _, _) in _KNOBS.items()}


def set_kernel_knobs(**values) -> None:
    """Set some of `kernel_knobs` (the others stay). A bad name or value raises ValueError and leaves every
    knob as it was."""
    unknown = sorted(set(values) - set(_KNOBS))
    if unknown:
        raise ValueError(f"unknown kernel knobs {unknown}; valid: {', '.join(_KNOBS)}")
    before = kernel_knobs()
    for name, value in values.items():
        try:
            if _KNOBS[name][2] is bool and value not in (True, False):
                raise TypeError("expected True or False")
            _KNOBS[name][1](bool(value) if _KNOBS[name][2] is bool else operator.index(value))
        except (ValueError, TypeError) as e:
            for other, old in before.items():
                _KNOBS[other][1](old)
            raise ValueError(f"kernel knob {name}={value!r}: {e}") from None


def parse_knobs(spec: str) -> dict:
    """'down_rows=32,window_prefetch=off' -> {'down_rows': 32, 'window_prefetch': False} (booleans: on / off;
    the values are checked when set); ValueError naming the bad part."""
    out = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        if name not in _KNOBS or not value:
            raise ValueError(f"'{part}' is not KNOB=VALUE with KNOB one of {', '.join(_KNOBS)}")
        if _KNOBS[name][2] is bool:
            if value not in ("on", "off"):
                raise ValueError(f"{name} is on or off, got '{value}'")
            out[name] = value == "on"
        elif value.lstrip("-").isdigit():
            out[name] = int(value)
        else:
            raise ValueError(f"{name} takes an integer, got '{value}'")
    return out


def knob_variants(specs: list[str]) -> dict[str, dict]:
    """Each spec of `parse_knobs` as a whole `kernel_knobs` dict (the knobs it does not name as they are now),
    every value checked by setting it (the knobs are back as they were after): {spec: knobs}. ValueError
    naming the bad spec."""
    now = kernel_knobs()
    out = {}
    for spec in specs:
        try:
            out[spec] = dict(now, **parse_knobs(spec))
            set_kernel_knobs(**out[spec])
        except ValueError as e:
            raise ValueError(f"{spec}: {e}") from None
        finally:
            set_kernel_knobs(**now)
    return out


GPU_SPIN_US = 2000  # beside a GPU: longer than the gap between the MoE layers of a decode step
# Beside a GPU the host also runs JAX's dispatch thread and XLA's and the CUDA driver's threads: the pool
# leaves them CPUs (H200 host, 16 vCPUs, 40-layer decode at 37%, pools round robin in one process: 12
# workers 1.06x and 1.03x the former 14 at batch 1 on two hosts, 1.01x at batch 4; 15 workers, timed
# after the default, 0.59x; the CPU branch's own time per job did not shrink with more workers:
# bench/RESULTS.md, session 25).
GPU_SPARE_CPUS = 4  # the coordinator, the dispatch thread, two for the runtime's other threads
_configured_by_user = False


def gpu_workers(physical_cores: int) -> int:
    """Workers of the pool `tune_workers_for_gpu` sets: physical cores - GPU_SPARE_CPUS from 12 cores on
    (measured at 16), the CPU-only default (physical cores - 2, at least 0) below that, where each worker
    adds more of the host's read bandwidth (unmeasured there)."""
    if physical_cores >= 12:
        return physical_cores - GPU_SPARE_CPUS
    return max(0, physical_cores - 2)


def configure_workers(n_workers: int = -1, spin_us: int = 100, pin: bool = True) -> None:
    """Replace the worker pool: ``n_workers`` threads besides the caller (-1 = physical cores - 2),
    spinning ``spin_us`` for new work before sleeping. After this call the runtime leaves it alone."""
    global _configured_by_user
    _host.configure_workers(n_workers, spin_us, pin)
    _configured_by_user = True


def tune_workers_for_gpu() -> None:
    """Set the default worker pool for decoding beside a GPU (the CUDA CPU branch calls this): spin
    ``GPU_SPIN_US`` (between the layers of a decode step sleeping workers cost a futex wake each, and on
    the H200 host the old 100 us spin lost 1.6x decode speed) and `gpu_workers` threads (bench/RESULTS.md).
    A pool the user configured is kept."""
    if _configured_by_user:
        return
    info = _host.worker_info()
    n = gpu_workers(int(info["physical_cores"]))
    if info["spin_us"] < GPU_SPIN_US or info["n_workers"] != n:
        _host.configure_workers(n, GPU_SPIN_US, True)


def expert_call_totals() -> tuple[int, int]:
    """(calls, weight bytes read) of every CPU expert call with tasks since start-up, in any thread: a
    run's effective CPU expert rate is the bytes' difference over its time."""
    t = _host.expert_call_totals()
    return int(t["calls"]), int(t["weight_bytes"])


def expert_call_time_totals() -> dict:
    """The times (us) of every CPU expert call with tasks since start-up, summed (``calls``: how many):
    ``total_us``, ``setup_us``, and per round (``layouts``, ``phase1`` = gate/up, ``phase2`` = down) its wall
    time ``<round>_us`` and the caller's wait for the other threads ``<round>_wait_us``, as in
    ``_host.last_expert_call()``, and ``weight_bytes`` (as `expert_call_totals`): differences over a run give
    where its calls spent their time."""
    return dict(_host.expert_call_totals())


def worker_info() -> dict:
    return dict(_host.worker_info())


def cuda_built() -> bool:
    return bool(_host.cuda_built())


def cuda_device_count() -> int:
    return int(_host.cuda_device_count())
