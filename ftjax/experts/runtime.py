"""Choosing and building an expert backend: the user-facing knobs (policy, VRAM budget) in one place.

>>> backend, state, info = build_backend(cfg, banks, OffloadConfig(policy="lru-split", vram_gib=8))

``policy=None`` with no budget keeps every expert resident (``ResidentExperts``); any named policy
runs ``OffloadExperts`` over a host pool (``resident`` preloads the whole pool into the slot cache and
fails with a clear error when the budget cannot hold it).
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from ftjax.experts import bandwidth as bw
from ftjax.experts.cache import slots_for_budget
from ftjax.experts.policies import POLICIES, get_policy, min_slots

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """policy: one of ``POLICIES`` or None (all resident, no cache); vram_gib: expert-cache budget
    (None: the whole pool); num_slots overrides the budget; fill_cap bounds fills per layer call;
    online: refine the miss split from measured step times; kernel: the device-side expert code,
    "jnp" or "pallas" (``ftjax.experts.kernels``); background_fills: lru-split decode calls may fill in
    the background (``OffloadExperts.defer_fills``; None: on the GPU, not on the CPU); unit_split: such a
    call fills its experts' first units now and the CPU computes the rest (``OffloadExperts.unit_split``;
    None: ``default_unit_split``, on the GPU with the jnp kernel and bf16/f32 pools); down_layout: the host
    pool's down bank as built from ``banks`` (``HostPool`` down_layout: "hi" as torch's [H, I], "ih" stored
    transposed so a unit window is whole rows; None: "hi")."""

    policy: str | None = None
    vram_gib: float | None = None
    num_slots: int | None = None
    fill_cap: int | None = None
    online: bool = True
    kernel: str = "jnp"
    background_fills: bool | None = None
    unit_split: bool | None = None
    down_layout: str | None = None

    def __post_init__(self):
        from ftjax.experts.kernels import check_kernel

        check_kernel(self.kernel)
        if self.background_fills not in (None, True, False):
            raise ValueError(f"background_fills must be None, True or False, got {self.background_fills!r}")
        if self.unit_split not in (None, True, False):
            raise ValueError(f"unit_split must be None, True or False, got {self.unit_split!r}")
        if self.down_layout not in (None, "hi", "ih"):
            raise ValueError(f"down_layout must be None, 'hi' or 'ih', got {self.down_layout!r}")
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} unknown; valid: {sorted(POLICIES)}")
        if self.vram_gib is not None and not self.vram_gib >= 0:
            raise ValueError(f"vram_gib must be >= 0, got {self.vram_gib}")
        if self.num_slots is not None and self.num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {self.num_slots}")

    @property
    def offloaded(self) -> bool:
        return self.policy is not None or self.vram_gib is not None or self.num_slots is not None


def default_platform() -> str:
    import jax

    return "cuda" if jax.default_backend() == "gpu" else "cpu"


def build_backend(cfg, banks=None, config: OffloadConfig | None = None, *, pool=None, max_tokens: int = 256,
                  dtype=None, platform: str | None = None):
    """``(backend, expert_state, info)`` for model config ``cfg``.

    ``banks``: host banks ``{"gate_up", "down"}`` (copied into a new ``HostPool`` when no ``pool`` is
    given). ``info``: policy, slots, bandwidth in use, cache bytes.
    """
    from ftjax.experts.decode import OffloadExperts
    from ftjax.experts.offload_defaults import cache_dtype
    from ftjax.experts.resident import ResidentExperts
    from ftjax.host.pool import HostPool

    config = config or OffloadConfig()
    if not config.offloaded:
        state = ResidentExperts.init_state(banks, dtype=dtype)
        backend = ResidentExperts(cfg.num_experts, kernel=config.kernel)
        return backend, state, {"policy": "resident-banks", "num_slots": None}
    policy = get_policy(config.policy or "lru-split")
    if pool is None:
        pool = HostPool.from_banks({k: np.asarray(banks[k]) for k in ("gate_up", "down")},
                                   down_layout=config.down_layout or "hi")
    L, E = cfg.num_layers, cfg.num_experts
    itemsize = np.dtype(cache_dtype(pool)).itemsize
    slot_bytes = 3 * pool.hidden * pool.inter * itemsize
    if config.num_slots is not None:
        S = config.num_slots
    elif config.vram_gib is not None:
        S = slots_for_budget(config.vram_gib * 2**30, slot_bytes, L * E)
    else:
        S = L * E
    if not policy.uses_cache:
        S = 0
    lo = min_slots(policy, L, E)
    if S < lo:
        raise ValueError(f"VRAM budget too small for policy {policy.name!r}: {S} expert slots of "
                         f"{slot_bytes / 2**20:.1f} MiB fit, it needs at least {lo} "
                         f"({lo * slot_bytes / 2**30:.2f} GiB)")
    platform = platform or default_platform()
    if platform == "cuda":
        pool.pin_if_cuda()
    band = bw.load_bandwidth()
    backend = OffloadExperts(pool, L, E, S, policy, fill_cap=config.fill_cap, platform=platform,
                             max_tokens=max_tokens, kernel=config.kernel, defer_fills=config.background_fills,
                             unit_split=config.unit_split)
    state = backend.init_state(fill_fraction=band.fill_fraction)
    info = {"policy": policy.name, "num_slots": S, "slot_bytes": slot_bytes, "platform": platform,
            "bandwidth": band, "cache_fraction": S / (L * E)}
    return backend, state, info
