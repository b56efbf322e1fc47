"""A model (not a measurement) of the decode step's miss time per policy, over a routing trace: what an
intra-expert split of the missed experts between the PCIe fill and the CPU would buy at batch 1.

Today (`ftjax.experts.plan`) a whole expert is the unit of the miss split: a layer call with ``m``
unique misses fills ``n = balance(m, f)`` experts and computes ``m - n`` on the CPU (``f = B_P / (B_P +
B_H)``); a call that `defer_fills` picks (a lone miss, at the H200's figures) computes all ``m`` on the
CPU and fills its ``n`` in the background. The proposal: the ``n`` experts chosen for filling are split
by intermediate units, ``y = sum_i down[:, i] silu(gate_i x) up_i x``: the GPU computes the units
``[0, u)`` from a synchronous partial fill (fraction ``q = u / I`` of the expert's bytes) while the CPU
computes ``[u, I)`` (`ExpertCall.unit_start`) beside the ``m - n`` whole misses; the rest of the slot
fills in the background so the expert is whole for the layer's next call.

Per layer call (critical path of the misses only; the hits' GPU work runs beside the CPU branch):

    fill-only (lru-fill)   n * (e / B_P) + t_fill                    (every miss filled)
    cpu-only               t_cpu + m * e / B_H
    whole split (today)    max(n (e / B_P) + t_fill, t_cpu + (m - n) e / B_H), or, deferred, t_cpu + m e / B_H
    unit split (proposal)  max(n q e / B_P + t_fill, t_cpu + (m - n q) e / B_H), q from `plan.split_units`
    matrix split (proposal) max(m g e / B_P + t_fill, t_cpu + m (1 - g) e / B_H) + t_down
                           (every miss cached: its down rows, share g = 1/3 of the bytes, filled now while the
                           CPU computes its gate/up rows and hands back h; the GPU's down product of h after
                           the collect, t_down; the gate/up rows fill in the background)

with ``e`` the expert's bytes, ``t_fill`` a fill launch and ``t_cpu`` the CPU branch's round trip beyond
its compute. Which experts the cache holds comes from an LRU simulation per policy (whole and unit split
cache the same ``n`` experts per call; lru-fill all ``m``). The step's PCIe time (synchronous fills plus
background fills, all at ``B_P``) is reported against the modelled step time: above 1 the background
fills could not all hide. The roofline charges ``m e / B_DRAM`` per call. Model parameters default to the
H200 figures in bench/RESULTS.md (session 10: B_P 47.9, B_H 81.8, B_DRAM 110.1 GB/s, T_gpu 3.45 ms for
40 layers at batch 1); the plan's per-layer bookkeeping (``--plan-us``) is added to every policy but
resident. ``--check`` prints the model's lru-split and lru-fill figures next to that session's
measurements (108.6 with background fills, 82.9 tok/s).

    python bench/split_model.py [--steps 300] [--fraction 0.37] [--batch 1] [--trace FILE.npz]
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftjax.experts import plan  # noqa: E402
from ftjax.experts.traces import RoutingTrace, synthetic_trace  # noqa: E402


@functools.lru_cache(maxsize=None)
def split_rule(m: int, f: float) -> tuple[int, bool]:
    """The plan's own rule for a call with ``m`` misses: ``(n_fill, deferred)`` from
    `plan.balance_fill` and `plan.defer_fills` (memoized: it depends on m and f only)."""
    m_, f_ = jnp.int32(m), jnp.float32(f)
    n = plan.balance_fill(m_, f_)
    return int(n), bool(plan.defer_fills(m_, n, f_))


@functools.lru_cache(maxsize=None)
def unit_share(m: int, n: int, f: float, steps: int) -> float:
    """The share q of each split expert's units on the GPU: `plan.split_units` in ``steps`` steps."""
    return int(plan.split_units(jnp.int32(m), jnp.int32(n), jnp.float32(f), steps, 1)) / steps


