"""JAX wrappers of the CUDA FFI targets (builds with CUDA, run on a GPU backend).

- ``expert_fill``: copy the first ``n_valid`` (flat id -> slot) entries from the pinned host pool
  into the GPU cache banks, in place (the caches are aliased and should be donated by the caller).
- ``cpu_experts_submit`` / ``cpu_experts_collect``: the CPU branch of a decode step. Submit stages
  x and the task list and rings the coordinator; collect waits (GPU side, with a watchdog timeout)
  and returns ``(y [T, H] f32, status i32)``; status 1 = the CPU made no progress within
  ``timeout_ms``, 2 = the CPU branch failed (``channel_error``); y is NaN then. Order them by data:
  pass the GPU work that should overlap through ``after`` so collect is scheduled behind it.
- ``background_fork`` / ``background_wait``: a decode step's deferred fills, all layers' at once on a
  side stream after the step, each layer's next call waiting (inside the command buffer) for its own.
``cmd_buffer=False`` selects the registrations without the command-buffer trait (for comparison).

None of the calls is declared side-effecting: each one's effect is carried by data (the aliased
caches, the submit token that collect consumes), and a side-effecting call would put an unordered
effect on the whole jitted step, which sends every call through JAX's Python dispatch path (on the
H200, ~10 ms per decode step over the ~700 arguments of a 40-layer model, more than the GPU work).
Order comes from data dependencies alone: callers pin the fill behind the submit with
``after_submit`` and the collect behind the overlapping GPU work with ``after``.
"""
from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from ftjax import _host
from ftjax.host.ffi import register_targets

STATUS = {0: "ok", 1: "timeout: the CPU branch made no progress", 2: "the CPU branch failed",
          3: "the host plan's CPU tasks differ from the device plan's"}


def registration_kwargs(name: str) -> dict:
    return {}  # traits are in the handlers' metadata (XLA ORs them with registration traits)


def available() -> bool:
    """Whether these calls can run here: a CUDA build of the host module, a CUDA device, JAX's GPU backend."""
    try:
        return bool(_host.cuda_built() and _host.cuda_device_count() > 0 and jax.default_backend() == "gpu")
    except RuntimeError:  # no CUDA driver, or JAX has no GPU backend to start
        return False


def create_channel(channel: int, pool, max_tokens: int, max_tasks: int) -> None:
    """Staging for one CPU-branch call site (e.g. one per MoE layer), sized for the largest call."""
    _host.create_channel(int(channel), int(pool.id), int(max_tokens), int(max_tasks))


def destroy_channel(channel: int) -> None:
    """Free a channel's staging (waits until the GPU is idle: work in flight may still use it)."""
    _host.destroy_channel(int(channel))


def live_channels() -> int:
    """CPU-branch channels not yet destroyed."""
    return int(_host.live_channels())


def channel_error(channel: int) -> str:
    return _host.channel_error(int(channel))


def channel_served(channel: int) -> tuple[int, float]:
    """A channel's CPU-branch jobs so far and the coordinator's seconds in them (request seen -> done)."""
    return int(_host.channel_jobs(int(channel))), float(_host.channel_serve_seconds(int(channel)))


# Columns of `channel_stamps`' rows (cpp/ffi_cuda.h StampField, HostStampField).
STAMP_COLUMNS = ("submit_seq", "submit_start", "published", "collect_seq", "collect_start", "done_seen", "collect_end")
HOST_STAMP_COLUMNS = ("seq", "seen", "done", "job")


