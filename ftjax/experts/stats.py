"""Per-layer expert statistics, accumulated on the device by the plan and read without stalling decode.

After a step, :meth:`ExpertStats.after_step` takes a copy of the stats arrays (a tiny jitted copy: the
next step donates the state) and starts its transfer to the host; :meth:`read` returns the newest copy
whose transfer has completed, so a reader never waits for the step in flight. It copies after every
``every``-th step (default 8): the copy reads buffers that the next step donates. On the H200 the
benchmark's online-split row, which copied after every step, ran 1.3-2.3x slower than the fixed split
in a loop that dispatches steps back to back; with a copy every 8th step it ran at 0.91 of it (on a
noisier host; the copy is the suspected cause, not isolated: bench/RESULTS.md, session 5). The online
split tuner needs one reading per window of 16 steps.
"""
from __future__ import annotations

import threading

import numpy as np

from ftjax.experts.cache import STAT_KEYS, snapshot_stats


class ExpertStats:
    """The device counters are int32 and wrap (a busy server passes 2^31 hits of a layer within a day);
    the host accumulates int64 totals from the wrapped differences between consecutive snapshots
    (fewer than 2^32 events apart). A ``calls`` counter going down means the state was re-initialised:
    its counts restart from zero and add on."""

    def __init__(self, every: int = 8):
        if every < 1:
            raise ValueError(f"every must be >= 1 step, got {every}")
        self.every, self._steps = every, 0
        self._lock = threading.Lock()
        self._pending = None
        self._raw: dict[str, np.ndarray] | None = None  # the last snapshot as read (uint32)
        self._latest: dict[str, np.ndarray] | None = None  # int64 totals
        self.version = 0  # bumped each time a newer snapshot reaches the host

    def after_step(self, expert_state, force: bool = False) -> None:
        """Count a step; copy the stats after every ``every``-th one (the first included), or now if
        ``force`` (e.g. before a final read)."""
        stats = expert_state.get("stats") if isinstance(expert_state, dict) else None
        if stats is None:
            return
        due = force or self._steps % self.every == 0
        self._steps += 1
        if not due:
            return
        snap = snapshot_stats(stats)
        for v in snap.values():
            v.copy_to_host_async()
        with self._lock:
            self._promote()
            self._pending = snap

    def _promote(self) -> None:
        if self._pending is not None and all(_ready(v) for v in self._pending.values()):
            raw = {k: np.asarray(v).astype(np.uint32) for k, v in self._pending.items()}
            reset = self._raw is None or bool(np.any(raw["calls"].astype(np.int64) < self._raw["calls"]))
            if reset:
                add = {k: v.astype(np.int64) for k, v in raw.items()}
            else:
                add = {k: (v - self._raw[k]).astype(np.int64) for k, v in raw.items()}  # wraps mod 2^32
            self._latest = add if self._latest is None else {k: self._latest[k] + add[k] for k in add}
            self._raw = raw
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
