"""Where a decode layer's time goes, from a profiler trace of the offloaded decode step.

    python bench/layer_timeline.py DIR [--example 20]

For each ``perfetto_trace.json.gz`` under DIR (``bench/decode.py --profile DIR``): the GPU kernels of the
step (every stream of XLA's command buffer: a CUDA graph runs independent nodes on several streams;
the background fills' own stream left out) cut into layer calls at each ``plan_kernel`` (the fused plan
opens every MoE layer call),
then, as medians over the layer calls of the profiled steps (a step's last call, which runs the LM
head and waits for the next step's dispatch, is left out: calls longer than 3x the median), the time
from the plan's start to each phase:

  plan     the plan kernel
  gap      plan end -> the submit kernel's start (0 in a call without one)
  submit   the CPU branch's submit kernel: staging + flag
  to_coll  submit end (else plan end) -> collect start: the GPU's own work (fills, GEMV, shared expert)
  collect  the collect kernel: mostly the GPU waiting for the CPU branch's done flag
  rest     collect end -> next plan: combine, the next layer's attention and router
  idle     time in the call with no kernel running (on the step's streams)

and one layer call's kernels (``--example``: its index among the calls) with offsets, durations and
streams, so the critical path can be read kernel by kernel; the background fills that overlap it are
listed after it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_summary import gpu_kernels, load, short, trace_name, trace_paths, union_length  # noqa: E402

PHASES = ("call", "plan", "gap", "submit", "to_coll", "collect", "rest", "busy", "idle")


BACKGROUND = ("bg_fill",)  # kernels of the background fills' side stream


def layer_calls(ks: list[dict]) -> tuple[list[list[dict]], set]:
    """The step's kernels (all streams but the background fills') cut at each plan kernel."""
    side = {(e["pid"], e["tid"]) for e in ks if any(b in e["name"] for b in BACKGROUND)}
    work = sorted((e for e in ks if (e["pid"], e["tid"]) not in side), key=lambda e: e["ts"])
    calls, cur = [], None
    for e in work:
        if "plan_kernel" in e["name"] and "publish" not in e["name"]:  # (the host plan's publish_plan_kernel
            # comes before the plan, at the end of the previous call's "rest")
            cur = [e]
            calls.append(cur)
        elif cur is not None:
            cur.append(e)
    return calls, side


def phases(call: list[dict], end: float) -> dict[str, float]:
    """Phase lengths (us) of one layer call from its plan's start to ``end`` (the next plan's start)."""
    t0 = call[0]["ts"]
    plan_end = t0 + call[0]["dur"]
    sub = next((e for e in call if "submit" in e["name"]), None)
    col = next((e for e in call if "collect" in e["name"]), None)
    busy = union_length(sorted((e["ts"], min(e["ts"] + e["dur"], end)) for e in call))  # over the streams
    out = {"call": end - t0, "plan": call[0]["dur"], "busy": busy, "idle": (end - t0) - busy}
    if col is not None:  # (a call without a submit kernel: to_coll from the plan's end)
        sub_end = sub["ts"] + sub["dur"] if sub is not None else plan_end
        out["gap"] = sub["ts"] - plan_end if sub is not None else 0.0
        out["submit"] = sub["dur"] if sub is not None else 0.0
        out["to_coll"] = col["ts"] - sub_end
        out["collect"] = col["dur"]
        out["rest"] = end - (col["ts"] + col["dur"])
    return out


def summarise(path: Path, example: int) -> None:
    ks = gpu_kernels(load(path))
    calls, side = layer_calls(ks)
    name = trace_name(path)
    if len(calls) < 2:
        print(f"\n== {name}: no plan kernels on the GPU (not an offloaded decode trace)")
        return
    rows = [phases(c, calls[i + 1][0]["ts"]) for i, c in enumerate(calls[:-1])]
    med_call = statistics.median(r["call"] for r in rows)
    keep = [r for r in rows if r["call"] <= 3 * med_call]
    print(f"\n== {name}: {len(calls)} layer calls, {len(keep)} kept (calls > 3x the median "
          f"{med_call:.1f} us left out)")
    work = [e for c in calls for e in c]
    span = max(e["ts"] + e["dur"] for e in work) - calls[0][0]["ts"]
    if sum(r["call"] for r in rows) < 0.5 * span:
        print(f"  (the layer calls cover {sum(r['call'] for r in rows) / span:.0%} of the span: the plan kernels "
              "do not interleave with the rest in this trace's timestamps; the phases below are not the step's)")
    print("median us per layer call: " + "  ".join(
        f"{p} {statistics.median(r[p] for r in keep if p in r):.1f}" for p in PHASES
        if any(p in r for r in keep)))
    ex = min(max(example, 0), len(calls) - 2)
    call, end = calls[ex], calls[ex + 1][0]["ts"]
    t0 = call[0]["ts"]
    print(f"layer call {ex} ({end - t0:.1f} us):")
    print(f"  {'start':>8} {'dur':>7} {'stream':>7}  kernel")
    prev_end = t0
    for e in call:
        gap = e["ts"] - prev_end
        mark = f"  (idle {gap:.1f})" if gap > 1.0 else ""
        print(f"  {e['ts'] - t0:8.1f} {e['dur']:7.1f} {e['tid']:>7}  {short(e['name'])}{mark}")
        prev_end = max(prev_end, e["ts"] + e["dur"])
    others = [e for e in ks if (e["pid"], e["tid"]) in side and e["ts"] < end and e["ts"] + e["dur"] > t0]
    for e in sorted(others, key=lambda e: e["ts"]):
        print(f"  {e['ts'] - t0:8.1f} {e['dur']:7.1f} {e['tid']:>7}  [background] {short(e['name'])}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--example", type=int, default=20, help="index of the layer call to list kernel by kernel")
    args = ap.parse_args(argv)
    paths = trace_paths(args.root)
    if not paths:
        print(f"no perfetto_trace.json.gz under {args.root}", file=sys.stderr)
        return 1
    for p in paths:
        summarise(p, args.example)
    return 0


if __name__ == "__main__":
    sys.exit(main())