def channel_stamps(channel: int) -> dict:
    """A channel's stamps, oldest first (the rings keep the last ``_host.STAMP_RING`` calls): ``gpu`` [n, 7] int64,
    one row per fused submit / collect pair (STAMP_COLUMNS; %globaltimer ns; a skipped call's seq is 0), and
    ``host`` [m, 4] int64, one row per request the coordinator served (HOST_STAMP_COLUMNS; steady_clock ns: another
    clock than the GPU's), with the counts so far (``submits``, ``collects``, ``served``). Read it between steps:
    it copies the rings as they are. Only the fused handshake (the default) writes GPU rows."""
    R = int(_host.STAMP_RING)
    gpu = np.zeros((R, int(_host.STAMP_FIELDS)), np.int64)
    host = np.zeros((R, int(_host.HOST_STAMP_FIELDS)), np.int64)
    submits, collects, served = _host.channel_stamps(int(channel), gpu, host)

    def ordered(ring, n, cols):  # (a row's submit and collect halves agree where the two seqs do)
        n = int(n)
        return (np.roll(ring, -(n % R), axis=0) if n > R else ring[:n])[:, :cols]

    return {"gpu": ordered(gpu, collects, len(STAMP_COLUMNS)), "host": ordered(host, served, len(HOST_STAMP_COLUMNS)),
            "submits": int(submits), "collects": int(collects), "served": int(served)}


def _suffix(cmd_buffer: bool) -> str:
    return "" if cmd_buffer else "_nocb"


def expert_fill(ids, slots, n_valid, gate_up_cache, down_cache, pool, *, cmd_buffer: bool = True,
                after_submit=None, blocks: int = 0):
    """``after_submit``: a submit token; the fill is scheduled behind that submit so the CPU branch
    starts first and runs under the fill. ``blocks``: 0 (default) launches enough thread blocks
    per entry to occupy the whole GPU (fastest alone); N > 0 launches N blocks in all that walk the valid
    entries one after the other (on the H200 16 blocks move an expert at PCIe speed and leave the SMs to
    kernels running beside them)."""
    register_targets()
    if after_submit is not None:
        ids, _ = jax.lax.optimization_barrier((ids, after_submit))
    call = jax.ffi.ffi_call("ftjax_expert_fill" + _suffix(cmd_buffer),
                            (jax.ShapeDtypeStruct(gate_up_cache.shape, gate_up_cache.dtype),
                             jax.ShapeDtypeStruct(down_cache.shape, down_cache.dtype)),
                            input_output_aliases={3: 0, 4: 1})
    return call(jnp.asarray(ids, jnp.int32), jnp.asarray(slots, jnp.int32),
                jnp.asarray(n_valid, jnp.int32).reshape(()), gate_up_cache, down_cache, pool=np.uint64(pool.id),
                blocks=np.int64(_blocks(blocks)))


def expert_fill_units(ids, slots, n_valid, units, gate_up_cache, down_cache, pool, *, cmd_buffer: bool = True,
                      after_submit=None):
    """The unit split's partial fill (bf16/f32 pools): units [0, ``units``) of each of the first ``n_valid``
    entries' experts, i.e. gate rows [0, u), up rows [I, I + u) and columns [0, u) of down, into their
    slots; the rest of each slot is left untouched. ``units`` is a device scalar, a multiple of 8."""
    register_targets()
    if after_submit is not None:
        ids, _ = jax.lax.optimization_barrier((ids, after_submit))
    call = jax.ffi.ffi_call("ftjax_expert_fill_units" + _suffix(cmd_buffer),
                            (jax.ShapeDtypeStruct(gate_up_cache.shape, gate_up_cache.dtype),
                             jax.ShapeDtypeStruct(down_cache.shape, down_cache.dtype)),
                            input_output_aliases={4: 0, 5: 1})
    return call(jnp.asarray(ids, jnp.int32), jnp.asarray(slots, jnp.int32),
                jnp.asarray(n_valid, jnp.int32).reshape(()), jnp.asarray(units, jnp.int32).reshape(()),
                gate_up_cache, down_cache, pool=np.uint64(pool.id))


