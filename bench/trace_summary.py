"""Summarise a jax profiler perfetto trace: GPU kernel time by kernel, busy time against the span.

    python bench/trace_summary.py DIR [--top 25] [--steps 3]

For each ``perfetto_trace.json.gz`` under DIR: the GPU kernel events (CUPTI, on device "pids"),
their total duration, the span from the first kernel start to the last kernel end, the busy fraction
(kernel time / span: far below 1 means the step waits on launches, the host or the CPU branch), and
the kernels grouped by name with count and total time per step; then the host's CUDA API calls that
launch work (graph launches, kernel launches, copies, stream waits) per step: many kernel launches
beside few graph launches mean parts of the step run outside XLA's command buffers.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from pathlib import Path


def load(path: Path) -> list[dict]:
    with gzip.open(path) as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d


def gpu_kernels(events: list[dict]) -> list[dict]:
    """Kernel and copy events on GPU device processes (process names like '/device:GPU:0')."""
    names = {e["pid"]: e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name" and "args" in e}
    gpu = {pid for pid, n in names.items() if re.search(r"/device:GPU", n)}
    ks = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and e.get("dur") is not None]
    # Device processes also carry derived lines ("XLA Ops", "XLA Modules", "Steps"): keep the streams.
    threads = {(e["pid"], e["tid"]): e["args"].get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and "args" in e}
    streams = {key for key, n in threads.items() if n.startswith("Stream")}
    return [e for e in ks if (e["pid"], e["tid"]) in streams] if streams else ks


LAUNCH_API = re.compile(r"^cu(da)?(GraphLaunch|LaunchKernel|LaunchKernelEx|Memcpy|Memset|StreamWait|"
                        r"StreamWriteValue|StreamWaitValue|EventRecord|LaunchHostFunc)")


def host_launches(events: list[dict]) -> dict[str, int]:
    """CUDA runtime/driver API calls that launch or order work, on host threads, by name."""
    names = {e["pid"]: e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name" and "args" in e}
    gpu = {pid for pid, n in names.items() if re.search(r"/device:GPU", n)}
    out: dict[str, int] = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in gpu and LAUNCH_API.match(e.get("name", "")):
            out[re.sub(r"_v\d+$", "", e["name"])] += 1
    return out


def hlo_entry_ops(hlo_text: str) -> dict[str, int]:
    """Top-level instructions of a compiled module's ENTRY computation by opcode; calls into XLA's
    command buffers count as "command_buffer". Work outside command buffers is launched one op at a
    time from the host on every step."""
    out: dict[str, int] = collections.Counter()
    in_entry = False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            in_entry = True
            continue
        if in_entry:
            if line.startswith("}"):
                break
            m = re.search(r" = .*?\s([a-z][a-z0-9-]*)\(", line)
            if not m or m.group(1) in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
                continue
            out["command_buffer" if "command_buffer" in line and m.group(1) == "call" else m.group(1)] += 1
    return out


def trace_paths(root: str) -> list[Path]:
    """The profiler's perfetto traces under ``root`` (``jax.profiler.trace(..., create_perfetto_trace=True)``)."""
    return sorted(Path(root).rglob("perfetto_trace.json.gz"))


def trace_name(path: Path) -> str:
    """A trace's run name: the directory given to the profiler (ROOT/NAME/plugins/profile/TIME/...)."""
    return path.parent.parent.parent.parent.name if path.parents[3:] else str(path)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals sorted by start."""
    busy, cur_s, cur_e = 0.0, intervals[0][0], intervals[0][1]
    for s, e in intervals[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + cur_e - cur_s


def short(name: str) -> str:
    name = re.sub(r"\.\d+$", "", name)
    return name if len(name) < 70 else name[:67] + "..."


def summarise(path: Path, top: int, steps: int) -> None:
    events = load(path)
    ks = gpu_kernels(events)
    print(f"\n== {trace_name(path)}: {len(ks)} GPU events")
    if not ks:
        return
    # Streams overlap: busy time is the union of intervals over all GPU threads.
    iv = sorted((e["ts"], e["ts"] + e["dur"]) for e in ks)
    busy = union_length(iv)
    span = iv[-1][1] - iv[0][0]
    total = sum(e["dur"] for e in ks)
    print(f"span {span / steps / 1e3:.2f} ms/step, busy (union) {busy / steps / 1e3:.2f} ms/step "
          f"({busy / span:.2f}), kernel sum {total / steps / 1e3:.2f} ms/step, {len(ks) / steps:.0f} events/step")
    by = collections.defaultdict(lambda: [0, 0.0])
    for e in ks:
        b = by[short(e["name"])]
        b[0] += 1
        b[1] += e["dur"]
    print(f"{'kernel':70} {'n/step':>7} {'us/step':>9} {'share':>6}")
    for name, (n, d) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{name:70} {n / steps:7.0f} {d / steps:9.1f} {d / total:6.1%}")
    api = host_launches(events)
    if api:
        print("host CUDA API calls per step: " + ", ".join(f"{k} {v / steps:.0f}" for k, v in
                                                           sorted(api.items(), key=lambda kv: -kv[1])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    paths = trace_paths(args.root)
    if not paths:
        print(f"no perfetto_trace.json.gz under {args.root}", file=sys.stderr)
        return 1
    for p in paths:
        summarise(p, args.top, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
