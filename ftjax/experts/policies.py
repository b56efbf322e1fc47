"""Expert placement policies: one plan and one decode path, different parameters (for ablations and users).

| policy | decode misses | cache | what it is |
|---|---|---|---|
| ``lru-split`` (default) | ``n_fill = balance(m B_P / B_H)`` filled, the rest on the CPU | global LRU | FreeToken |
| ``lru-fill`` | all filled (as far as evictable slots allow) | global LRU | offload-only engines |
| ``cpu`` | all on the CPU | none (S = 0) | the pure-CPU MoE backend |
| ``static`` | all on the CPU | hot set from the prefill histogram, never updated | llama.cpp-style placement |
| ``resident`` | none | every expert (error when it does not fit) | all on the GPU |

Prefill chunks (T > 1) fill on demand under ``lru-split`` / ``lru-fill`` (the prompt's tokens share
each fill); the other policies prefill as they decode.
"""
from __future__ import annotations

import dataclasses

from ftjax.experts.plan import FILL_RULES


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    decode_rule: str     # plan fill rule for decode steps: "balance" | "all" | "none"
    prefill_rule: str    # the same for prefill chunks
    update: bool         # LRU bookkeeping and fills on (False: the cache content is fixed)
    preload: str | None  # None | "hot" (top experts of the prefill histogram) | "all"
    uses_cache: bool = True

    def __post_init__(self):
        for rule in (self.decode_rule, self.prefill_rule):
            if rule not in FILL_RULES:
                raise ValueError(f"policy {self.name!r}: fill rule {rule!r} unknown; valid: {FILL_RULES}")

    def rule(self, decode: bool) -> str:
        """The fill rule of a decode step (any batch) or of a prefill chunk."""
        return self.decode_rule if decode else self.prefill_rule


POLICIES: dict[str, Policy] = {
    "lru-split": Policy("lru-split", "balance", "all", True, None),
    "lru-fill": Policy("lru-fill", "all", "all", True, None),
    "cpu": Policy("cpu", "none", "none", False, None, uses_cache=False),
    "static": Policy("static", "none", "none", False, "hot"),
    "resident": Policy("resident", "none", "none", False, "all"),
}
DEFAULT_POLICY = "lru-split"


def get_policy(name: str | Policy) -> Policy:
    if isinstance(name, Policy):
        return name
    if name not in POLICIES:
        raise ValueError(f"expert policy {name!r} unknown; valid: {sorted(POLICIES)}")
    return POLICIES[name]


def min_slots(policy: str | Policy, num_layers: int, num_experts: int) -> int:
    """The smallest legal cache for a policy (0 for ``cpu``, the whole pool for ``resident``)."""
    policy = get_policy(policy)
    if not policy.uses_cache:
        return 0
    return num_layers * num_experts if policy.preload == "all" else 1
