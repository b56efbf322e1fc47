"""Offloaded MoE decode benchmark: every policy, against the roofline measured in the same run.

Synthetic Qwen3.6-35B-A3B-shaped bf16 model (40 layers, 256 experts, top-8, hidden 2048, expert 512,
shared expert 512; random weights, vocabulary 151,669 = the Qwen3 tokenizer's), expert pool generated
in host memory (60 GiB), expert cache at 37% and 11% of the pool, batch 1 and 4. Routing:

- ``trace``: the calibrated synthetic trace (``ftjax.experts.traces``; LRU misses ~16% at 37%,
  ~39% at 11%), replayed through the real decode step (``ReplayRouting``);
- ``text``: the model's own router on real text through the Qwen3 tokenizer (teacher-forced decode).

Per (routing, batch, cache size): tok/s of every policy, miss rate, mean fills and CPU experts per
layer, B_P/B_H in use, and the roofline ``B / (T_gpu + miss_bytes / B_DRAM)``: T_gpu = the faster of two
measured steps with every routed expert resident, the resident engine's backend (``ResidentExperts`` on the
same banks: no cache maps, no plan) and the offload path's ``resident`` policy (since session 22: on one host the
engine's step ran 4.61 ms against the offload path's 4.38 and loosened the roofline; sessions 7-21 took the
engine's alone, before session 7 the offload path's alone), B_DRAM = the all-thread host read bandwidth measured
in this run (every logical CPU; 64-byte loads where the CPU has AVX-512: before session 33 the kernels' threads and
32-byte loads, 10-25% lower on the H200 host), since session 36 the highest of three reads, at the start and right
before and after lru-split's timed run (the host's rate drifts by up to ~18% over minutes); plus the q* rule
against the best fixed fill fraction of a sweep.
Random weights: the routing is synthetic or organic but the text generated is meaningless.

GPU machine only (CUDA FFI fill + CPU-branch handshake). Writes bench/out/decode.json.
    python bench/decode.py                      # everything (long: one compile per configuration)
    python bench/decode.py --routing trace --batches 1 --fractions 0.37
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

# The resident runs (the roofline's T_gpu) hold the whole 60 GiB pool on the GPU: JAX's default allocator share
# (75%) is too small on an 80 GB H100, 96% fits it (session 42: T_gpu measured there). Before jax starts.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.96")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ftjax  # noqa: E402
from ftjax.config import parse_hf_config
from ftjax.experts import bandwidth as bw
from ftjax.experts.cache import STAT_KEYS
from ftjax.experts.decode import OffloadExperts
from ftjax.experts.offload_defaults import BACKGROUND_YIELD_MODES
from ftjax.experts.resident import ResidentExperts
from ftjax.experts.traces import ReplayRouting, synthetic_trace
from ftjax.host import (GPU_SPIN_US, calibrate, configure_workers, expert_call_time_totals, gpu_workers, measure,
                        tune_workers_for_gpu, worker_info)
from ftjax.models import get_family, make_step_fns
from ftjax.models.params import param_shapes, unflatten

import layer_stamps  # bench/ sibling
import thread_cpu  # bench/ sibling
from decode_args import SWEEP, TOKENIZER, parser as make_parser  # bench/ sibling
from decode_rounds import (CALL_TIMES, ROUNDS, check_round_robins_fit, fill_beside_variants, interleaved,  # bench/ sibling
                           knob_settings, round_robin, round_robin_backends)

QWEN36 = {
    "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 151669, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "linear_conv_kernel_dim": 4,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "max_position_embeddings": 4096,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
}


def make_params(cfg, seed=0):
    key = jax.random.PRNGKey(seed)
    flat = {}
    for i, (name, shape) in enumerate(sorted(param_shapes(cfg).items())):
        flat[name] = (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
    return unflatten(flat)


def text_tokens(n: int, batch: int, tokenizer_dir=TOKENIZER) -> np.ndarray:
    from ftjax.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dir)
    text = (Path(__file__).resolve().parents[1] / "ftjax" / "data" / "corpus.txt").read_text()
    ids = np.asarray(tok.encode(text), np.int32)
    need = n * batch
    ids = np.resize(ids, max(need, len(ids)))
    return np.stack([ids[b * n:(b + 1) * n] for b in range(batch)], axis=1)  # [n, B]


class Run:
    """One backend at one batch size: a decode step function and its states."""

    def __init__(self, cfg, params, pool, policy, slots, batch, routing, trace, max_len, fill_fraction, tokens=None,
                 fused_handshake=True, stable_io=True, plan=None, resident_banks=None):
        L, E = cfg.num_layers, cfg.num_experts
        self.cfg, self.params, self.batch, self.routing = cfg, params, batch, routing
        if resident_banks is not None:  # the resident engine's backend: banks indexed by flat id, no maps, no plan
            self.backend, inner = ResidentExperts(E), dict(resident_banks)
        else:
            self.backend = OffloadExperts(pool, L, E, slots, policy, platform="cuda", max_tokens=max(batch, 16),
                                          fused_handshake=fused_handshake, **(plan or {}))
            inner = self.backend.init_state(fill_fraction=fill_fraction)
        if routing == "trace":
            wrapped = ReplayRouting(self.backend)
            self.expert_state = wrapped.init_trace_state(inner, trace)  # on the device, stepped there
        else:
            wrapped, self.expert_state = self.backend, inner
        _, self.decode = make_step_fns(cfg, wrapped, batch, 1, max_len, stable_io=stable_io)
        self.state = get_family(cfg).init_state(cfg, batch, max_len, jnp.bfloat16)
        self.tokens = tokens if routing == "text" else np.zeros((max_len, batch), np.int32)
        self.i = 0
        self.dispatch_s = 0.0  # host time inside the decode call (enqueue; a host-bound step shows here)
        self.host_calls = collections.deque(maxlen=4096)  # (start, end) ns of the last decode calls
        self.hook = None  # called after every step (the online split refinement)
        self.sync = False  # wait for each step's logits before dispatching the next (--sync)
        self.fixed_inputs, self._fixed = False, None  # --fixed-inputs
        self.warm_steps = 0  # steps run before timing (cache fill + warm-up), over every timed() call
        self.fill_cap_steps = fill_steps(slots, L)

    @property
    def cache(self):
        return self.expert_state["inner"] if self.routing == "trace" else self.expert_state

    def set_fraction(self, f: float):
        c = dict(self.cache, fill_fraction=jnp.asarray(f, jnp.float32))
        self.expert_state = dict(self.expert_state, inner=c) if self.routing == "trace" else c

    def step(self):
        if self.fixed_inputs and self.routing == "trace":  # the same device buffers every step (tokens are 0)
            if self._fixed is None:
                self._fixed = (jnp.zeros((self.batch, 1), jnp.int32), jnp.ones((self.batch,), jnp.int32))
            tok, n_new = self._fixed
        else:
            tok = jnp.asarray(self.tokens[self.i % len(self.tokens)][:, None])
            n_new = jnp.ones((self.batch,), jnp.int32)
        t0 = time.monotonic_ns()  # (the coordinator's clock: bench/layer_stamps.py aligns the two)
        logits, self.state, self.expert_state = self.decode(self.params, self.expert_state, self.state, tok, n_new)
        t1 = time.monotonic_ns()
        self.dispatch_s += (t1 - t0) / 1e9
        self.host_calls.append((t0, t1))
        if self.sync:  # as a serving loop that samples each token before the next step
            logits.block_until_ready()
        self.i += 1
        if self.hook is not None:
            self.hook()

    def hlo_ops(self) -> dict:
        """Top-level ops of the compiled decode step (``trace_summary.hlo_entry_ops``)."""
        from trace_summary import hlo_entry_ops

        tok = jnp.zeros((self.batch, 1), jnp.int32)
        lowered = self.decode.lower(self.params, self.expert_state, self.state, tok, jnp.ones((self.batch,), jnp.int32))
        return dict(hlo_entry_ops(lowered.compile().as_text()))

    @property
    def policy(self) -> str:
        return self.backend.policy.name if isinstance(self.backend, OffloadExperts) else "resident (engine)"

    def free_slots(self) -> int:
        return int((np.asarray(self.cache["owner_of"]) < 0).sum()) if "owner_of" in self.cache else 0

    def fill_cache(self, cap: int, every: int = 8) -> int:
        """Steps until the cache has no free slot (at most ``cap``): timing a cache that is still filling
        measures a cold start (session 7: 24 warm-up steps left 37% at b1 with 26% misses against ~15% warm).
        The static policy's hot set is loaded after the warm-up; the others fill on misses."""
        n = 0
        if self.policy == "static":
            return n
        while n < cap and self.free_slots() > 0:
            for _ in range(min(every, cap - n)):
                self.step()
            n += min(every, cap - n)
        return n

    def stats(self):
        if "stats" not in self.cache:  # the resident engine keeps no cache statistics: every route is a hit
            return {k: np.zeros(1, np.int64) for k in STAT_KEYS}
        return {k: np.asarray(v).astype(np.int64) for k, v in self.cache["stats"].items() if k != "hist"}

    def timed(self, warmup: int, steps: int, online: bw.Bandwidth | None = None) -> dict:
        """tok/s and cache figures of ``steps`` steps after ``warmup``; ``online``: refine the fill
        fraction every step from measured step times, as the engine does (``SplitController``)."""
        if online is not None:
            from ftjax.experts.stats import ExpertStats

            ctl, reader = bw.SplitController(bw.OnlineSplitTuner(online)), ExpertStats()
            self.set_fraction(ctl.fraction)

            def refine():
                reader.after_step(self.cache)
                f = ctl.after_decode(*reader.misses())
                if f is not None:
                    self.set_fraction(f)

            self.hook = refine
            try:
                out = self.timed(warmup, steps)
            finally:
                self.hook = None
            return dict(out, fill_fraction=ctl.bandwidth.fill_fraction, online_updates=ctl.updates,
                        online_moves=ctl.tuner.moves)
        warm = self.fill_cache(cap=self.fill_cap_steps)
        for _ in range(warmup):
            self.step()
        self.warm_steps += warm + warmup
        if self.policy == "static":
            self.expert_state = _freeze(self)  # hot set from the warm-up histogram (the "prefill")
            self.step()
        jax.block_until_ready(self.expert_state)
        s0 = self.stats()
        served = getattr(self.backend, "cpu_served", lambda: (0, 0.0))  # the resident engine has no CPU branch
        j0, c0 = served()
        p0 = expert_call_time_totals()  # the CPU expert calls' bytes and times (only this run's calls run)
        th0 = thread_cpu.snapshot()
        t0, d0 = time.perf_counter(), self.dispatch_s
        for _ in range(steps):
            self.step()
        jax.block_until_ready(self.expert_state)
        dt = time.perf_counter() - t0
        threads = thread_cpu.cpu_by_group(th0, thread_cpu.snapshot())
        j1, c1 = served()
        p1 = expert_call_time_totals()
        b0, b1 = p0["weight_bytes"], p1["weight_bytes"]
        s1 = self.stats()
        d = {k: int((s1[k] - s0[k]).sum()) for k in s0}
        L = self.cfg.num_layers
        return {"tok_s": self.batch * steps / dt, "step_ms": dt / steps * 1e3, "warm_steps": self.warm_steps,
                "dispatch_ms": (self.dispatch_s - d0) / steps * 1e3,
                "miss_rate": d["misses"] / max(1, d["hits"] + d["misses"]),
                "misses_per_step": d["misses"] / steps, "fills_per_layer": d["fills"] / steps / L,
                "cpu_per_layer": d["cpu_experts"] / steps / L, "deferred_per_layer": d["deferred"] / steps / L,
                "cpu_jobs_per_step": (j1 - j0) / steps, "cpu_serve_ms": (c1 - c0) / steps * 1e3,
                "cpu_us_per_job": (c1 - c0) / max(1, j1 - j0) * 1e6,
                "cpu_mb_per_job": (b1 - b0) / max(1, j1 - j0) / 1e6,
                "cpu_gbps": (b1 - b0) / (c1 - c0) / 1e9 if c1 > c0 else 0.0,
                "busy_cpus": sum(g["ms"] for g in threads.values()) / 1e3 / dt,
                "thread_ms_per_step": {k: dict(g, ms=g["ms"] / steps) for k, g in threads.items()},
                **{f"call_{k}": (p1[k] - p0[k]) / max(1, p1["calls"] - p0["calls"]) for k in CALL_TIMES}}


