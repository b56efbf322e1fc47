"""Python face of the native host runtime (``ftjax._host``): the host expert pool, the worker pool
and CPU expert kernels, the XLA FFI targets (CPU; CUDA where built) and calibration."""
from __future__ import annotations

from ftjax import _host
from ftjax.host.ffi import cpu_experts, register_targets
from ftjax.host.pool import HostPool

__all__ = ["HostPool", "cpu_experts", "register_targets", "cpu_features", "cpu_brand", "available_tiers",
           "active_tier", "set_tier", "prefetch_bytes", "set_prefetch_bytes", "configure_workers",
           "tune_workers_for_gpu", "worker_info", "cuda_built",
           "cuda_device_count"]


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


GPU_SPIN_US = 2000  # beside a GPU: longer than the gap between the MoE layers of a decode step
_configured_by_user = False


def configure_workers(n_workers: int = -1, spin_us: int = 100, pin: bool = True) -> None:
    """Replace the worker pool: ``n_workers`` threads besides the caller (-1 = physical cores - 2),
    spinning ``spin_us`` for new work before sleeping. After this call the runtime leaves it alone."""
    global _configured_by_user
    _host.configure_workers(n_workers, spin_us, pin)
    _configured_by_user = True


def tune_workers_for_gpu() -> None:
    """Spin the default worker pool for ``GPU_SPIN_US`` (the CUDA CPU branch calls this): between the
    layers of a decode step sleeping workers cost a futex wake each, and on the H200 host the old
    100 us spin lost 1.6x decode speed (bench/RESULTS.md). A pool the user configured is kept."""
    if not _configured_by_user and _host.worker_info()["spin_us"] < GPU_SPIN_US:
        _host.configure_workers(-1, GPU_SPIN_US, True)


def worker_info() -> dict:
    return dict(_host.worker_info())


def cuda_built() -> bool:
    return bool(_host.cuda_built())


def cuda_device_count() -> int:
    return int(_host.cuda_device_count())
