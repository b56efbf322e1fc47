"""Host runtime benchmark: CPU expert kernel vs STREAM read; fill kernel vs cudaMemcpy; handshake.

    python bench/host_runtime.py [--window-gib 2] [--calls 20] [--no-gpu]

CPU: effective GB/s = unique expert weight bytes read per call / median call time, decode-shaped
calls (1 or 8 tokens x top-8 routes, and 1-token calls of 1 or 2 experts: a layer's CPU share when
most misses are filled), each token's experts drawn from a fresh window walking through a pool
larger than the caches, i.e. synthetic routing with no reuse across calls: the DRAM-bound case; the
ceiling is a STREAM-like read with the same worker threads, in the same run.
GPU (when built with CUDA and a GPU is present): the fill kernel on scattered ids vs pinned
cudaMemcpy H2D; the CPU branch per layer inside one jitted step (empty task list: skipped on the
GPU; one tiny task: the round trip), with and without the command-buffer trait and fused kernels.
Prints a table; writes bench/out/host_runtime.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftjax import _host  # noqa: E402
from ftjax.host import kernel_knobs, knob_variants, measure, set_kernel_knobs  # noqa: E402

def _k(row: dict) -> str:  # routes per token; 's': every token on the same experts, 't': routed by the trace
    return f"{row['top_k']}{ {'shared': 's', 'trace': 't'}.get(row.get('routing'), '')}"


SHAPES = {"qwen3.6 (H2048 I512)": measure.ExpertShape(2048, 512), "large (H4096 I2048)": measure.ExpertShape(4096, 2048)}


def cpu_part(window_gib: float, calls: int, tiers: list[str], prefetch: list[int],
             formats: tuple[str, ...] = ("bf16", "int4"), short_rows: list[int] | None = None,
             variants: dict[str, dict] | None = None, shared_tokens: tuple[int, ...] = (),
             trace_tokens: tuple[int, ...] = ()) -> list[dict]:
    """`variants`: {name: whole kernel_knobs dict} to time each case under, their calls round robin (default: the
    knobs as they are); prefetch / short_rows override theirs. `shared_tokens`: also calls of that many tokens all
    routed to the same top-k experts (exactly that many tokens per expert); `trace_tokens`: also calls of that many
    tokens routed by the synthetic routing trace (measure.cpu_kernel_variants)."""
    window = int(window_gib * 2**30)
    default = kernel_knobs()
    short_rows = short_rows or [default["short_row_bytes"]]
    variants = variants or {"default": default}
    stream = measure.stream_read_gbps(window)
    stream_all = measure.stream_read_gbps(window, threads=measure.host_threads())  # every logical CPU: the stricter
    rows = []
    for name, shape in SHAPES.items():
        for fmt in formats:
            pool = measure.make_pool(shape, fmt, window)
            for tier, pf, short in [(t, p, s) for t in tiers for p in prefetch for s in short_rows]:
                _host.set_tier(tier)
                knobs = {v: dict(variants[v], prefetch_bytes=pf, short_row_bytes=short) for v in variants}
                # (tokens, routes per token): decode calls of 1 and 8 tokens x top-8, and the 1-2 expert
                # calls a CPU branch gets per layer when most misses are filled
                cases = [(1, shape.top_k, "window"), (8, shape.top_k, "window"), (1, 1, "window"), (1, 2, "window")]
                cases += [(t, shape.top_k, "trace") for t in trace_tokens]
                for tokens, k, routing in cases + [(t, shape.top_k, "shared") for t in shared_tokens]:
                    res = measure.cpu_kernel_variants(pool, dataclasses.replace(shape, top_k=k), tokens, knobs,
                                                      calls=calls, routing=routing)
                    for v, r in res.items():
                        rows.append({"shape": name, "format": fmt, "tier": tier, "prefetch": pf, "short_rows": short,
                                     "down_rows": knobs[v]["down_rows"], "knobs": v, "tokens": tokens,
                                     "top_k": k, "routing": routing, **r, "stream_gbps": stream,
                                     "ratio": r["gbps"] / stream, "stream_all_gbps": stream_all})
            pool.close()
            del pool
    _host.set_tier("auto")
    set_kernel_knobs(**default)
    return rows


def core_part(calls: int, formats: tuple[str, ...] = ("bf16", "int4"),
              variants: dict[str, dict] | None = None, tiers: list[str] | None = None) -> list[dict]:
    """One thread (the caller, no workers), one expert hit by every token of each call, so its weights
    stay in the caches: the kernel's compute rate per core, to compare with a core's share of STREAM."""
    info = _host.worker_info()
    _host.configure_workers(0, info["spin_us"], False)
    default = kernel_knobs()
    variants = variants or {"default": default}
    rows = []
    try:
        for name, shape in SHAPES.items():
            for fmt in formats:
                pool = measure.make_pool(shape, fmt, 1)
                nbytes = pool.expert_bytes("gate_up") + pool.expert_bytes("down")
                for tier, v, tokens in [(tr, v, t) for tr in tiers or [_host.active_tier()] for v in variants
                                        for t in (1, 2, 4, 8)]:
                    _host.set_tier(tier)
                    set_kernel_knobs(**variants[v])
                    x = np.random.default_rng(tokens).standard_normal((tokens, shape.hidden)).astype(np.float32)
                    xb = (x.view(np.uint32) >> 16).astype(np.uint16)
                    tok, eid = np.arange(tokens, dtype=np.int32), np.zeros(tokens, np.int32)
                    w = np.ones(tokens, np.float32)
                    times = []
                    # 30 calls of warm-up: the dev box's one-token call fell from 236 to ~50 us over its first 30
                    for _ in range(calls + 30):
                        t0 = time.perf_counter()
                        _host.run_experts(pool._h, xb, tok, eid, w, tokens, x_bf16=True)
                        times.append(time.perf_counter() - t0)
                    t = float(np.median(times[30:]))
                    rows.append({"shape": name, "format": fmt, "tier": tier, "knobs": v, "tokens": tokens, "us": t * 1e6,
                                 "gbps": nbytes / t / 1e9,
                                 "ns_per_weight_token": t * 1e9 / (3 * shape.hidden * shape.inter * tokens)})
                pool.close()
    finally:
        set_kernel_knobs(**default)
        _host.set_tier("auto")
        _host.configure_workers(info["n_workers"], info["spin_us"], info["pin"])
    return rows


def gpu_fill_part() -> list[dict]:
    from ftjax.host import cuda

    rows = []
    for hidden, inter in ((1024, 256), (2048, 512), (2048, 768)):  # 1.5, 6, 9 MiB per expert
        shape = measure.ExpertShape(hidden, inter)
        pool = measure.make_pool(shape, "bf16", 64 * shape.expert_bytes("bf16"))
        pool.pin()
        for n_rows in (8, 16, 32, 64):
            fill = cuda.fill_gbps(pool, n_rows)
            ceiling = cuda.memcpy_h2d_gbps(n_rows * shape.expert_bytes("bf16"))
            rows.append({"expert_mib": shape.expert_bytes("bf16") / 2**20, "rows": n_rows, "fill_gbps": fill,
                         "memcpy_gbps": ceiling, "ratio": fill / ceiling})
        pool.close()
    return rows


def gpu_handshake_part(layers: int = 40, reps: int = 50, tokens: int = 1) -> list[dict]:
    """Per-layer cost of the CPU branch inside one jitted step of ``layers`` chained submit/collect
    pairs (x [tokens, 2048] f32): with an empty task list (skipped on the GPU: no request reaches the
    CPU) and with one task on a tiny expert (H 2048, I 16: ~0.2 MiB, so the figure is the round trip,
    not the expert's compute)."""
    import jax
    import jax.numpy as jnp

    from ftjax.host import HostPool, cuda, tune_workers_for_gpu

    pool = HostPool(8, 2048, 16, "bf16")
    pool.pin()
    tune_workers_for_gpu()  # as OffloadExperts does on the GPU
    out = []
    for i, (cb, fused, n_valid) in enumerate((c, f, n) for n in (0, 1) for c, f in
                                              ((True, False), (False, False), (True, True))):
        base = 1000 + 100 * i
        for layer in range(layers):
            cuda.create_channel(base + layer, pool, max_tokens=tokens, max_tasks=8)

        @jax.jit
        def step(x):
            tok, w = np.zeros(8, np.int32), np.ones(8, np.float32)
            for layer in range(layers):
                eid = np.full(8, layer % 8, np.int32)
                t = cuda.cpu_experts_submit(x, tok, eid, w, n_valid, base + layer, cmd_buffer=cb, fused=fused)
                y, _ = cuda.cpu_experts_collect(t, tokens, 2048, base + layer, cmd_buffer=cb, fused=fused)
                x = x + y  # chain the layers
            return x

        x = jnp.full((tokens, 2048), 0.01, jnp.float32)
        step(x).block_until_ready()
        jobs0 = sum(_host.channel_jobs(base + i) for i in range(layers))
        serve0 = sum(_host.channel_serve_seconds(base + i) for i in range(layers))
        t0 = time.perf_counter()
        for _ in range(reps):
            x = step(x)
        x.block_until_ready()
        per_layer = (time.perf_counter() - t0) / reps / layers
        jobs = sum(_host.channel_jobs(base + i) for i in range(layers)) - jobs0
        serve = sum(_host.channel_serve_seconds(base + i) for i in range(layers)) - serve0
        out.append({"cmd_buffer": cb, "fused": fused, "tasks": n_valid, "tokens": tokens, "layers": layers,
                    "us_per_layer": per_layer * 1e6, "cpu_jobs": jobs,
                    "cpu_serve_us_per_job": serve / jobs * 1e6 if jobs else 0.0,
                    "last_call": _host.last_expert_call() if jobs else None})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window-gib", type=float, default=2.0)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--all-tiers", action="store_true", help="time every available CPU tier, not only the best")
    ap.add_argument("--tiers", nargs="+", help="time these CPU tiers (e.g. amx avx512bf16)")
    ap.add_argument("--formats", nargs="+", choices=("bf16", "int4"), default=["bf16", "int4"])
    ap.add_argument("--prefetch", type=int, nargs="+", default=None,
                    help="weight-row prefetch distances (bytes) to time, e.g. 0 256 512 1024 (default: the built-in one)")
    ap.add_argument("--short-rows", type=int, nargs="+", default=None,
                    help="short-row limits (bytes) to time: rows up to it prefetch a micro-tile ahead (0 = never; "
                         "default: the built-in one)")
    ap.add_argument("--knob-variants", nargs="+", default=[], metavar="KNOB=V[,KNOB=V]",
                    help="also time every case under these CPU kernel knobs (ftjax.host.kernel_knobs; the others at "
                         "their defaults), e.g. down_rows=16 int4_vnni_tokens=0")
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="time the CPU table at these thread counts (caller + workers; STREAM with the same "
                         "threads), e.g. 1 2 4 8 15: does the per-thread rate hold as threads are added?")
    ap.add_argument("--shared-tokens", type=int, nargs="+", default=[],
                    help="also time calls of this many tokens all routed to the same top-k experts (k shown as "
                         "'8s': exactly that many tokens per expert), e.g. 4 8 16")
    ap.add_argument("--trace-tokens", type=int, nargs="+", default=[],
                    help="also time calls of this many tokens routed as steps of the synthetic routing trace (one "
                         "layer of 256 experts, calibrated skew and reuse; k shown as '8t'), e.g. 8")
    ap.add_argument("--per-core", action="store_true",
                    help="also time one thread on one cache-resident expert (compute rate per core)")
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU kernel table (fill and handshake only)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "host_runtime.json"))
    args = ap.parse_args(argv)
    try:  # every value checked before any work
        variants = {"default": kernel_knobs(), **knob_variants(args.knob_variants)}
    except ValueError as e:
        ap.error(f"--knob-variants {e}")
    # scalar is the correctness reference, far too slow to time on GiB windows
    tiers = [t for t in _host.available_tiers() if t != "scalar"] if args.all_tiers else [_host.active_tier()]
    if args.tiers:
        missing = sorted(set(args.tiers) - set(_host.available_tiers()))
        if missing:
            ap.error(f"tiers {missing} not available here; available: {_host.available_tiers()}")
        tiers = args.tiers
    res = {"cpu": _host.cpu_brand(), "workers": _host.worker_info(), "window_gib": args.window_gib,
           "routing": "synthetic: fresh expert window per call (no reuse), DRAM-bound; k '8': each token top-8 of "
                      "a window of 16 experts, '8s': all tokens on the same 8, '8t': steps of the synthetic routing "
                      "trace (ftjax.experts.traces, 256 experts)"}
    prefetch = args.prefetch if args.prefetch else [_host.prefetch_bytes()]
    info = res["workers"]
    res["kernel"] = []
    for n in ([] if args.no_cpu else args.threads or [info["n_threads"]]):
        if args.threads:
            if not 1 <= n <= info["physical_cores"]:
                ap.error(f"--threads {n}: between 1 and the {info['physical_cores']} physical cores")
            _host.configure_workers(n - 1, info["spin_us"], info["pin"])
        try:
            rows = cpu_part(args.window_gib, args.calls, tiers, prefetch, tuple(args.formats), args.short_rows,
                            variants, tuple(args.shared_tokens), tuple(args.trace_tokens))
        finally:
            if args.threads:
                _host.configure_workers(info["n_workers"], info["spin_us"], info["pin"])
        res["kernel"] += [dict(r, threads=n) for r in rows]
    kw = max(len(v) for v in variants)
    if res["kernel"]:
        print(f"CPU: {res['cpu']}, {info['n_threads']} threads; STREAM read with the same threads "
              f"({args.window_gib} GiB); per thread = GB/s / threads; GB/s and /STREAM over the timed Python call, "
              f"'kernel' = /STREAM over the kernel's own clock (no binding or y allocation: the call as the jitted "
              f"step's FFI handler makes it); '/all' = GB/s over the STREAM read by all "
              f"{measure.host_threads()} logical CPUs ({res['kernel'][0]['stream_all_gbps']:.1f} GB/s)")
        print(f"{'shape':22} {'fmt':5} {'tier':11} {'pf B':>5} {'short':>5} {'knobs':{kw}} {'thr':>3} {'tok':>3} {'k':>3} "
              f"{'ms':>7} "
              f"{'GB/s':>7} {'/thread':>7} {'STREAM':>7} {'/STREAM':>8} {'kernel':>7} {'/all':>5}")
    for r in res["kernel"]:
        print(f"{r['shape']:22} {r['format']:5} {r['tier']:11} {r['prefetch']:5d} {r['short_rows']:5d} {r['knobs']:{kw}} "
              f"{r['threads']:3d} "
              f"{r['tokens']:>3} {_k(r):>3} {r['ms']:7.3f} {r['gbps']:7.1f} {r['gbps'] / r['threads']:7.2f} "
              f"{r['stream_gbps']:7.1f} {r['ratio']:8.2f} {r['kernel_gbps'] / r['stream_gbps']:7.2f} "
              f"{r['gbps'] / r['stream_all_gbps']:5.2f}")
    if res["kernel"]:
        print("\nWhere the calls go (us, the kernel's clock, medians): setup, then per round its wall time / the caller's"
              "\nwait for other threads; 'outside' = the timed call minus the kernel's total (binding, y allocation)")
        print(f"{'shape':22} {'fmt':5} {'tier':11} {'knobs':{kw}} {'tok':>3} {'k':>3} {'total':>7} {'setup':>6} {'layouts':>13} "
              f"{'phase1':>13} {'phase2':>13} {'outside':>7}")
        for r in res["kernel"]:
            p = r["profile"]
            rounds = " ".join(f"{p[k + '_us']:7.1f}/{p[k + '_wait_us']:5.1f}" for k in ("layouts", "phase1", "phase2"))
            print(f"{r['shape']:22} {r['format']:5} {r['tier']:11} {r['knobs']:{kw}} {r['tokens']:>3} {_k(r):>3} "
                  f"{p['total_us']:7.1f} "
                  f"{p['setup_us']:6.1f} {rounds} {r['ms'] * 1e3 - p['total_us']:7.1f}")
    if args.per_core:
        res["per_core"] = core_part(args.calls, tuple(args.formats), variants, tiers)
        full = [r for r in res["kernel"] if r["threads"] == info["n_threads"]]
        share = full[0]["stream_gbps"] / info["n_threads"] if full else float("nan")
        print(f"\nOne thread, one cache-resident expert, bf16 activations (a core's share of STREAM: {share:.1f} GB/s)")
        print(f"{'shape':22} {'fmt':5} {'tier':11} {'knobs':{kw}} {'tok':>3} {'us':>8} {'GB/s':>7} {'ns/(weight*token)':>18}")
        for r in res["per_core"]:
            print(f"{r['shape']:22} {r['format']:5} {r['tier']:11} {r['knobs']:{kw}} {r['tokens']:3d} {r['us']:8.1f} "
                  f"{r['gbps']:7.1f} "
                  f"{r['ns_per_weight_token']:18.4f}")
    if not args.no_gpu and _host.cuda_built() and _host.cuda_device_count() > 0:
        res["gpu"] = _host.cuda_device_name(0)
        res["fill"] = gpu_fill_part()
        print(f"\nGPU: {res['gpu']}; fill kernel (scattered ids, both banks) vs pinned cudaMemcpy H2D")
        print(f"{'expert MiB':>10} {'rows':>5} {'fill GB/s':>10} {'memcpy':>8} {'ratio':>6}")
        for r in res["fill"]:
            print(f"{r['expert_mib']:10.2f} {r['rows']:5d} {r['fill_gbps']:10.1f} {r['memcpy_gbps']:8.1f} "
                  f"{r['ratio']:6.2f}")
        res["handshake"] = gpu_handshake_part()
        print("\nCPU branch per layer, 40 layers chained in one jit, x [1, 2048] f32 "
              "(0 tasks: skipped on the GPU; 1 task: tiny expert, the round trip)")
        for r in res["handshake"]:
            print(f"  {r['tasks']} task{'s' if r['tasks'] != 1 else ' '}, command-buffer trait {str(r['cmd_buffer']):5}, "
                  f"fused kernels {str(r['fused']):5}: {r['us_per_layer']:6.1f} us per layer; CPU side "
                  f"{r['cpu_serve_us_per_job']:5.1f} us per job ({r['cpu_jobs']} jobs)")
            if r["last_call"]:
                p = r["last_call"]
                print(f"    its last call: kernel {p['total_us']:.1f} us = setup {p['setup_us']:.1f}, layouts "
                      f"{p['layouts_us']:.1f}, phase1 {p['phase1_us']:.1f} (wait {p['phase1_wait_us']:.1f}), phase2 "
                      f"{p['phase2_us']:.1f} (wait {p['phase2_wait_us']:.1f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
