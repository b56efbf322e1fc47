"""The global expert slot cache (DESIGN.md mechanism 1): device state of the offloaded decode step.

One pool of ``S`` slots shared by every MoE layer; a slot holds one whole (layer, expert) pair in every
bank (``gate_up [S, 2I, H]``, ``down [S, H, I]``); experts are named by the flat id ``l*E + e``.
The state is a pytree of device arrays, donated to and returned by every jitted step:

| key | shape | meaning |
|---|---|---|
| ``gate_up``, ``down`` | ``[S, ...]`` | the slot banks |
| ``slot_of`` | ``[L*E] i32`` | slot of each flat id, -1 = not resident |
| ``owner_of`` | ``[S] i32`` | flat id held by each slot, -1 = empty |
| ``last_use`` | ``[S] i32`` | counter value of the slot's last use (-1 = never): the LRU key |
| ``step`` | ``[] i32`` | the counter, bumped once per MoE layer call |
| ``recency`` | ``[L*E] i32`` | counter value at which each (layer, expert) was last routed |
| ``fill_fraction`` | ``[] f32`` | f = B_P / B_H of the miss split (data, so online refinement never recompiles) |
| ``stats`` | dict of ``[L] i32`` + ``hist [L*E] i32`` | per-layer unique hits, misses, fills, CPU experts, deferred fills, calls; routed-token histogram |

Invariant after every step: ``slot_of`` and ``owner_of`` are inverse maps on their non-negative
entries; ``misses == fills + cpu_experts - deferred`` (a deferred fill's expert is also computed on the
CPU in its call). int32 counters wrap after 2**31 layer calls (days of continuous decoding).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

STAT_KEYS = ("hits", "misses", "fills", "cpu_experts", "deferred", "calls")


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """Static sizes of one slot cache: ``num_layers`` x ``num_experts`` experts, ``num_slots`` slots."""

    num_layers: int
    num_experts: int
    num_slots: int
    hidden: int
    inter: int

    def __post_init__(self):
        for f in ("num_layers", "num_experts", "hidden", "inter"):
            if getattr(self, f) < 1:
                raise ValueError(f"CacheGeometry.{f} must be >= 1, got {getattr(self, f)}")
        if not 0 <= self.num_slots <= self.num_layers * self.num_experts:
            raise ValueError(f"num_slots {self.num_slots} must be in [0, L*E = {self.num_layers * self.num_experts}]")

    @property
    def num_ids(self) -> int:
        return self.num_layers * self.num_experts

    def slot_bytes(self, itemsize: int) -> int:
        """Bytes of one slot across both banks."""
        return 3 * self.hidden * self.inter * itemsize


def slots_for_budget(vram_bytes: float, slot_bytes: int, num_ids: int) -> int:
    """Slots that fit in ``vram_bytes`` (capped at the whole pool ``num_ids``)."""
    if vram_bytes < 0 or slot_bytes < 1:
        raise ValueError(f"need vram_bytes >= 0 and slot_bytes >= 1, got {vram_bytes}, {slot_bytes}")
    return int(min(num_ids, vram_bytes // slot_bytes))


def init_cache_state(geom: CacheGeometry, dtype, fill_fraction: float = 0.5) -> dict:
    """An empty cache (every slot free) with zeroed statistics, on the default device."""
    S, N, L = geom.num_slots, geom.num_ids, geom.num_layers
    stats = {k: jnp.zeros((L,), jnp.int32) for k in STAT_KEYS}
    stats["hist"] = jnp.zeros((N,), jnp.int32)
    return {
        "gate_up": jnp.zeros((S, 2 * geom.inter, geom.hidden), dtype),
        "down": jnp.zeros((S, geom.hidden, geom.inter), dtype),
        "slot_of": jnp.full((N,), -1, jnp.int32),
        "owner_of": jnp.full((S,), -1, jnp.int32),
        "last_use": jnp.full((S,), -1, jnp.int32),
        "step": jnp.zeros((), jnp.int32),
        "recency": jnp.full((N,), -1, jnp.int32),
        "fill_fraction": jnp.asarray(fill_fraction, jnp.float32),
        "stats": stats,
    }


def check_invariants(state: dict, used_slots: np.ndarray | None = None, owners_before: np.ndarray | None = None) -> None:
    """Raise AssertionError when the maps disagree (test helper; reads the state to the host).

    ``used_slots``: slots hit in the last step with ``owners_before`` their owners before it; they must
    still hold the same experts (a slot used in a step is never its victim).
    """
    slot_of, owner_of = np.asarray(state["slot_of"]), np.asarray(state["owner_of"])
    resident = np.flatnonzero(slot_of >= 0)
    assert np.all(owner_of[slot_of[resident]] == resident), "slot_of -> owner_of is not the identity"
    held = np.flatnonzero(owner_of >= 0)
    assert np.all(slot_of[owner_of[held]] == held), "owner_of -> slot_of is not the identity"
    assert len(np.unique(owner_of[held])) == len(held), "an expert owns two slots"
    if used_slots is not None:
        assert np.all(owner_of[used_slots] == owners_before), "a slot used in the step was evicted"


PRELOAD_CHUNK = 256


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_rows(bank, rows, lo):
    return jax.lax.dynamic_update_slice_in_dim(bank, rows, lo, 0)


def preload(state: dict, flat_ids, banks: dict) -> dict:
    """Host-side: put ``flat_ids`` (at most S, distinct) in slots ``0..n-1`` and reset the maps.

    For the ``static`` (hot set) and ``resident`` policies, at a safe point (no step in flight).
    ``banks`` are host arrays ``{"gate_up": [L*E, 2I, H], "down": [L*E, H, I]}`` (the pool's views).
    """
    flat_ids = np.asarray(flat_ids, np.int64)
    S = state["owner_of"].shape[0]
    if len(flat_ids) > S or len(np.unique(flat_ids)) != len(flat_ids):
        raise ValueError(f"preload needs at most {S} distinct ids, got {len(flat_ids)}")
    n = len(flat_ids)
    out = dict(state)
    for b in ("gate_up", "down"):  # in chunks, into the donated bank: host and device hold one copy each
        bank = state[b]
        for lo in range(0, n, PRELOAD_CHUNK):
            rows = np.asarray(banks[b][flat_ids[lo:lo + PRELOAD_CHUNK]]).astype(bank.dtype)
            bank = _write_rows(bank, jnp.asarray(rows), jnp.int32(lo))
        out[b] = bank
    slot_of = np.full(state["slot_of"].shape, -1, np.int32)
    slot_of[flat_ids] = np.arange(n, dtype=np.int32)
    owner_of = np.full((S,), -1, np.int32)
    owner_of[:n] = flat_ids
    last_use = np.full((S,), -1, np.int32)
    last_use[:n] = np.asarray(state["step"])
    out.update(slot_of=jnp.asarray(slot_of), owner_of=jnp.asarray(owner_of), last_use=jnp.asarray(last_use))
    return out


def read_stats(state_stats: dict) -> dict[str, np.ndarray]:
    """Host copies of the statistics arrays (blocks until they are computed)."""
    return {k: np.asarray(v) for k, v in state_stats.items()}


# ``x + 0`` rather than an identity: jit forwards returned inputs, which the next step would donate.
snapshot_stats = jax.jit(lambda stats: jax.tree.map(lambda x: x + 0, stats))
"""A fresh copy of the stats (not donated by the next step), to read later without stalling decode."""