def expert_fill_beside(x, route_slot, route_units, ids, slots, n_valid, units, gate_up_cache, down_cache, pool, *,
                       after_submit=None, blocks: int = 0, hits: bool = False):
    """The unit split's in-step fill and the filled routes' compute in one call (``cpp/fill_beside.cu``):
    units [0, ``units``) of the first ``n_valid`` entries' experts into their slots, as `expert_fill_units`,
    then ``y [R, H]`` f32: for each route whose slot is a valid entry's, its expert's units [0, route_units[r])
    computed from that slot against x[r // k] (zeros for every other route). ``x [T, H]`` in the caches' dtype.

    The caches are written but are NOT results: the GEMV of the other routes does not wait for this call
    (under XLA's concurrent command-buffer scheduling it runs beside the transfer). The caller keeps its
    caches as they are and must compute the filled routes from ``y`` only (their slots hold the units once
    ``y`` is ready). ``blocks``: the fill's thread blocks, 0 for the default fill's grid.

    ``hits``: ``y`` also holds every other route with a valid slot (its units [0, route_units[r])), computed on
    XLA's stream while the fill runs on a side stream that the call forks and joins itself: the overlap needs no
    concurrent scheduling, and the caller computes no route of this layer on the GPU itself."""
    register_targets()
    if hits:
        _host.prepare_fill_beside()  # (at trace time: the side stream exists before any graph capture)
    if after_submit is not None:
        ids, _ = jax.lax.optimization_barrier((ids, after_submit))
    R, inter = route_slot.shape[0], down_cache.shape[-1]
    call = jax.ffi.ffi_call("ftjax_expert_fill_beside",
                            (jax.ShapeDtypeStruct((R, x.shape[1]), jnp.float32),
                             jax.ShapeDtypeStruct((R, 2 * inter), jnp.float32)))
    y, _scratch = call(x, jnp.asarray(route_slot, jnp.int32), jnp.asarray(route_units, jnp.int32),
                       jnp.asarray(ids, jnp.int32), jnp.asarray(slots, jnp.int32),
                       jnp.asarray(n_valid, jnp.int32).reshape(()), jnp.asarray(units, jnp.int32).reshape(()),
                       gate_up_cache, down_cache, pool=np.uint64(pool.id), blocks=np.int64(_blocks(blocks)),
                       hits=np.int64(bool(hits)))
    return y


def _blocks(blocks: int) -> int:
    if int(blocks) < 0:
        raise ValueError(f"blocks must be >= 0 (0: as many as fill the GPU), got {blocks}")
    return int(blocks)


def expert_fill_fork(ids, slots, n_valid, gate_up_cache, down_cache, pool, *, lane: int = 0, blocks: int = 0):
    """Experimental (bench/overlap.py's "fork"): `expert_fill` on a side stream, forked from XLA's stream
    after the work issued so far, so GPU work issued after it can run beside it. The returned caches are NOT filled
    until `join_banks` on the same ``lane``: read them only through its outputs. All lanes share one side
    stream (forked fills run in issue order); a join waits for its lane's latest fork only. Runs outside
    XLA's command buffers (the events do not survive graph capture)."""
    register_targets()
    call = jax.ffi.ffi_call("ftjax_expert_fill_fork_nocb",
                            (jax.ShapeDtypeStruct(gate_up_cache.shape, gate_up_cache.dtype),
                             jax.ShapeDtypeStruct(down_cache.shape, down_cache.dtype)),
                            input_output_aliases={3: 0, 4: 1})
    return call(jnp.asarray(ids, jnp.int32), jnp.asarray(slots, jnp.int32),
                jnp.asarray(n_valid, jnp.int32).reshape(()), gate_up_cache, down_cache,
                pool=np.uint64(pool.id), blocks=np.int64(_blocks(blocks)), lane=np.int64(lane))


def create_background(num_layers: int, max_fill: int) -> int:
    """Device state of one backend's background fills (`background_fork` / `background_wait`): a
    sequence number, one done flag per layer, a ring of list copies. Returns its id."""
    return int(_host.create_background(int(num_layers), int(max_fill)))


def destroy_background(bg: int) -> None:
    """Free a background's device state (waits until the GPU is idle: its fills may be running)."""
    _host.destroy_background(int(bg))


def live_backgrounds() -> int:
    """Backgrounds not yet destroyed."""
    return int(_host.live_backgrounds())


def background_error(bg: int) -> bool:
    """Whether a `background_wait` of this background timed out (its layer then read unfilled slots)."""
    return bool(_host.background_error(int(bg)))