def fill_steps(slots: int, num_layers: int) -> int:
    """Upper bound on the steps that fill an empty cache: every policy that fills does at least one fill per
    layer per step while the layer misses (the plan's ``n_fill >= 1`` when ``m > 0``), plus slack."""
    return -(-5 * slots // (4 * num_layers)) + 16 if slots else 0


def profile(run, root: str | None, name: str, steps: int = 3) -> None:
    """A profiler trace (perfetto JSON) of a few more steps of ``run``, when ``--profile`` is given."""
    if not root:
        return
    run.step()
    jax.block_until_ready(run.expert_state)
    with jax.profiler.trace(str(Path(root) / name), create_perfetto_trace=True):
        for _ in range(steps):
            run.step()
        jax.block_until_ready(run.expert_state)


def _freeze(run):
    if run.routing == "trace":
        return dict(run.expert_state, inner=run.backend.freeze_hot_set(run.expert_state["inner"]))
    return run.backend.freeze_hot_set(run.expert_state)


def main(argv=None) -> int:
    ap = make_parser(__doc__.splitlines()[0], Path(__file__).parent / "out" / "decode.json")
    args = ap.parse_args(argv)
    knobs = knob_settings(args.knob_variants)  # a bad spec fails here, before any work
    if jax.default_backend() != "gpu":
        print("bench/decode.py needs a CUDA GPU (the FFI fill and CPU-branch handshake)", file=sys.stderr)
        return 2

    hf = dict(QWEN36, num_hidden_layers=args.layers, layer_types=QWEN36["layer_types"][:args.layers])
    cfg = parse_hf_config(hf)
    L, E = cfg.num_layers, cfg.num_experts
    shape = measure.ExpertShape(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok)
    pool_bytes = L * E * shape.expert_bytes("bf16")
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0)
    if not args.no_resident and limit and limit < 1.05 * pool_bytes:
        print(f"the resident runs (the roofline's T_gpu) hold the whole {pool_bytes / 2**30:.1f} GiB pool on the "
              f"GPU, whose allocator has {limit / 2**30:.1f} GiB: pass --no-resident (the policies' rows, no "
              "roofline) or run on a larger GPU (the H200)", file=sys.stderr)
        return 2
    params = make_params(cfg)  # (on the GPU: the room left for the round robins' caches, checked before any timing)
    check_round_robins_fit(round_robin_backends(args), int(max(args.fractions) * L * E) * shape.expert_bytes("bf16"),
                           jax.devices()[0])
    t0 = time.perf_counter()
    pool = measure.make_pool(shape, "bf16", pool_bytes, down_layout=args.down_layout)
    assert pool.n_experts == L * E
    pool.pin()
    backing, thp = pool.page_backing(), measure.thp_setting()
    print(f"pool {pool.total_bytes / 2**30:.1f} GiB (down layout {pool.down_layout}) generated and pinned in {time.perf_counter() - t0:.0f}s; "
          f"on huge pages {backing['huge'] / max(backing['resident'], 1):.0%} (transparent_hugepage: {thp})",
          flush=True)
    # every logical CPU of the host (until session 33 the kernels' 15 threads: 3-16% below the 16-thread read)
    dram_threads = measure.host_threads()
    dram_buf = measure.stream_buffer(4 << 30)  # kept: B_DRAM is read again around each row's lru-split run
    b_dram = measure.read_gbps(dram_buf, threads=dram_threads)
    prof = calibrate.load_profile()
    if prof is None:
        print("no calibration profile: measuring B_P/B_H now (ftjax calibrate)", flush=True)
        prof = calibrate.calibrate(window_gib=2.0)
    band = bw.from_profile(prof)
    expert_bytes = shape.expert_bytes("bf16")
    # Every step of the longest run (lru-split: timing, online row, worker variants, sweep, profile) must fit the
    # KV length: past it, text routing would come from an overflowing context.
    max_len = (args.warmup + args.steps + 8 + max(fill_steps(int(f * L * E), L) for f in args.fractions)
               + ((len(args.worker_variants) + 1) * ROUNDS * (2 + max(1, args.steps // ROUNDS))
                  if args.worker_variants else 0)
               + ((len(args.knob_variants) + 1) * ROUNDS * (2 + max(1, args.steps // ROUNDS))
                  if args.knob_variants else 0)
               + (0 if args.no_online else args.online_warmup + args.steps)
               + (0 if args.no_sweep else len(SWEEP) * (8 + args.steps)) + (4 if args.profile else 0)
               + (len(BACKGROUND_YIELD_MODES) * (ROUNDS * (2 + max(1, args.steps // ROUNDS)) + (4 if args.profile else 0))
                  if args.yield_ablation else 0)
               + (1 if args.granule_ablation or args.host_plan_ablation or args.plan_publish_ablation
                  or args.fill_beside_ablation else 0))  # fresh runs: warm-up, 1 step,
    # the rounds (each on its own copy of the trace)
    plan_kw = dict(plan_impl=args.plan_impl, victims_by=args.victims_by)
    split_kw = {} if args.fill_beside is None else dict(fill_beside=True, fill_beside_blocks=args.fill_beside,
                                                        fill_beside_gemv=args.fill_beside_gemv)
    results = {"sync": args.sync, "stable_io": args.stable_io, **plan_kw,
               "xla_update_mode": ftjax.XLA_UPDATE_MODE, "xla_cb_scheduling": ftjax.XLA_CB_SCHEDULING,
               "fill_beside": args.fill_beside, "fill_beside_gemv": args.fill_beside_gemv,
               "b_dram_gbps": b_dram, "b_dram_threads": dram_threads, "bandwidth": band.to_dict(),
               "expert_bytes": expert_bytes, "pool_backing": backing, "transparent_hugepage": thp, "rows": []}
    print(f"B_DRAM {b_dram:.1f} GB/s ({dram_threads} threads) | in use: B_P {band.b_pcie_gbps:.1f} GB/s, "
          f"B_H {band.b_host_gbps:.1f} GB/s ({'concurrent' if band.concurrent else 'standalone'}, {band.source}), "
          f"q* fraction {band.fill_fraction:.3f}")

    tune_workers_for_gpu()  # what every CUDA lru-split backend below does first: print the pool they run with
    print(f"CPU worker pool: {worker_info()}")
    print(f"XLA command-buffer update mode: {ftjax.XLA_UPDATE_MODE or 'XLA default'}, scheduling "
          f"{ftjax.XLA_CB_SCHEDULING or 'XLA default (LHS)'} (ftjax.xla_flags); lru-split fill "
          f"{'beside the GEMV, %d blocks' % args.fill_beside if args.fill_beside is not None else 'before the GEMV'}"
          f"{' (the hits in the same call)' if args.fill_beside_gemv else ''}; "
          f"stable step buffers: {'yes' if args.stable_io else 'no (--no-stable-io)'}; plan impl {args.plan_impl}, "
          f"victims by {args.victims_by or 'the backend default (default_victims_by)'}")
    print("steps: " + ("each waits for the previous step's logits (--sync)" if args.sync else
                       "dispatched back to back (the host runs ahead of the GPU)"))
    for routing in args.routing:
        for B in args.batches:
            trace = synthetic_trace(max_len, L, E, cfg.num_experts_per_tok, batch=B, seed=B) if routing == "trace" else None
            tokens = text_tokens(max_len, B, args.tokenizer) if routing == "text" else None
            if args.no_resident:  # (a GPU that cannot hold the whole pool: no T_gpu, no roofline)
                t_gpu = t_offload_resident = None
            else:
                res = Run(cfg, params, pool, "resident", L * E, B, routing, trace, max_len, band.fill_fraction, tokens,
                          fused_handshake=args.fused_handshake, stable_io=args.stable_io, plan=plan_kw)
                res.sync, res.fixed_inputs = args.sync, args.fixed_inputs
                t_offload_resident = res.timed(args.warmup // 4, args.steps)
                progress(f"{routing} b{B} resident (offload path: plan, no misses)", t_offload_resident)
                if args.hlo_stats:
                    print(f"resident: compiled decode step, top-level ops {res.hlo_ops()}", flush=True)
                profile(res, args.profile, f"{routing}-b{B}-resident")
                banks = {b: res.cache[b] for b in ("gate_up", "down")}  # slot s holds flat id s (preloaded in order)
                del res
                eng = Run(cfg, params, pool, "resident", L * E, B, routing, trace, max_len, band.fill_fraction, tokens,
                          stable_io=args.stable_io, resident_banks=banks)
                eng.sync, eng.fixed_inputs = args.sync, args.fixed_inputs
                t_gpu = eng.timed(args.warmup // 4, args.steps)  # the roofline's T_gpu: the resident engine's step
                progress(f"{routing} b{B} resident (engine: ResidentExperts)", t_gpu)
                profile(eng, args.profile, f"{routing}-b{B}-resident-engine")
                del eng, banks
            for frac in args.fractions:
                S = int(frac * L * E)
                rows = {}
                dram_around = []  # B_DRAM read right before and after lru-split's timed run

                def backends_round_robin(configs: dict, what):
                    # other executables: fresh backends, each on its own copy of the trace from its
                    # start, warmed and then timed round robin (every one sees the same stretches)
                    runs = {}
                    for name, kw in configs.items():
                        runs[name] = Run(cfg, params, pool, "lru-split", S, B, routing, trace, max_len,
                                         band.fill_fraction, tokens, fused_handshake=args.fused_handshake,
                                         stable_io=args.stable_io,
                                         plan=dict(plan_kw, defer_fills=args.defer == "on", **dict(split_kw, **kw)))
                        runs[name].sync, runs[name].fixed_inputs = args.sync, args.fixed_inputs
                        runs[name].timed(args.warmup, 1)
                    for name, r in round_robin({n: (rr, lambda: None) for n, rr in runs.items()}, ROUNDS,
                                               args.steps, 2).items():
                        rows[name] = dict(r, unit_granule=runs[name].backend.unit_granule,
                                          host_plan=runs[name].backend.host_plan,
                                          plan_publish=runs[name].backend.plan_publish,
                                          fill_beside=runs[name].backend.fill_beside,
                                          fill_beside_blocks=runs[name].backend.fill_beside_blocks,
                                          fill_beside_gemv=runs[name].backend.fill_beside_gemv)
                        progress(f"{routing} b{B} lru-split, {name[6:]} ({what(runs[name].backend)}) "
                                 f"{frac:.0%} ({ROUNDS} rounds)", r)
                    for name, rr in runs.items():
                        profile(rr, args.profile, f"{routing}-b{B}-{name.replace(' ', '-')}-{round(100 * frac)}")
                        rr.backend.drain()

                for pol in args.policies:
                    run = Run(cfg, params, pool, pol, 0 if pol == "cpu" else S, B, routing, trace, max_len,
                              band.fill_fraction, tokens, fused_handshake=args.fused_handshake,
                              stable_io=args.stable_io, plan=dict(plan_kw, defer_fills=args.defer == "on",
                                                                  **(split_kw if pol == "lru-split" else {})))
                    run.sync, run.fixed_inputs = args.sync, args.fixed_inputs
                    if pol == "lru-split":  # the host's read rate drifts over minutes (session 34): read
                        # it again right before and after the run that the ratio is taken of
                        dram_around.append(measure.read_gbps(dram_buf, threads=dram_threads))
                    rows[pol] = run.timed(args.warmup, args.steps)
                    if pol == "lru-split" and args.stamps:  # (before the backend runs again)
                        ph = layer_stamps.layer_phases([run.backend.channel_base + i for i in range(L)], args.steps,
                                                       host_calls=list(run.host_calls)[-args.steps:])
                        print(layer_stamps.table(ph, f"{routing} b{B} lru-split {frac:.0%}"), flush=True)
                        rows[pol]["stamps_us"] = {k: {p: [float(np.median(v)), float(np.mean(v))] for p, v in d.items()
                                                      if len(v)} for k, d in ph.items()
                                                  if k in ("with job", "without", "per step")}
                    if pol == "lru-split":
                        dram_around.append(measure.read_gbps(dram_buf, threads=dram_threads))
                    rows[pol]["victims_by"] = run.backend.victims_by
                    rows[pol]["background_fills"] = run.backend.background_fills
                    rows[pol]["unit_split"] = run.backend.unit_split
                    rows[pol]["unit_granule"] = run.backend.unit_granule
                    rows[pol]["background_yield"] = run.backend.background_yield
                    rows[pol]["host_plan"] = run.backend.host_plan
                    rows[pol]["plan_publish"] = run.backend.plan_publish
                    progress(f"{routing} b{B} {pol}{' (units: the default)' if run.backend.unit_split else ''} "
                             f"{frac:.0%}", rows[pol])
                    if args.hlo_stats:
                        rows[pol]["hlo_ops"] = run.hlo_ops()
                        print(f"{pol}: compiled decode step, top-level ops {rows[pol]['hlo_ops']}", flush=True)
                    profile(run, args.profile, f"{routing}-b{B}-{pol}-{round(100 * frac)}")
                    if pol == "lru-split":
                        if not args.no_online:  # a long warm-up: a move takes two windows of 16 steps
                            rows["split online"] = run.timed(args.online_warmup, args.steps, online=band)
                        if args.worker_variants:  # same executable, other worker pools, round robin
                            n_default = gpu_workers(worker_info()["physical_cores"])  # tune_workers_for_gpu's
                            pools = {"split workers default": lambda: configure_workers(n_workers=n_default,
                                                                                       spin_us=GPU_SPIN_US)}
                            for variant in args.worker_variants:
                                n, spin = (int(v) for v in variant.split(":"))
                                pools[f"split w{n}s{spin}"] = (lambda n=n, spin=spin:
                                                               configure_workers(n_workers=n, spin_us=spin))
                            for name, r in interleaved(run, pools, ROUNDS, args.steps, 2).items():
                                rows[name] = r
                                progress(f"{routing} b{B} lru-split, {name[6:]} {frac:.0%} ({ROUNDS} rounds)", r)
                            pools["split workers default"]()
                        if args.knob_variants:  # same executable, other kernel knobs, round robin
                            for name, r in interleaved(run, knobs, ROUNDS, args.steps, 2).items():
                                rows[name] = r
                                progress(f"{routing} b{B} lru-split, {name[6:]} {frac:.0%} ({ROUNDS} rounds)", r)
                            knobs["split knobs default"]()
                        if args.yield_ablation and run.backend.background_fills:
                            default_yield = run.backend.background_yield
                            # same executable (the fork reads the mode), round robin: every mode sees the
                            # same stretch of the trace (its miss rate drifts along the run)
                            modes = {f"split yield {m}": (lambda m=m: run.backend.set_background_yield(m))
                                     for m in BACKGROUND_YIELD_MODES}
                            for name, r in interleaved(run, modes, ROUNDS, args.steps, 2).items():
                                rows[name] = r
                                progress(f"{routing} b{B} lru-split, background {name[6:]} {frac:.0%} "
                                         f"({ROUNDS} rounds)", r)
                            for m in BACKGROUND_YIELD_MODES if args.profile else ():
                                run.backend.set_background_yield(m)
                                profile(run, args.profile, f"{routing}-b{B}-yield-{m.replace('+', '-')}-"
                                        f"{round(100 * frac)}")
                            run.backend.set_background_yield(default_yield)
                        if args.granule_ablation and run.backend.unit_split:
                            backends_round_robin({"split granule default": {},
                                                  **{f"split granule {g}": {"unit_granule": g}
                                                     for g in args.granule_ablation}},
                                                 lambda b: f"units {b.unit_granule}")
                    if pol == "lru-split" and not args.no_sweep:
                        sweep = {}
                        for f in SWEEP:
                            run.set_fraction(f)
                            sweep[f] = run.timed(8, args.steps)["tok_s"]
                        rows[pol]["sweep"] = sweep
                    run.backend.drain()  # its background fills write banks about to be freed
                    del run
                    if pol != "lru-split":
                        continue
                    if args.host_plan_ablation:  # the CPU branch planned on the host (cpp/host_plan.h) or not
                        backends_round_robin({"split host plan off": {"host_plan": False},
                                              "split host plan on": {"host_plan": True}},
                                             lambda b: f"host plan {'on' if b.host_plan else 'off'}")
                    if args.plan_publish_ablation:  # the CPU branch submitted by the plan kernel or after it
                        backends_round_robin({"split submit kernel": {"plan_publish": False},
                                              "split plan publish": {"plan_publish": True}},
                                             lambda b: f"plan publish {'on' if b.plan_publish else 'off'}")

                    if args.fill_beside_ablation:  # the in-step fill before the GEMV, or beside it
                        backends_round_robin(fill_beside_variants(args.fill_beside_ablation, args.fill_beside_gemv),
                                             lambda b: f"fill beside, {b.fill_beside_blocks} blocks"
                                             f"{', with the hits' if b.fill_beside_gemv else ''}" if b.fill_beside
                                             else "fill after the submit")

                    def variant(name, what, **plan_extra):  # lru-split again, another backend configuration
                        run = Run(cfg, params, pool, pol, S, B, routing, trace, max_len, band.fill_fraction, tokens,
                                  fused_handshake=args.fused_handshake, stable_io=args.stable_io,
                                  plan=dict(plan_kw, **plan_extra))
                        run.sync, run.fixed_inputs = args.sync, args.fixed_inputs
                        rows[name] = run.timed(args.warmup, args.steps)
                        progress(f"{routing} b{B} lru-split, {what} {frac:.0%}", rows[name])
                        profile(run, args.profile, f"{routing}-b{B}-{name.replace(' ', '-')}-{round(100 * frac)}")
                        run.backend.drain()

                    if args.defer == "both":  # the same policy with background fills
                        variant("split bg-fills", "with background fills", defer_fills=True)
                    if args.unit_split:  # background fills + the fills split by units
                        variant("split units", "fills split by units", defer_fills=True, unit_split=True)
                    if args.whole_split:  # background fills of whole experts, not split by units
                        variant("split whole", "whole experts deferred", defer_fills=True, unit_split=False)
                    if args.kernel_ablation:  # the same policy, the GPU's expert GEMV by the Pallas kernel
                        variant(f"split {args.kernel_ablation}", f"{args.kernel_ablation} kernel",
                                defer_fills=args.defer == "on", kernel=args.kernel_ablation)
                        if args.unit_split:
                            variant(f"split units {args.kernel_ablation}", f"units, {args.kernel_ablation} kernel",
                                    defer_fills=True, unit_split=True, kernel=args.kernel_ablation)
                    if args.plan_ablation:  # the same policy, the plan by another impl
                        variant(f"split plan {args.plan_ablation}", f"plan impl {args.plan_ablation}",
                                defer_fills=args.defer == "on", plan_impl=args.plan_ablation)
                miss_bytes = rows["lru-split"]["misses_per_step"] * expert_bytes if "lru-split" in rows else 0.0
                # the roofline's B_DRAM: the highest of the reads at the start and around lru-split's run (the
                # strictest ceiling of the three)
                dram_reads = [b_dram] + dram_around
                nan = float("nan")
                t_gpu = t_gpu or {"step_ms": nan, "dispatch_ms": nan, "tok_s": nan}
                t_offload_resident = t_offload_resident or {"step_ms": nan}
                t_floor = min(t_gpu["step_ms"], t_offload_resident["step_ms"])  # the stricter roofline
                roof = B / (t_floor / 1e3 + miss_bytes / (max(dram_reads) * 1e9))
                row = {"routing": routing, "batch": B, "cache_fraction": frac, "slots": S,
                       "t_gpu_ms": t_floor, "t_engine_ms": t_gpu["step_ms"], "t_gpu_host_ms": t_gpu["dispatch_ms"],
                       "t_offload_resident_ms": t_offload_resident["step_ms"],
                       "resident_tok_s": t_gpu["tok_s"], "roofline_tok_s": roof,
                       "b_dram_reads_gbps": dram_reads, "b_dram_used_gbps": max(dram_reads),
                       "policies": rows}
                results["rows"].append(row)
                print_row(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1, default=float) + "\n")
    print(f"wrote {args.out}")
    return 0


_T0 = time.perf_counter()


def progress(what: str, r: dict) -> None:
    """One line per timed run as it ends (a step cut by its time limit still shows what it measured)."""
    print(f"  [{time.perf_counter() - _T0:6.0f}s] {what}: {r['tok_s']:.1f} tok/s, step {r['step_ms']:.2f} ms, "
          f"host {r['dispatch_ms']:.2f} ms", flush=True)
    if "thread_ms_per_step" in r:  # which threads burn the host's CPUs meanwhile
        print(f"      threads: {thread_cpu.summary(r['thread_ms_per_step'], r['busy_cpus'])}", flush=True)


def print_row(row):
    print(f"\n== routing {row['routing']}, batch {row['batch']}, cache {row['cache_fraction']:.0%} "
          f"({row['slots']} slots) | T_gpu {row['t_gpu_ms']:.2f} ms (the faster of the resident engine, "
          f"{row['t_engine_ms']:.2f} ms, host {row['t_gpu_host_ms']:.2f}, and the offload path without misses, "
          f"{row['t_offload_resident_ms']:.2f} ms) | B_DRAM {row['b_dram_used_gbps']:.1f} GB/s (the highest of "
          f"{' / '.join(f'{b:.1f}' for b in row['b_dram_reads_gbps'])}: at the start, before and after lru-split) "
          f"| roofline {row['roofline_tok_s']:.1f} tok/s")
    print(f"{'policy':18} {'tok/s':>8} {'/roof':>6} {'miss%':>6} {'fills/L':>8} {'bg/L':>6} {'cpu/L':>6} "
          f"{'step ms':>8} {'cpu ms':>7} {'us/job':>7} {'MB/job':>7} {'cpu GB/s':>8} {'host ms':>8} {'warm':>5}")
    for pol, r in row["policies"].items():
        print(f"{pol:18} {r['tok_s']:8.1f} {r['tok_s'] / row['roofline_tok_s']:6.2f} {100 * r['miss_rate']:6.1f} "
              f"{r['fills_per_layer']:8.2f} {r.get('deferred_per_layer', 0.0):6.2f} {r['cpu_per_layer']:6.2f} "
              f"{r['step_ms']:8.2f} {r.get('cpu_serve_ms', 0.0):7.2f} {r.get('cpu_us_per_job', 0.0):7.1f} "
              f"{r.get('cpu_mb_per_job', 0.0):7.2f} {r.get('cpu_gbps', 0.0):8.1f} "
              f"{r['dispatch_ms']:8.2f} {r.get('warm_steps', 0):5d}")
    print("fills/L: fills per layer call, bg/L of them in the background (their experts also counted in cpu/L: "
          "computed on the CPU in that call); cpu ms: the coordinator's time per step in CPU-branch jobs (request "
          "seen -> done published, the handshake not included), us/job: per layer call with CPU work, MB/job: the "
          "expert weight bytes it read, cpu GB/s: those bytes over the jobs' time (compare B_DRAM); host ms: time "
          "inside the decode call per step (dispatch; the host runs ahead unless --sync); warm: steps before timing "
          "(until the cache had no free slot, then --warmup)")
    p = row["policies"]
    jobs = {pol: r for pol, r in p.items() if r.get("cpu_us_per_job", 0.0) > 0 and "call_total_us" in r}
    if jobs:
        print(f"{'CPU call, us/call':18} {'job':>7} {'call':>7} {'setup':>6} {'layouts':>7} {'gate/up':>7} "
              f"{'(wait)':>6} {'down':>7} {'(wait)':>6}")
        for pol, r in jobs.items():
            print(f"{pol:18} {r['cpu_us_per_job']:7.1f} {r['call_total_us']:7.1f} {r['call_setup_us']:6.1f} "
                  f"{r['call_layouts_us']:7.1f} {r['call_phase1_us']:7.1f} {r['call_phase1_wait_us']:6.1f} "
                  f"{r['call_phase2_us']:7.1f} {r['call_phase2_wait_us']:6.1f}")
        print("job: the coordinator's time per job (as us/job); call: the expert call inside it; per round its "
              "wall time and (wait) the caller's wait for the other threads after its own last item")
    if "split online" in p:
        print(f"split online: fraction {p['split online']['fill_fraction']:.3f} after "
              f"{p['split online']['online_moves']} moves ({p['split online']['online_updates']} stats readings)")
    if "lru-split" in p and "lru-fill" in p:
        print(f"lru-split / lru-fill = {p['lru-split']['tok_s'] / p['lru-fill']['tok_s']:.2f}")
    if "lru-split" in p and "split bg-fills" in p:
        print(f"background fills: split bg-fills / lru-split = {p['split bg-fills']['tok_s'] / p['lru-split']['tok_s']:.2f}")
    if "split host plan on" in p and "split host plan off" in p:
        print(f"host plan: on / off = {p['split host plan on']['tok_s'] / p['split host plan off']['tok_s']:.2f} "
              "(fresh backends, round robin)")
    for name in p:
        if name.startswith("split plan ") and "lru-split" in p:
            print(f"plan impl: lru-split / {name} = {p['lru-split']['tok_s'] / p[name]['tok_s']:.2f}")
    if "sweep" in p.get("lru-split", {}):
        best_f, best = max(p["lru-split"]["sweep"].items(), key=lambda kv: kv[1])
        print(f"q* rule {p['lru-split']['tok_s']:.1f} tok/s vs best fixed fraction {best_f} {best:.1f} tok/s "
              f"({p['lru-split']['tok_s'] / best:.2f})")


if __name__ == "__main__":
    sys.exit(main())
