"""B_P / B_H in use for the miss split: from the calibration profile, refined online from step times.

``fill_fraction`` f is what the plan reads (``state["fill_fraction"]``, data: changing it never
recompiles). From a profile with concurrent measurements (both kernels running together, so DRAM
contention is in the numbers) f = B_P / (B_P + B_H) balances F / B_P = (m - F) / B_H; from standalone
numbers the paper's f = B_P / B_H (the CPU loses the fill's share of DRAM bandwidth).

The reference reads a static profile and misfires under contention (FreeToken #151, #436). The
:class:`OnlineSplitTuner` therefore probes f up and down in windows of decode steps and moves it
towards the side with the lower mean step time; the reported B_P is the one that f implies with B_H
held at the profile's value. The objective is time per step, not per missed expert: misses served on
the CPU are not cached, so a CPU-heavy split raises the miss count, and a per-miss cost would reward
exactly that (measured on the H200 at a 37% cache: the q* split ran at 0.71x of the best fixed one).
"""
from __future__ import annotations

import dataclasses
import logging
import math

log = logging.getLogger(__name__)
DEFAULT_B_PCIE_GBPS = 25.0  # PCIe 4 x16 class, used only without a calibration profile
DEFAULT_B_HOST_GBPS = 50.0


@dataclasses.dataclass
class Bandwidth:
    b_pcie_gbps: float
    b_host_gbps: float
    concurrent: bool
    source: str  # "profile" | "default" | "online"

    def __post_init__(self):
        if not (self.b_pcie_gbps > 0 and self.b_host_gbps > 0):
            raise ValueError(f"bandwidths must be > 0 GB/s, got B_P={self.b_pcie_gbps}, B_H={self.b_host_gbps}")

    @property
    def fill_fraction(self) -> float:
        p, h = self.b_pcie_gbps, self.b_host_gbps
        return p / (p + h) if self.concurrent else min(1.0, p / h)

    def with_fraction(self, f: float) -> "Bandwidth":
        """The B_P that fraction f implies, B_H unchanged."""
        f = min(max(f, 1e-3), 1.0 - 1e-3)
        p = self.b_host_gbps * (f / (1 - f) if self.concurrent else f)
        return Bandwidth(p, self.b_host_gbps, self.concurrent, "online")

    def to_dict(self) -> dict:
        return {"b_pcie_gbps": self.b_pcie_gbps, "b_host_gbps": self.b_host_gbps, "concurrent": self.concurrent,
                "source": self.source, "fill_fraction": self.fill_fraction}


def from_profile(profile: dict | None) -> Bandwidth:
    """B_P / B_H of a ``ftjax calibrate`` profile (concurrent pair when measured), else defaults."""
    if profile and profile.get("b_pcie_gbps") and profile.get("b_host_gbps"):
        conc = profile.get("concurrent") or {}
        if conc.get("b_pcie_gbps") and conc.get("b_host_gbps"):
            return Bandwidth(conc["b_pcie_gbps"], conc["b_host_gbps"], True, "profile")
        return Bandwidth(profile["b_pcie_gbps"], profile["b_host_gbps"], False, "profile")
    return Bandwidth(DEFAULT_B_PCIE_GBPS, DEFAULT_B_HOST_GBPS, False, "default")


def load_bandwidth() -> Bandwidth:
    from ftjax.host.calibrate import load_profile

    return from_profile(load_profile())


class OnlineSplitTuner:
    """Hill climbing on the logit of f from measured decode step times.

    Alternate windows of ``window`` decode steps at ``f * exp(+delta)`` and ``f * exp(-delta)`` (in
    logit space); after each pair move f by ``step`` towards the window with the lower mean step time.
    A pair in which either window saw no misses carries no information (f changes nothing then) and
    leaves f where it is.
    """

    def __init__(self, bandwidth: Bandwidth, window: int = 16, delta: float = 0.25, step: float = 0.15):
        self.bandwidth, self.window, self.delta, self.step = bandwidth, window, delta, step
        self._logit = _logit(bandwidth.fill_fraction)
        self._side, self._acc, self._cost = +1, [0.0, 0, 0], {}
        self.moves = 0  # window pairs that moved f (pairs without misses do not)

    @property
    def trial_fraction(self) -> float:
        return _sigmoid(self._logit + self._side * self.delta)

    def record(self, seconds: float, steps: int, misses: int) -> float:
        """Feed ``steps`` decode steps that took ``seconds`` and missed ``misses`` experts in all;
        returns the fraction to use for the next step."""
        self._acc[0] += seconds
        self._acc[1] += steps
        self._acc[2] += misses
        if self._acc[1] >= self.window:
            secs, n, m = self._acc
            self._cost[self._side] = secs / n if m > 0 else None
            self._acc = [0.0, 0, 0]
            if len(self._cost) == 2:
                up, down = self._cost[+1], self._cost[-1]
                if up is not None and down is not None:
                    self._logit += (+1 if up < down else -1) * self.step
                    self.bandwidth = self.bandwidth.with_fraction(_sigmoid(self._logit))
                    self.moves += 1
                self._cost = {}
            self._side = -self._side
        return self.trial_fraction


def _logit(f: float) -> float:
    f = min(max(f, 1e-3), 1 - 1e-3)
    return math.log(f / (1 - f))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


class SplitController:
    """Drives an :class:`OnlineSplitTuner` from the engine's decode loop without stalling it.

    The loop calls :meth:`on_prefill` when a prefill runs (the next interval is not a decode step) and
    :meth:`after_decode` after dispatching each decode step with the newest device miss counter that
    has already reached the host (``ExpertStats``: one step or so behind). Time between consecutive
    decode dispatches is the step time (the scheduler waits for each step's logits); misses arrive when
    their snapshot does and are paired with the time accumulated since the previous snapshot, so a
    window's figures lag by about one step, small against windows of many misses.
    Returns the fill fraction the next step should use, or None while it is unchanged.
    """

    def __init__(self, tuner: OnlineSplitTuner, clock=None):
        import time

        self.tuner, self._clock = tuner, clock or time.perf_counter
        self._last_t: float | None = None
        self._seconds, self._steps = 0.0, 0
        self._misses: int | None = None
        self._snapshot = 0
        self.fraction = tuner.trial_fraction
        self.updates = 0

    @property
    def bandwidth(self) -> Bandwidth:
        return self.tuner.bandwidth

    def on_prefill(self) -> None:
        self._last_t = None

    def after_decode(self, misses_total: int | None, snapshot: int = 0) -> float | None:
        """``misses_total``: all misses counted so far in the newest snapshot on the host (None: none
        yet); ``snapshot``: that snapshot's sequence number (unchanged: no new counts this step)."""
        now = self._clock()
        if self._last_t is not None:
            self._seconds += now - self._last_t
            self._steps += 1
        self._last_t = now
        if misses_total is None or snapshot == self._snapshot:
            return None
        self._snapshot = snapshot
        if self._misses is None or misses_total < self._misses:  # first reading (or counters reset)
            self._misses, self._seconds, self._steps = misses_total, 0.0, 0
            return None
        new, self._misses = misses_total - self._misses, misses_total
        f = self.tuner.record(self._seconds, self._steps, new) if self._steps else self.tuner.trial_fraction
        self._seconds, self._steps = 0.0, 0
        self.updates += 1
        if f == self.fraction:
            return None
        self.fraction = f
        return f

    def to_dict(self) -> dict:
        return {**self.bandwidth.to_dict(), "trial_fill_fraction": self.fraction, "online_updates": self.updates,
                "online_moves": self.tuner.moves}