def clear_background_error(bg: int) -> None:
    """Reset `background_error` (a new cache state starts with no failed wait)."""
    _host.clear_background_error(int(bg))


# Background yield modes (`set_background_yield`): the step's background fill pauses while the transfers a
# decode call waits for run: "fills" its in-step fills, "cpu" its CPU branches (submitted, not yet
# collected), "fills+cpu" both; "off" never. A pause lasts at most 200 us, 2 ms in all per fork and thread.
YIELD_MODES = {"off": 0, "fills": 1, "cpu": 2, "fills+cpu": 3}


def set_background_yield(bg: int, mode: str) -> None:
    """The yield mode of ``bg``'s fills from its next `background_fork` on (see YIELD_MODES)."""
    if mode not in YIELD_MODES:
        raise ValueError(f"background yield must be one of {sorted(YIELD_MODES)}, got {mode!r}")
    _host.set_background_yield(int(bg), YIELD_MODES[mode])


def background_yield(bg: int) -> str:
    """The yield mode of ``bg``'s next fork."""
    mask = int(_host.background_yield(int(bg)))
    return next(name for name, m in YIELD_MODES.items() if m == mask)


def transfer_words() -> tuple[int, int]:
    """(thread blocks of in-step fills running, CPU branches in flight): the counters the background yields
    to, read synchronously (tests; both are 0 when the GPU is idle)."""
    return int(_host.transfer_word(0)), int(_host.transfer_word(1))


def add_transfer_word(word: int, delta: int) -> None:
    """Tests: hold (+1) or release (-1) a transfer word by hand (0: in-step fills, 1: CPU branches)."""
    _host.add_transfer_word(int(word), int(delta))


def background_wait(gate_up_cache, down_cache, bg: int, layer: int, *, timeout_ms: int = 10_000):
    """XLA's stream waits (a one-thread kernel, inside command buffers) until the fills of ``layer``
    in the last `background_fork` of ``bg`` have landed; returns the two caches ordered after the wait
    (in place on ``gate_up_cache``: its output is read, so XLA keeps the call). A wait longer than
    ``timeout_ms`` gives up and sets `background_error`."""
    register_targets()
    call = jax.ffi.ffi_call("ftjax_bg_wait", jax.ShapeDtypeStruct(gate_up_cache.shape, gate_up_cache.dtype),
                            input_output_aliases={0: 0})
    gate_up_cache = call(gate_up_cache, bg=np.int64(bg), layer=np.int64(layer), timeout_ms=np.int64(timeout_ms))
    return jax.lax.optimization_barrier((gate_up_cache, down_cache))


def background_fork(ids, slots, n_valid, gate_up_cache, down_cache, pool, bg: int, *, units_from=None,
                    blocks: int = 16):
    """Start every layer's background fills of a step on the side stream: ``ids``/``slots [L, F]``, the
    first ``n_valid[l]`` entries of row l valid (device data). ``units_from [L]`` (default 0): a layer
    with u > 0 copies only units [u, I) of its experts (a unit-split call filled [0, u); bf16/f32 pools).
    Outside command buffers (one call per step). The returned caches are filled only once
    `background_wait` has passed for the layer."""
    register_targets()
    n_valid = jnp.asarray(n_valid, jnp.int32)
    units_from = jnp.zeros_like(n_valid) if units_from is None else jnp.asarray(units_from, jnp.int32)
    call = jax.ffi.ffi_call("ftjax_bg_fork_nocb",
                            (jax.ShapeDtypeStruct(gate_up_cache.shape, gate_up_cache.dtype),
                             jax.ShapeDtypeStruct(down_cache.shape, down_cache.dtype)),
                            input_output_aliases={4: 0, 5: 1})
    return call(jnp.asarray(ids, jnp.int32), jnp.asarray(slots, jnp.int32), n_valid, units_from,
                gate_up_cache, down_cache, pool=np.uint64(pool.id), bg=np.int64(bg),
                blocks=np.int64(_blocks(blocks)))