def call_costs(m: int, p) -> dict:
    """Critical miss time (us) and PCIe bytes (sync, background) of one layer call with ``m`` misses."""
    e, bp, bh = p.expert_bytes, p.b_p * 1e3, p.b_h * 1e3  # bytes per us
    f = p.b_p / (p.b_p + p.b_h)
    n, defer = split_rule(m, f)
    out = {"fill": (m * e / bp + p.t_fill if m else 0.0, m * e, 0.0, m),
           "cpu": (p.t_cpu + m * e / bh if m else 0.0, 0.0, 0.0, 0)}
    if m == 0:
        out["whole"] = out["unit"] = out["matrix"] = (0.0, 0.0, 0.0, 0)
        return out
    if defer:
        out["whole"] = (p.t_cpu + m * e / bh, 0.0, n * e, n)
    else:
        cpu = p.t_cpu + (m - n) * e / bh if m > n else 0.0
        out["whole"] = (max(n * e / bp + p.t_fill, cpu), n * e, 0.0, n)
    # matrix split: every miss cached; its down rows (1/3 of the bytes) filled now while the CPU computes its
    # gate/up rows (2/3) and hands back h = silu(gate x) * up x; the GPU's down product after the collect
    g = p.down_share
    out["matrix"] = (max(m * g * e / bp + p.t_fill, p.t_cpu + m * (1 - g) * e / bh) + p.t_down,
                     m * g * e, m * (1 - g) * e, m)
    q = unit_share(m, n, f, p.unit_steps)  # the plan's rule (bandwidths only, no fixed costs)
    gpu = n * q * e / bp + p.t_fill if q > 0 else 0.0
    left = m - n * q
    cpu = p.t_cpu + left * e / bh if left > 1e-9 else 0.0
    out["unit"] = (max(gpu, cpu), n * q * e, n * (1 - q) * e, n)
    return out


