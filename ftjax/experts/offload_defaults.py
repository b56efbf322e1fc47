"""``OffloadExperts``' defaults, each with the measurement that chose it (bench/RESULTS.md), and the rules that pick
them per platform, pool and cache size."""
from __future__ import annotations

import jax.numpy as jnp

from ftjax.host import quant
from ftjax.host.pool import HostPool


def cache_dtype(pool: HostPool):
    """Slot banks hold f32 for f32 pools, bf16 otherwise (int4 rows are dequantized on fill)."""
    return jnp.float32 if pool.format == "f32" else jnp.bfloat16


# Thread blocks of a background fill: on the H200 8-16 blocks move a 6.3 MB expert at PCIe speed (44-47
# GB/s) and leave the SMs to the work beside it (16: 0.95 of the fill hidden; 1,056 blocks: none).
BACKGROUND_FILL_BLOCKS = 16
RANK_MAX_SLOTS = 8192  # victims_by="rank" counts over S^2 slot pairs: measured at 3,788 slots only


def default_unit_split(platform: str, background_fills: bool, pool: HostPool, kernel: str) -> bool:
    """``OffloadExperts(unit_split=None)``: the unit split where it runs and measured faster than deferring
    whole experts (H200, bench/RESULTS.md session 18: 1.03-1.07x at batch 1, 1.05x at batch 4): the CUDA
    platform with background fills, the jnp GPU kernel (with the Pallas GEMV it ran 0.89-0.92x), a bf16/f32
    pool (the partial fill of the int4 layout is not built) whose I is a multiple of the granule."""
    return (platform == "cuda" and background_fills and kernel == "jnp" and pool.format != "int4"
            and pool.inter % unit_granule(pool) == 0)


def unit_granule(pool: HostPool) -> int:
    """unit_split's default units per step of the split: an int4 group of the down matrix, else 8. (Steps
    of a cache line, so that the CPU's down window [u, I) starts on one, gained nothing on the H200 host:
    u = 176, mid-line, read at the rate of u = 160 and 192; bench/RESULTS.md session 26.)"""
    return quant.GROUP if pool.format == "int4" else 8


# OffloadExperts.background_yield: what the step's background fill pauses for (cuda.YIELD_MODES).
BACKGROUND_YIELD_MODES = ("off", "fills", "cpu", "fills+cpu")
DEFAULT_BACKGROUND_YIELD = "off"
# OffloadExperts.host_plan's default (off until measured faster on the GPU machine: bench/RESULTS.md).
DEFAULT_HOST_PLAN = False
# OffloadExperts.plan_publish's default (off until measured faster on the GPU machine: bench/RESULTS.md), and
# the largest x it stages (one thread block copies x into the mapped staging: decode batches, not prefill).
DEFAULT_PLAN_PUBLISH = False
PLAN_PUBLISH_MAX_X_BYTES = 32 << 10
# OffloadExperts.fill_beside's default (off: with the CONCURRENT scheduling it needs, slower than the default on the
# GPU machine, bench/RESULTS.md session 43), its fill's blocks (0: the default fill's grid, every SM while it copies).
DEFAULT_FILL_BESIDE = False
FILL_BESIDE_BLOCKS = 32


def check_yield(mode) -> None:
    if not isinstance(mode, str) or mode not in BACKGROUND_YIELD_MODES:
        raise ValueError(f"background_yield must be one of {BACKGROUND_YIELD_MODES} or None, got {mode!r}")


def default_victims_by(platform: str, num_slots: int) -> str:
    """The LRU-victim ranking a backend uses unless told: on the GPU "rank" (two reductions) up to
    RANK_MAX_SLOTS slots, where XLA:GPU's top-k kernels cost 16 us per 16 victims (H200, 40 layers,
    3,788 slots: plan 37.4 -> 26.5 us per layer at batch 1, 118.7 -> 27.3 at batch 4; decode 40 layers,
    37%, batch 4: lru-split 206.0 -> 262.1 tok/s; bench/RESULTS.md session 8); "topk" on the CPU
    backend (there the S^2 count is the slower: 94 vs 36 us per layer at 700 slots) and above that size."""
    return "rank" if platform == "cuda" and num_slots <= RANK_MAX_SLOTS else "topk"