def sync_fills() -> None:
    """The host waits until every fill on the side stream so far (`expert_fill_fork`, `background_fork`)
    has landed."""
    _host.sync_side_stream()


def join_banks(gate_up_cache, down_cache, *, lane: int = 0):
    """XLA's stream waits for every fill forked on ``lane`` so far; returns the two caches, ordered after
    the wait (readers must use these). The wait is an in-place custom call on ``gate_up_cache``: a
    custom call whose output nothing reads is removed by XLA (a join on a separate token was: session 9,
    H200), and the caches must not be copied between a fork and its join (a copy made while the fill
    writes would hold stale rows: tests check the compiled decode step has no bank copies)."""
    register_targets()
    call = jax.ffi.ffi_call("ftjax_stream_join_nocb", jax.ShapeDtypeStruct(gate_up_cache.shape, gate_up_cache.dtype),
                            input_output_aliases={0: 0})
    gate_up_cache = call(gate_up_cache, lane=np.int64(lane))
    return jax.lax.optimization_barrier((gate_up_cache, down_cache))


def cpu_experts_submit(x, token_idx, expert_ids, weights, n_valid, channel: int, *, unit_start=None,
                       cmd_buffer: bool = True, fused: bool = True):
    """``fused``: one kernel stages x and the valid tasks into the mapped staging and publishes
    (calls up to 128 KiB of x; larger ones take the memcpy path); False: memcpy nodes and a 1-thread
    kernel (slower on the H200: bench/RESULTS.md). ``unit_start`` (per task, default 0): the task
    computes only its expert's intermediate units [u, I) (``ExpertCall.unit_start``)."""
    register_targets()
    token_idx = jnp.asarray(token_idx, jnp.int32)
    units = jnp.zeros_like(token_idx) if unit_start is None else jnp.asarray(unit_start, jnp.int32)
    call = jax.ffi.ffi_call("ftjax_cpu_experts_submit" + _suffix(cmd_buffer),
                            jax.ShapeDtypeStruct((1,), jnp.int32))
    return call(x, token_idx, jnp.asarray(expert_ids, jnp.int32), jnp.asarray(weights, jnp.float32), units,
                jnp.asarray(n_valid, jnp.int32).reshape(()), channel=np.int64(channel), fused=np.int64(bool(fused)))


def cpu_experts_collect(token, n_tokens: int, hidden: int, channel: int, *, after=None, timeout_ms: int = 10_000,
                        cmd_buffer: bool = True, fused: bool = True):
    """``fused``: one kernel waits and copies y back (y up to 128 KiB)."""
    register_targets()
    if after is not None:  # schedule the wait behind the GPU work that overlaps the CPU branch
        token, after = jax.lax.optimization_barrier((token, after))
    call = jax.ffi.ffi_call("ftjax_cpu_experts_collect" + _suffix(cmd_buffer),
                            (jax.ShapeDtypeStruct((n_tokens, hidden), jnp.float32),
                             jax.ShapeDtypeStruct((), jnp.int32)))
    y, status = call(token, channel=np.int64(channel), timeout_ms=np.int64(timeout_ms), fused=np.int64(bool(fused)))
    return (y, status) if after is None else (y, status, after)


def cpu_experts_publish(x, expert_ids, gate_weights, token_valid, fill_fraction, slot_of, recency, last_use, step,
                        channel: int, statics: dict):
    """The host plan's request of a decode layer call (``cpp/host_plan.h``), placed before the call's plan:
    stages x, the router's ids [T, k] and gate weights, the token mask and, per route, what the plan reads of
    the cache state; the coordinator then plans the CPU branch's tasks itself and runs them at once.
    ``statics``: the plan's static parameters (``plan_fused.plan_statics``), the same as the plan call's.
    Returns ``(token, slot_of, recency, last_use, step)``: the state arrays pass through unchanged (aliased),
    so that the plan, which updates them in place, is ordered after this call. Collect with
    `cpu_experts_collect_checked`."""
    register_targets()
    state = [jnp.asarray(a, jnp.int32) for a in (slot_of, recency, last_use, step)]
    call = jax.ffi.ffi_call("ftjax_cpu_experts_publish",
                            [jax.ShapeDtypeStruct((1,), jnp.int32)] + [jax.ShapeDtypeStruct(a.shape, a.dtype)
                                                                       for a in state],
                            input_output_aliases={5 + i: 1 + i for i in range(4)})
    return tuple(call(x, jnp.asarray(expert_ids, jnp.int32), jnp.asarray(gate_weights, jnp.float32),
                      jnp.asarray(token_valid, jnp.int32), jnp.asarray(fill_fraction, jnp.float32).reshape(()),
                      *state, channel=np.int64(channel), **statics))