def simulate(trace: RoutingTrace, num_slots: int, p, warmup: int) -> dict:
    """Per policy: mean critical miss us per layer call, misses per call, PCIe bytes per step."""
    steps, L, B, k = trace.ids.shape
    E = trace.num_experts
    caches = {"whole": collections.OrderedDict(), "fill": collections.OrderedDict(),
              "cpu": collections.OrderedDict(), "matrix": collections.OrderedDict()}
    acc = {pol: dict(t=0.0, m=0, sync=0.0, bg=0.0) for pol in ("whole", "unit", "fill", "cpu", "matrix")}
    calls = 0
    for s in range(steps):
        for layer in range(L):
            uniq = [layer * E + int(e) for e in np.unique(trace.ids[s, layer][trace.valid[s]])]
            for pol, cache in caches.items():
                missed = [fid for fid in uniq if fid not in cache]
                for fid in uniq:
                    if fid in cache:
                        cache.move_to_end(fid)
                costs = call_costs(len(missed), p)
                n_cached = costs[pol][3]
                for fid in missed[:n_cached]:  # (which n: the order does not matter to the model)
                    cache[fid] = None
                    if len(cache) > num_slots:
                        cache.popitem(last=False)
                if s < warmup:
                    continue
                names = ("whole", "unit") if pol == "whole" else (pol,)  # unit split caches as whole
                for name in names:
                    t, sync, bg, _ = costs[name]
                    a = acc[name]
                    a["t"] += t
                    a["m"] += len(missed)
                    a["sync"] += sync
                    a["bg"] += bg
            calls += s >= warmup
    n_steps = steps - warmup
    return {pol: dict(us_per_call=a["t"] / calls, misses_per_call=a["m"] / calls,
                      pcie_bytes_per_step=(a["sync"] + a["bg"]) / n_steps, miss_bytes_per_step=a["m"] / n_steps)
            for pol, a in acc.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, help="a recorded routing trace (.npz); default: the synthetic one")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--fraction", type=float, default=0.37, help="expert cache, share of the pool")
    ap.add_argument("--expert-bytes", type=float, default=3 * 2048 * 512 * 2, help="bf16 Qwen3.6 expert")
    ap.add_argument("--b-p", type=float, default=47.9, help="fill GB/s")
    ap.add_argument("--b-h", type=float, default=81.8, help="CPU expert kernel GB/s (with fills running)")
    ap.add_argument("--b-dram", type=float, default=110.1, help="host DRAM read GB/s (roofline)")
    ap.add_argument("--t-gpu-ms", type=float, default=3.45, help="step time with every expert resident")
    ap.add_argument("--plan-us", type=float, default=19.0, help="the plan's bookkeeping per layer call")
    ap.add_argument("--t-cpu", type=float, default=20.0, help="CPU-branch round trip beyond compute, us")
    ap.add_argument("--t-fill", type=float, default=6.0, help="a fill launch, us")
    ap.add_argument("--t-down", type=float, default=5.0,
                    help="matrix split: the GPU's down product of the CPU's h after the collect, us")
    ap.add_argument("--down-share", type=float, default=1 / 3, help="matrix split: the down matrix's share of "
                    "an expert's bytes (SwiGLU: 1/3)")
    ap.add_argument("--unit-steps", type=int, default=64,
                    help="split granularity: I / 8 (OffloadExperts' unit_granule for bf16 pools), I = 512")
    ap.add_argument("--check", action="store_true", help="print session 10's measured figures beside the model")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "split_model.json")
    args = ap.parse_args(argv)
    if args.trace:
        trace = RoutingTrace.load(args.trace)
        source = f"trace {args.trace}"
    else:
        trace = synthetic_trace(args.steps, args.layers, args.experts, args.top_k, args.batch)
        source = "synthetic trace (ftjax.experts.traces defaults)"
    steps, L, B, _ = trace.ids.shape
    if args.warmup >= steps:
        ap.error(f"--warmup {args.warmup} must be below the trace's {steps} steps")
    slots = int(args.fraction * L * trace.num_experts)
    res = simulate(trace, slots, args, args.warmup)
    print(f"MODEL, not a measurement | {source}: {steps} steps ({args.warmup} warm-up), {L} layers, batch {B}, "
          f"cache {args.fraction:.0%} ({slots} slots) | B_P {args.b_p}, B_H {args.b_h}, B_DRAM {args.b_dram} GB/s, "
          f"expert {args.expert_bytes / 1e6:.2f} MB, t_cpu {args.t_cpu} us, t_fill {args.t_fill} us, "
          f"T_gpu {args.t_gpu_ms} ms, plan {args.plan_us} us/layer")
    miss_b = res["whole"]["miss_bytes_per_step"] * args.expert_bytes
    roof_ms = args.t_gpu_ms + miss_b / (args.b_dram * 1e6)
    print(f"roofline {B * 1e3 / roof_ms:.1f} tok/s ({roof_ms:.2f} ms per step of {B} tokens, "
          f"{res['whole']['misses_per_call']:.2f} misses per layer call under the split's cache)")
    print(f"{'policy':<22} {'miss us/call':>12} {'misses/call':>11} {'step ms':>8} {'tok/s':>7} {'/roof':>6} "
          f"{'PCIe/step':>9}")
    names = {"whole": "whole split (today)", "unit": "unit split (proposal)", "fill": "lru-fill", "cpu": "cpu",
             "matrix": "matrix split (proposal)"}
    rows = {}
    for pol in ("whole", "unit", "matrix", "fill", "cpu"):
        r = res[pol]
        step_ms = args.t_gpu_ms + L * (r["us_per_call"] + args.plan_us) / 1e3
        pcie = r["pcie_bytes_per_step"] / (args.b_p * 1e6) / step_ms  # PCIe busy share of the step
        rows[pol] = dict(r, step_ms=step_ms, tok_s=B * 1e3 / step_ms, roof=roof_ms / step_ms, pcie_share=pcie)
        print(f"{names[pol]:<22} {r['us_per_call']:12.1f} {r['misses_per_call']:11.2f} {step_ms:8.2f} "
              f"{B * 1e3 / step_ms:7.1f} {roof_ms / step_ms:6.2f} {pcie:9.2f}")
    print(f"matrix / whole split: {rows['whole']['step_ms'] / rows['matrix']['step_ms']:.3f}x tok/s")
    print(f"unit / whole split: {rows['whole']['step_ms'] / rows['unit']['step_ms']:.3f}x tok/s "
          f"(PCIe/step: the share of the modelled step the fills, synchronous and background, keep PCIe busy)")
    if args.check:
        print("measured, RESULTS session 10 (trace routing, 37%): batch 1 lru-split with background fills 108.6 "
              "tok/s, lru-fill 82.9, roofline 160.1 (B_P 47.9, B_H 81.8, B_DRAM 110.1, T_gpu 3.45 ms); batch 4: "
              "265.6, 136.1, roofline 309.4 (B_P 48.9, B_H 98.0, B_DRAM 121.5, T_gpu 5.01 ms)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(model=True, source=source, args={k: str(v) for k, v in vars(args).items()},
                                        roofline_tok_s=B * 1e3 / roof_ms, policies=rows), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
