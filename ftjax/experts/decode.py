"""``OffloadExperts``: the offloaded MoE backend (DESIGN.md mechanisms 1-3) behind the expert interface.

One MoE layer call, inside the model's jitted step (fixed shapes, no host sync):

1. plan (``plan.py``): dedup, hits, misses, ``n_fill``, LRU victims; cache maps updated in place;
2. submit the CPU branch (the misses left to the CPU, computed where they lie in the host pool);
3. fill the chosen misses into their victim slots (or, for a deferred decode call, start the fills in
   the background and compute those experts on the CPU this time);
4. GPU grouped expert compute over hits + fills (gather GEMVs for decode, ragged dots for prefill;
   the Pallas kernels replace these);
5. collect the CPU partial and add it. Router ids, top-k and gate weights are never changed.

Platforms: ``"cuda"`` (the product) fills with the ``expert_fill`` FFI kernel reading the pinned pool
zero-copy and overlaps the CPU branch through ``cpu_experts_submit``/``collect``; ``"cpu"`` (CI, no
GPU) keeps the "GPU cache" as CPU-device arrays, fills through a host callback gathering pool rows and
runs the CPU branch synchronously through ``cpu_experts``.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.experts.cache import CacheGeometry, init_cache_state, preload
from ftjax.experts.interface import combine_routes, expert_mlp
from ftjax.experts.kernels import check_kernel, decode_routes, prefill_layer
from ftjax.experts.offload_defaults import (BACKGROUND_FILL_BLOCKS, DEFAULT_BACKGROUND_YIELD, DEFAULT_FILL_BESIDE,
                                            DEFAULT_HOST_PLAN, DEFAULT_PLAN_PUBLISH, FILL_BESIDE_BLOCKS,
                                            PLAN_PUBLISH_MAX_X_BYTES, cache_dtype, check_yield, default_unit_split,
                                            default_victims_by, unit_granule)
from ftjax.experts.plan import (BACKGROUND_KEYS, PLAN_IMPLS, VICTIM_METHODS, cpu_tasks, plan_layer,
                                record_background)
from ftjax.experts.plan_fused import plan_layer_fused, plan_statics
from ftjax.experts.policies import Policy, get_policy, min_slots
from ftjax.experts.resident import _ragged_routes
from ftjax.host import quant, tune_workers_for_gpu
from ftjax.host.ffi import cpu_experts
from ftjax.host.pool import HostPool

log = logging.getLogger(__name__)
PLATFORMS = ("cpu", "cuda")
_channels = itertools.count(1 << 20)  # CUDA CPU-branch channel ids, unique per process


def _release_cuda(made: dict) -> None:
    """A dropped CUDA backend's CPU-branch staging (pinned, ~4 MiB per layer at 256 tokens) and background
    state. Runs when the backend is unreachable, so no step can still be enqueued on them; each destroy
    first waits for the GPU to finish what was enqueued."""
    from ftjax.host import cuda

    try:
        for ch in made["channels"]:
            cuda.destroy_channel(ch)
        if made["background"] is not None:
            cuda.destroy_background(made["background"])
    except Exception as e:  # noqa: BLE001  (a finalizer: report, never raise into the collector)
        warnings.warn(f"freeing a CUDA expert backend's staging failed: {e}", RuntimeWarning, stacklevel=1)


@dataclasses.dataclass(frozen=True, eq=False)
class OffloadExperts:
    """Experts in ``pool`` (flat ids ``l*E + e``) served through a global slot cache of ``num_slots``.

    Hashable by identity (jitted steps take it as static). ``fill_cap`` bounds fills per layer call
    (None: the batch's unique experts). ``max_tokens`` sizes the CUDA CPU-branch staging (the largest
    T of any call: the prefill chunk). ``gather_max_routes``: decode-style gather GEMVs up to this
    many routes, ragged dots beyond (default E). ``kernel``: the device-side expert code, ``"jnp"``
    or ``"pallas"`` (``ftjax.experts.kernels``; bf16 caches). ``fused_handshake``: the one-kernel CPU-branch
    submit and collect (CUDA; default: on the H200 it cost 9.8 us per skipped layer and 58.5 us per
    one-task round trip, against 22.6 and 63.9 us for the memcpy-node path). ``plan_impl``: how the plan
    is computed (``plan.plan_layer``'s ``impl``; same results): "fused" (default: one native call,
    ``ftjax.experts.plan_fused``; one kernel on the GPU), or the jnp plan "scatter", "mixed", "dense".
    ``victims_by``: how the plan ranks the LRU victims (``plan.plan_layer``: "topk", "rank"; same slots);
    None picks `default_victims_by` for the platform and cache size. ``defer_fills``: decode calls of
    ``lru-split`` may defer their fills (``plan.defer_fills``: at the H200's bandwidths a call with one
    miss): the missed experts are computed on the CPU in that call, the fill lists wait in the state
    (``bg_ids``/``bg_slots``/``bg_n``, one row per layer), and after the step's last layer one
    ``cuda.background_fork`` starts them all on a side stream (BACKGROUND_FILL_BLOCKS thread blocks each,
    so they run beside the next step's GPU work); each layer's next call waits for its own
    (``cuda.background_wait``, inside the command buffer). None (default): on for the CUDA platform,
    off for the CPU one (which would fill at once anyway: the routing is the same, which CI tests).
    On the H200 (40 layers, 37%, trace routing; bench/RESULTS.md, session 10) it ran 1.06x lru-split
    without it at batch 1 and 1.03x at batch 4.
    ``unit_split`` (with ``defer_fills``): a decode call splits the experts it fills by intermediate
    units instead of deferring whole experts (``plan.split_units``): the GPU computes units [0, u) of
    their routes from the filled slot, the CPU units [u, I) (``ExpertCall.unit_start``), and the slot
    is completed in the background. On the CUDA platform the call's fill copies units [0, u) of its
    experts (`cuda.expert_fill_units`: gate rows, up rows, down columns; bf16/f32 pools), the CPU branch
    gets each route's unit start, and the step's background fill copies the split slots' units [u, I). On
    the CPU platform the fill is whole and at once. Both kernels: the Pallas decode GEMV takes each
    route's units (`decode_experts(units=)`), and a decode call of more routes than the GEMV's limit runs
    the GEMV too (the prefill kernel computes whole experts only; prefill calls are never split). Not built:
    int4 pools on CUDA (the partial copy of the packed layout). None (default): `default_unit_split`, on
    where it runs and measured faster than deferring whole experts, off elsewhere. ``unit_granule``: the
    split's step in units (u is a multiple of it; int4 pools: a multiple of the int4 group); None (default):
    `unit_granule` of the pool.
    ``background_yield`` (CUDA, background fills): the step's background fill pauses while the transfers a
    decode call waits for run (`cuda.set_background_yield`): "fills" its in-step fills, "cpu" its CPU
    branches (submitted, not yet collected), "fills+cpu" both, "off" never; a pause lasts at most 200 us
    (2 ms per fork and thread in all). None (default): DEFAULT_BACKGROUND_YIELD. `set_background_yield`
    changes it for the next steps without recompiling.
    ``host_plan`` (CUDA decode calls with a CPU branch, the fused plan): the CPU branch's tasks are decided on
    the host from the router's output and what the plan reads of the cache state, staged by
    `cuda.cpu_experts_publish` before the plan kernel (``cpp/host_plan.h``), so the CPU call starts without
    waiting for the plan kernel and the submit kernel; the collect checks the host's tasks against the device
    plan's (a mismatch fails the call: NaN, never a silent error). None (default): DEFAULT_HOST_PLAN.
    ``plan_publish`` (CUDA decode calls with a CPU branch, the fused plan, x up to PLAN_PUBLISH_MAX_X_BYTES):
    the plan kernel itself stages x and the CPU branch's tasks and publishes the request once the task list
    is known, before it chooses the victims (`plan_layer_fused(publish_x=, channel=)`): no submit kernel, and
    the CPU call starts inside the plan kernel. None (default): DEFAULT_PLAN_PUBLISH. Not with host_plan.
    ``fill_beside`` (CUDA decode calls under the unit split): one custom call fills the call's units [0, u)
    and computes the filled routes from their slots (`cuda.expert_fill_beside`, ``cpp/fill_beside.cu``);
    the GEMV of the other routes does not wait for the transfer, so under XLA's concurrent command-buffer
    scheduling (``ftjax.xla_flags``) it runs beside it. ``fill_beside_blocks``: the fill's thread blocks (0:
    the default fill's grid). None (default): DEFAULT_FILL_BESIDE, FILL_BESIDE_BLOCKS. ``fill_beside_gemv``
    (with fill_beside): that call also computes the hit routes, beside its fill on a side stream of its own, so
    the overlap needs no concurrent scheduling and no XLA GEMV runs in those layer calls.
    Call `drain` before dropping a state on the GPU (a background fill may still be writing its banks).
    """

    pool: HostPool
    num_layers: int
    num_experts: int
    num_slots: int
    policy: Policy = dataclasses.field(default_factory=lambda: get_policy("lru-split"))
    fill_cap: int | None = None
    platform: str = "cpu"
    max_tokens: int = 256
    gather_max_routes: int | None = None
    kernel: str = "jnp"
    fused_handshake: bool = True
    plan_impl: str = "fused"
    victims_by: str | None = None
    defer_fills: bool | None = None
    unit_split: bool | None = None
    unit_granule: int | None = None
    background_yield: str | None = None
    host_plan: bool | None = None
    plan_publish: bool | None = None
    fill_beside: bool | None = None
    fill_beside_blocks: int | None = None
    fill_beside_gemv: bool = False
    channel_base: int = -1
    background_id: int = -1

    def __post_init__(self):
        object.__setattr__(self, "policy", get_policy(self.policy))
        if self.defer_fills is None:
            object.__setattr__(self, "defer_fills", self.platform == "cuda")
        if self.defer_fills not in (True, False):
            raise ValueError(f"defer_fills must be None, True or False, got {self.defer_fills!r}")
        L, E = self.num_layers, self.num_experts
        if L * E != self.pool.n_experts:
            raise ValueError(f"{L} layers x {E} experts != the pool's {self.pool.n_experts} experts")
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform {self.platform!r} unknown; valid: {PLATFORMS}")
        lo = min_slots(self.policy, L, E)
        hi = L * E if self.policy.uses_cache else 0
        if not lo <= self.num_slots <= hi:
            raise ValueError(f"policy {self.policy.name!r} needs {lo} <= num_slots <= {hi}, got {self.num_slots}"
                             + (" (the expert pool does not fit the VRAM budget)" if self.policy.preload == "all" else ""))
        fills = self.num_slots > 0 and self.policy.update and {self.policy.decode_rule, self.policy.prefill_rule} != {"none"}
        if self.platform == "cuda" and self.pool.format == "int4" and fills:
            raise NotImplementedError(f"policy {self.policy.name!r} fills the GPU cache, and the CUDA fill copies bf16/f32 "
                                      "pools only (dequantizing int4 rows into the bf16 slots on the GPU is not built); "
                                      "int4 pools run on the CUDA platform under 'cpu', 'static' or 'resident'")
        if self.unit_split is None:
            object.__setattr__(self, "unit_split", default_unit_split(self.platform, self.background_fills,
                                                                      self.pool, self.kernel))
        if self.unit_split not in (True, False):
            raise ValueError(f"unit_split must be None, True or False, got {self.unit_split!r}")
        if self.unit_split:
            if not self.background_fills:
                raise ValueError("unit_split completes the split slots in the background: it needs defer_fills "
                                 "and a policy that splits misses (lru-split)")
            if self.platform == "cuda" and self.pool.format == "int4":
                raise NotImplementedError("unit_split on CUDA copies bf16/f32 pools only (the partial fill of the "
                                          "packed int4 layout is not built)")
        if self.unit_granule is None:
            object.__setattr__(self, "unit_granule", unit_granule(self.pool))
        g = self.unit_granule
        if not isinstance(g, (int, np.integer)) or isinstance(g, bool) or g < 1:
            raise ValueError(f"unit_granule must be a positive int, got {g!r}")
        if self.pool.format == "int4" and g % quant.GROUP:
            raise ValueError(f"unit_granule {g} is not a multiple of {quant.GROUP} (an int4 group of the down matrix)")
        if self.unit_split and self.pool.inter % g:
            raise ValueError(f"unit_split needs the expert intermediate size ({self.pool.inter}) to be a "
                             f"multiple of unit_granule ({g})")
        if self.background_yield is None:
            object.__setattr__(self, "background_yield", DEFAULT_BACKGROUND_YIELD)
        if self.host_plan is None:
            object.__setattr__(self, "host_plan", DEFAULT_HOST_PLAN and self.plan_impl == "fused")
        if self.host_plan not in (True, False):
            raise ValueError(f"host_plan must be None, True or False, got {self.host_plan!r}")
        if self.host_plan and self.plan_impl != "fused":
            raise ValueError("host_plan checks the host's CPU tasks against the fused plan's: it needs "
                             "plan_impl='fused'")
        if self.plan_publish is None:
            object.__setattr__(self, "plan_publish", DEFAULT_PLAN_PUBLISH and self.plan_impl == "fused"
                               and not self.host_plan)
        if self.plan_publish not in (True, False):
            raise ValueError(f"plan_publish must be None, True or False, got {self.plan_publish!r}")
        if self.plan_publish and (self.plan_impl != "fused" or self.host_plan):
            raise ValueError("plan_publish is the fused plan kernel's (plan_impl='fused'), and the host plan "
                             "publishes its own request: not both")
        if self.fill_beside is None:
            object.__setattr__(self, "fill_beside", DEFAULT_FILL_BESIDE and self.platform == "cuda"
                               and self.unit_split)
        if self.fill_beside not in (True, False):
            raise ValueError(f"fill_beside must be None, True or False, got {self.fill_beside!r}")
        if self.fill_beside and not (self.platform == "cuda" and self.unit_split):
            raise ValueError("fill_beside is the CUDA unit split's in-step fill: it needs platform='cuda' and "
                             "unit_split")
        if not isinstance(self.fill_beside_gemv, bool) or (self.fill_beside_gemv and not self.fill_beside):
            raise ValueError(f"fill_beside_gemv must be True or False, and True only with fill_beside, got "
                             f"{self.fill_beside_gemv!r} (fill_beside {self.fill_beside!r})")
        if self.fill_beside_blocks is None:
            object.__setattr__(self, "fill_beside_blocks", FILL_BESIDE_BLOCKS)
        b = self.fill_beside_blocks
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 0:
            raise ValueError(f"fill_beside_blocks must be an int >= 0 (0: the default fill's grid), got {b!r}")
        check_yield(self.background_yield)
        check_kernel(self.kernel, self.pool.hidden, self.pool.inter, cache_dtype(self.pool) if self.num_slots else None)
        if self.plan_impl not in PLAN_IMPLS:
            raise ValueError(f"plan_impl {self.plan_impl!r} unknown; valid: {PLAN_IMPLS}")
        if self.victims_by is None:
            object.__setattr__(self, "victims_by", default_victims_by(self.platform, self.num_slots))
        if self.victims_by not in VICTIM_METHODS:
            raise ValueError(f"victims_by {self.victims_by!r} unknown; valid: {tuple(VICTIM_METHODS)}")
        if self.fill_cap is not None and self.fill_cap < 1:
            raise ValueError(f"fill_cap must be >= 1 or None, got {self.fill_cap}")
        if self.platform == "cuda":
            from ftjax.host import cuda

            if not self.pool.pinned:
                raise ValueError("the CUDA path reads the pool zero-copy: pin it first (HostPool.pin_if_cuda)")
            base = next(_channels) * 1024
            object.__setattr__(self, "channel_base", base)
            if self.cpu_branch:
                tune_workers_for_gpu()
            made = {"channels": [], "background": None}  # freed with the backend, even if a creation fails
            weakref.finalize(self, _release_cuda, made).atexit = False
            for layer in range(L if self.cpu_branch else 0):
                cuda.create_channel(base + layer, self.pool, self.max_tokens,
                                    self.max_tokens * max(1, E))
                made["channels"].append(base + layer)
            if self.background_fills:
                object.__setattr__(self, "background_id", cuda.create_background(L, self.background_capacity))
                made["background"] = self.background_id
                cuda.set_background_yield(self.background_id, self.background_yield)

    def uses_host_plan(self, decode: bool) -> bool:
        """Whether a call takes the host plan's CPU branch (``host_plan``): CUDA decode calls with a CPU branch."""
        return bool(self.host_plan) and self.platform == "cuda" and self.cpu_branch and decode

    def uses_plan_publish(self, decode: bool, x) -> bool:
        """Whether the plan kernel publishes the call's CPU branch (``plan_publish``): CUDA decode calls with a
        CPU branch whose x fits PLAN_PUBLISH_MAX_X_BYTES."""
        return (bool(self.plan_publish) and self.platform == "cuda" and self.cpu_branch and decode
                and x.size * x.dtype.itemsize <= PLAN_PUBLISH_MAX_X_BYTES)

    def set_background_yield(self, mode: str) -> None:
        """``background_yield`` from the next step on (the compiled step is unchanged: the fork reads it)."""
        check_yield(mode)
        object.__setattr__(self, "background_yield", mode)
        if self._gpu_background:
            from ftjax.host import cuda

            cuda.set_background_yield(self.background_id, mode)

    def cpu_served(self) -> tuple[int, float]:
        """CPU-branch jobs served so far over this backend's layers and the coordinator's seconds in them
        (request seen -> done published: the CPU expert call, not the handshake); (0, 0.0) off CUDA,
        where the CPU branch is a synchronous call inside the step."""
        if self.platform != "cuda" or not self.cpu_branch:
            return 0, 0.0
        from ftjax.host import cuda

        per = [cuda.channel_served(self.channel_base + layer) for layer in range(self.num_layers)]
        return sum(j for j, _ in per), sum(s for _, s in per)

    @property
    def background_fills(self) -> bool:
        """Decode fills may run in the background (``defer_fills`` under a policy that splits misses)."""
        return bool(self.defer_fills) and self.policy.decode_rule == "balance" and self.policy.update

    @property
    def _gpu_background(self) -> bool:
        """Background fills on a side stream: the CUDA platform with `background_fills`."""
        return self.platform == "cuda" and self.background_fills

    @property
    def background_capacity(self) -> int:
        """Columns of the per-layer background fill lists: the most fills one decode call can make."""
        cap = min(self.num_experts, self.num_slots)
        return max(1, cap if self.fill_cap is None else min(cap, self.fill_cap))

    def drain(self, check: bool = True) -> None:
        """Wait on the host until every background fill issued so far has landed (before dropping or
        reading a state's banks outside a step; a no-op off the GPU). ``check``: raise if a layer's wait
        for its background fill timed out (that layer then read slots not yet filled)."""
        if self._gpu_background:
            from ftjax.host import cuda

            cuda.sync_fills()
            if check and self.background_failed():
                raise RuntimeError("a decode step gave up waiting for a background expert fill (timeout): "
                                   "its outputs may be wrong")

    def background_failed(self) -> bool:
        """Whether a step of the current state gave up waiting for a background fill (its layer read
        slots not yet filled). A flag in mapped host memory: no synchronization; exact for every step
        whose outputs the host has read."""
        if not self._gpu_background:
            return False
        from ftjax.host import cuda

        return cuda.background_error(self.background_id)

    @property
    def cpu_branch(self) -> bool:
        """False when no call can miss (``resident``: the whole pool preloaded, never evicted)."""
        return self.policy.preload != "all"

    @property
    def geometry(self) -> CacheGeometry:
        return CacheGeometry(self.num_layers, self.num_experts, self.num_slots, self.pool.hidden, self.pool.inter)

    def init_state(self, fill_fraction: float = 0.5) -> dict:
        """An empty cache (``resident``: every expert preloaded) in the pool's compute dtype. Waits for
        this backend's background fills first (they may still write the banks of a state being replaced)
        and clears `background_failed` (it was about the replaced state)."""
        self.drain(check=False)
        state = init_cache_state(self.geometry, cache_dtype(self.pool), fill_fraction)
        if self._gpu_background:  # no failed wait yet; the step's deferred fill lists, per layer
            from ftjax.host import cuda

            cuda.clear_background_error(self.background_id)
            F = self.background_capacity
            state.update(bg_ids=jnp.zeros((self.num_layers, F), jnp.int32),
                         bg_slots=jnp.zeros((self.num_layers, F), jnp.int32),
                         bg_n=jnp.zeros((self.num_layers,), jnp.int32),
                         bg_from=jnp.zeros((self.num_layers,), jnp.int32))
        if self.policy.preload == "all":
            state = preload(state, np.arange(self.num_layers * self.num_experts), self.host_banks())
        return state

    def freeze_hot_set(self, state: dict) -> dict:
        """``static`` policy: load the ``S`` most routed experts of the histogram so far (host side, at a
        safe point; call after prefill). A no-op for the other policies."""
        if self.policy.preload != "hot":
            return state
        self.drain()
        hist = np.asarray(state["stats"]["hist"])
        order = np.lexsort((np.arange(len(hist)), -hist))  # most routed first, ties to the lower id
        hot = order[:self.num_slots][hist[order[:self.num_slots]] > 0]
        return preload(state, hot, self.host_banks())

    def host_banks(self) -> dict[str, np.ndarray]:
        """Float views (or dequantized copies, for int4) of the pool's banks."""
        if self.pool.format != "int4":
            return {b: self.pool.bank(b) for b in ("gate_up", "down")}
        return {b: _DequantBank(self.pool, b) for b in ("gate_up", "down")}

    # ----------------------------------------------------------------------------------- the step
    def __call__(self, state, layer: int, x, expert_ids, gate_weights, token_valid, *, decode: bool = False):
        T, k = expert_ids.shape
        E = self.num_experts
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside the pool's {self.num_layers} layers")
        if self.platform == "cuda":  # (the CUDA calls of the step: submit or publish, collect, background)
            from ftjax.host import cuda
        rule = self.policy.rule(decode)
        background = self._gpu_background
        bg_decode = background and decode  # this call may defer; the last layer forks the step's fills
        if background:  # this layer's background fill of its last call lands before anything reads the banks
            gu, dn = cuda.background_wait(state["gate_up"], state["down"], self.background_id, layer)
            state = dict(state, gate_up=gu, down=dn)
        plan_args = dict(num_experts=E, rule=rule, fill_cap=self.fill_cap, update=self.policy.update,
                         defer_horizon=self.num_layers if self.background_fills and decode else 0,
                         unit_split=(self.pool.inter, self.unit_granule) if self.unit_split else None)
        recorded = False  # this call's background row written by the plan itself
        if self.platform == "cuda" and self.cpu_branch and T > self.max_tokens:
            raise ValueError(f"{T} tokens in one call, the CPU-branch staging holds {self.max_tokens}")
        token = None
        host_plan = self.uses_host_plan(decode)
        if host_plan:  # the CPU branch starts from the router's output; the plan below decides the same tasks
            statics = plan_statics(layer, T * k, E, state["owner_of"].shape[0], rule=rule, fill_cap=self.fill_cap,
                                   update=self.policy.update, defer_horizon=plan_args["defer_horizon"],
                                   unit_split=plan_args["unit_split"])
            token, *kept = cuda.cpu_experts_publish(x, expert_ids, gate_weights, token_valid, state["fill_fraction"],
                                                    state["slot_of"], state["recency"], state["last_use"],
                                                    state["step"], self.channel_base + layer, statics)
            state = dict(state, **dict(zip(("slot_of", "recency", "last_use", "step"), kept)))
        publishing = self.uses_plan_publish(decode, x)
        if self.plan_impl == "fused" and (self.cpu_branch or bg_decode):
            # the CPU branch's task arrays and the background row in the plan's own call (no XLA glue); with
            # plan_publish the call also submits the CPU branch (its token)
            plan, state, tasks, bg, *published = plan_layer_fused(
                state, layer, expert_ids, token_valid, **plan_args,
                gate_weights=gate_weights if self.cpu_branch else None,
                background={key: state[key] for key in BACKGROUND_KEYS} if bg_decode else None,
                **(dict(publish_x=x, channel=self.channel_base + layer) if publishing else {}))
            if publishing:
                token = published[0]
            if bg is not None:
                state, recorded = dict(state, **bg), True
        else:
            plan, state = plan_layer(state, layer, expert_ids, token_valid, impl=self.plan_impl,
                                     victims_by=self.victims_by, **plan_args)
            tasks = cpu_tasks(plan, layer, expert_ids, gate_weights, E) if self.cpu_branch else None
        cpu_args = (x, *tasks, plan.n_cpu_routes) if tasks is not None else None
        y_cpu = jnp.zeros(x.shape, jnp.float32)
        if not self.cpu_branch or host_plan or publishing:
            pass  # every expert is in the cache: nothing can miss; or the call is on its way (host or plan kernel)
        elif self.platform == "cuda":
            token = cuda.cpu_experts_submit(*cpu_args, channel=self.channel_base + layer,
                                            unit_start=plan.cpu_units if self.unit_split else None,
                                            fused=self.fused_handshake)
        else:
            y_cpu = cpu_experts(*cpu_args, self.pool, unit_start=plan.cpu_units if self.unit_split else None)

        route_slot, beside = plan.route_slot, None
        if plan.fill_ids.shape[0] and self.fill_beside and decode:  # the fill and its routes in one call
            route_slot, beside = self._fill_beside(state, plan, x, token)
        if plan.fill_ids.shape[0]:  # (always, under a policy with background fills: T*k, E, S >= 1)
            if beside is None:
                state = self._fill(state, plan, token, plan.deferred if bg_decode else None)
            if bg_decode and not recorded:  # this call's deferred fills (or none), started after the step's
                # last layer; under the unit split a call filled units [0, u): the background copies [u, I)
                state = record_background(state, plan, layer, self.unit_split)
        if self.num_slots:
            y = self._gpu_part(state, layer, x, expert_ids, gate_weights, token_valid, route_slot,
                               plan.route_units if self.unit_split and decode else None,  # (prefill: whole)
                               extra_routes=beside)
        else:
            y = jnp.zeros_like(x)

        if host_plan:
            y_cpu, _status, y = cuda.cpu_experts_collect_checked(token, plan.n_cpu_routes, tasks, plan.cpu_units, T,
                                                                 x.shape[1], self.channel_base + layer, after=y)
        elif token is not None:
            y_cpu, _status, y = cuda.cpu_experts_collect(token, T, x.shape[1], self.channel_base + layer, after=y,
                                                         fused=self.fused_handshake)
        y = (y.astype(jnp.float32) + y_cpu).astype(x.dtype)
        if bg_decode and layer == self.num_layers - 1:  # the step's background fills, after its work
            ids, y = jax.lax.optimization_barrier((state["bg_ids"], y))
            gu, dn = cuda.background_fork(ids, state["bg_slots"], state["bg_n"], state["gate_up"], state["down"],
                                          self.pool, self.background_id, units_from=state["bg_from"],
                                          blocks=BACKGROUND_FILL_BLOCKS)
            state = dict(state, gate_up=gu, down=dn)
        return jnp.where(token_valid[:, None], y, jnp.zeros_like(y)), state

    def _fill(self, state, plan, submit_token=None, deferred=None):
        """The plan's fills on the GPU's stream now, except (CUDA decode with background fills, ``deferred``
        the plan's flag) those of a deferred call, which the step's `cuda.background_fork` starts."""
        gu, dn = state["gate_up"], state["down"]
        if self.platform == "cuda":
            from ftjax.host import cuda

            if self.unit_split:  # whole fills, or a split call's units [0, u) (completed in the background)
                gu, dn = cuda.expert_fill_units(plan.fill_ids, plan.fill_slots, plan.n_fill, plan.fill_units, gu, dn,
                                                self.pool, after_submit=submit_token)
            else:
                now = plan.n_fill if deferred is None else jnp.where(deferred, 0, plan.n_fill)
                gu, dn = cuda.expert_fill(plan.fill_ids, plan.fill_slots, now, gu, dn, self.pool,
                                          after_submit=submit_token)
        else:
            F = plan.fill_ids.shape[0]
            banks = self.host_banks()
            shapes = (jax.ShapeDtypeStruct((F,) + gu.shape[1:], gu.dtype), jax.ShapeDtypeStruct((F,) + dn.shape[1:], dn.dtype))

            def gather(ids, n):
                n = int(n)
                out = [np.zeros(s.shape, s.dtype) for s in shapes]
                for o, b in zip(out, ("gate_up", "down")):
                    o[:n] = banks[b][np.asarray(ids[:n])]
                return tuple(out)

            rows_gu, rows_dn = jax.pure_callback(gather, shapes, plan.fill_ids, plan.n_fill, vmap_method="sequential")
            S = gu.shape[0]
            dst = jnp.where(jnp.arange(F) < plan.n_fill, plan.fill_slots, S)
            gu = gu.at[dst].set(rows_gu, mode="drop")
            dn = dn.at[dst].set(rows_dn, mode="drop")
        return dict(state, gate_up=gu, down=dn)

    def _fill_beside(self, state, plan, x, submit_token):
        """`cuda.expert_fill_beside` of the plan's fills: the route slots left to the GEMV (-1 for the routes
        of a slot the call fills: the beside call computes those; all -1 with fill_beside_gemv) and the beside
        call's per-route outputs."""
        from ftjax.host import cuda

        gu, dn = state["gate_up"], state["down"]
        y = cuda.expert_fill_beside(x.astype(gu.dtype), plan.route_slot, plan.route_units, plan.fill_ids, plan.fill_slots,
                                    plan.n_fill, plan.fill_units, gu, dn, self.pool, after_submit=submit_token,
                                    blocks=self.fill_beside_blocks, hits=self.fill_beside_gemv)
        if self.fill_beside_gemv:  # every GPU route is in y: none left to the GEMV
            return jnp.full_like(plan.route_slot, -1), y
        F, S = plan.fill_ids.shape[0], gu.shape[0]  # the entries the kernel takes as valid, the same test
        live = ((jnp.arange(F) < plan.n_fill) & (plan.fill_ids >= 0) & (plan.fill_ids < self.pool.n_experts)
                & (plan.fill_slots >= 0) & (plan.fill_slots < S))
        filled = jnp.any((plan.route_slot[:, None] == plan.fill_slots[None, :]) & live[None, :], axis=1)
        return jnp.where(filled, -1, plan.route_slot), y

    def _gpu_part(self, state, layer, x, expert_ids, gate_weights, token_valid, route_slot, route_units=None,
                  extra_routes=None):
        """``y [T, H]``: the weighted sum over the routes with a cache slot (the others are the CPU's).
        ``extra_routes [T*k, H]``: per-route outputs computed elsewhere (`_fill_beside`), added before the sum."""
        T, k = expert_ids.shape
        E = self.num_experts
        gu, dn = state["gate_up"], state["down"]
        limit = E if self.gather_max_routes is None else self.gather_max_routes

        def plus(out):
            return out if extra_routes is None else out + extra_routes.astype(out.dtype)

        if extra_routes is not None and self.fill_beside_gemv:  # the beside call computed every GPU route
            out = extra_routes.astype(x.dtype).reshape(T, k, -1)
            return combine_routes(out, expert_ids, gate_weights, token_valid)

        if self.kernel == "pallas":
            if T * k <= limit or route_units is not None:  # (the prefill kernel computes whole experts only)
                out = plus(decode_routes(x, route_slot, gu, dn, route_units).astype(x.dtype))
                return combine_routes(out.reshape(T, k, -1), expert_ids, gate_weights, token_valid)
            route_valid = (route_slot >= 0).reshape(T, k) & token_valid[:, None]
            slot_e = jnp.maximum(state["slot_of"][layer * E:(layer + 1) * E], 0)
            y = prefill_layer(x, expert_ids, gate_weights, route_valid, gu, dn, slot_e)
            return jnp.where(token_valid[:, None], y.astype(x.dtype), jnp.zeros((), x.dtype))
        out = plus(self._gpu_routes(state, layer, x, expert_ids, route_slot, route_units))
        return combine_routes(out.reshape(T, k, -1), expert_ids, gate_weights, token_valid)

    def _gpu_routes(self, state, layer, x, expert_ids, route_slot, route_units=None):
        """Per-route outputs ``[T*k, H]`` of the routes with a slot; zeros for the others (jnp).
        ``route_units`` (unit split): a route computes only its expert's units [0, u)."""
        T, k = expert_ids.shape
        E = self.num_experts
        gu, dn = state["gate_up"], state["down"]
        limit = E if self.gather_max_routes is None else self.gather_max_routes
        on_gpu = route_slot >= 0
        xc = x.astype(gu.dtype)
        if T * k <= limit or route_units is not None:  # (the ragged dots compute whole experts only)
            slot = jnp.maximum(route_slot, 0)
            out = expert_mlp(jnp.repeat(xc, k, axis=0), gu[slot], dn[slot], units=route_units)
        else:  # prefill: the layer's experts as one bank view over their slots, ragged dots
            slot_e = jnp.maximum(state["slot_of"][layer * E:(layer + 1) * E], 0)
            out = _ragged_routes(xc, expert_ids, gu[slot_e], dn[slot_e])
        return jnp.where(on_gpu[:, None], out, jnp.zeros_like(out)).astype(x.dtype)


class _DequantBank:
    """``bank[ids] -> float32 rows`` of an int4 pool bank (dequantized on the host)."""

    def __init__(self, pool: HostPool, bank: str):
        self.packed, self.scales = pool.int4_parts(bank)

    def __getitem__(self, ids):
        return quant.dequantize_int4(self.packed[ids], self.scales[ids])