def cpu_experts_collect_checked(token, n_cpu_routes, tasks, cpu_units, n_tokens: int, hidden: int, channel: int, *,
                                after=None, timeout_ms: int = 10_000):
    """The collect of a `cpu_experts_publish` call: waits for the CPU branch (with the watchdog), checks the host
    plan's task count and checksum against the device plan's (``n_cpu_routes``, ``tasks`` = the plan's
    (task_token, task_flat, task_weight) and its ``cpu_units``), and returns ``(y [T, H] f32, status)`` like
    `cpu_experts_collect` (status 3: the two plans differ; y is NaN then)."""
    register_targets()
    if after is not None:
        token, after = jax.lax.optimization_barrier((token, after))
    call = jax.ffi.ffi_call("ftjax_cpu_experts_collect_checked",
                            (jax.ShapeDtypeStruct((n_tokens, hidden), jnp.float32),
                             jax.ShapeDtypeStruct((), jnp.int32)))
    task_token, task_flat, task_weight = tasks
    y, status = call(token, jnp.asarray(n_cpu_routes, jnp.int32).reshape(()), jnp.asarray(task_token, jnp.int32),
                     jnp.asarray(task_flat, jnp.int32), jnp.asarray(task_weight, jnp.float32),
                     jnp.asarray(cpu_units, jnp.int32), channel=np.int64(channel), timeout_ms=np.int64(timeout_ms))
    return (y, status) if after is None else (y, status, after)


def fill_gbps(pool, n_rows: int, reps: int = 20, seed: int = 0, blocks: int = 0) -> float:
    """The fill kernel alone (outside XLA, on a stream of its own) on ``n_rows`` scattered ids: bytes
    moved per second. ``blocks``: as `expert_fill`."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(pool.n_experts, n_rows, replace=False).astype(np.int32)
    slots = np.arange(n_rows, dtype=np.int32)
    sec = _host.fill_seconds(pool.id, ids, slots, n_rows, reps, _blocks(blocks))
    return n_rows * reps * (pool.expert_bytes("gate_up") + pool.expert_bytes("down")) / sec / 1e9


def memcpy_h2d_gbps(nbytes: int, reps: int = 20) -> float:
    return nbytes * reps / _host.memcpy_h2d_seconds(int(nbytes), reps) / 1e9


def calibrate_fill(pool, shape, fmt: str, seconds_concurrent: float = 2.0) -> dict:
    """B_P alone, the pinned-memcpy ceiling, and B_P / B_H while both run (pool pinned)."""
    from ftjax.host import measure

    rows = min(64, pool.n_experts)
    b_p = fill_gbps(pool, rows)
    ceiling = memcpy_h2d_gbps(256 << 20)
    fills: list[float] = []
    stop = threading.Event()

    def fill_loop():
        while not stop.is_set():
            fills.append(fill_gbps(pool, rows, reps=5))

    th = threading.Thread(target=fill_loop)
    th.start()
    t0 = time.perf_counter()
    cpu = []
    while time.perf_counter() - t0 < seconds_concurrent:
        cpu.append(measure.cpu_kernel_gbps(pool, shape, tokens=1, calls=10)["gbps"])
    stop.set()
    th.join()
    return {"b_pcie_gbps": b_p, "memcpy_h2d_gbps": ceiling, "fill_rows": rows,
            "concurrent": {"b_host_gbps": float(np.median(cpu)), "b_pcie_gbps": float(np.median(fills))}}
