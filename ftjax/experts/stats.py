"""Per-layer expert statistics, accumulated on the device by the plan and read without stalling decode.

After a step, :meth:`ExpertStats.after_step` takes a copy of the stats arrays (a tiny jitted copy: the
next step donates the state) and starts its transfer to the host; :meth:`read` returns the newest copy
whose transfer has completed, so a reader never waits for the step in flight.
"""
from __future__ import annotations

import threading

import numpy as np

from ftjax.experts.cache import STAT_KEYS, snapshot_stats


class ExpertStats:
    def __init__(self):
        self._lock = threading.Lock()
        self._pending = None
        self._latest: dict[str, np.ndarray] | None = None
        self.version = 0  # bumped each time a newer snapshot reaches the host

    def after_step(self, expert_state) -> None:
        stats = expert_state.get("stats") if isinstance(expert_state, dict) else None
        if stats is None:
            return
        snap = snapshot_stats(stats)
        for v in snap.values():
            v.copy_to_host_async()
        with self._lock:
            self._promote()
            self._pending = snap

    def _promote(self) -> None:
        if self._pending is not None and all(_ready(v) for v in self._pending.values()):
            self._latest = {k: np.asarray(v) for k, v in self._pending.items()}
            self._pending = None
            self.version += 1

    def read(self) -> dict[str, np.ndarray] | None:
        with self._lock:
            self._promote()
            return None if self._latest is None else dict(self._latest)

    def misses(self) -> tuple[int | None, int]:
        """``(all misses counted in the newest snapshot on the host, its version)``; never waits."""
        with self._lock:
            self._promote()
            latest, version = self._latest, self.version
        return (None if latest is None else int(latest["misses"].sum())), version

    def summary(self) -> dict:
        """Totals and per-layer lists of hits, misses, fills, CPU experts (unique experts per call)."""
        s = self.read()
        if s is None:
            return {k: 0 for k in STAT_KEYS} | {"per_layer": None}
        out = {k: int(s[k].sum()) for k in STAT_KEYS}
        routed = out["hits"] + out["misses"]
        out["miss_rate"] = out["misses"] / routed if routed else 0.0
        out["per_layer"] = {k: s[k].tolist() for k in STAT_KEYS}
        return out


def _ready(x) -> bool:
    try:
        return bool(x.is_ready())
    except AttributeError:  # older jax: block (the copy is tiny and usually done)
        return True
