"""Where a decode layer call's time goes, from the handshake's own stamps (``cuda.channel_stamps``).

``bench/decode.py --stamps`` calls :func:`layer_phases` right after lru-split's timed run and prints
:func:`table`. Every layer call of the timed steps is cut at the stamps of its fused submit and collect
kernels (the GPU's %globaltimer) and at the coordinator's (the host's steady clock):

  submit      the submit kernel: staging x and the tasks, the request's publication
  gpu work    publication -> the collect kernel's start: the GPU's own work of the call (fills, GEMV)
  gpu waits   collect start -> done seen: the GPU idle, waiting for the CPU branch
  y copy      done seen -> the collect's end (its first block's share of y)
  to next     collect end -> the next layer's submit start: combine, the next layer's attention, router and
              plan (the step's last layer is left out: it runs the LM head and waits for the next dispatch)
  to cpu      publication -> the coordinator saw it (PCIe, the coordinator's polling)
  cpu job     the coordinator's request seen -> done published (the CPU expert call)
  to gpu      done published -> the collect saw it (includes the GPU still busy with its own work: the collect
              cannot see done before it starts)

Per step (the last ``steps`` less one: a step ends where the next one's first submit starts), each GPU phase
summed over the step's layer calls, in ms, and:

  step        layer 0's submit start -> the next step's: the step's whole GPU time line
  step gap    the last layer's collect end -> the next step's first submit: the LM head, sampling, the next
              step's embedding, layer 0's attention, router and plan, and any wait for the host's dispatch
  job calls   the step's layer calls with a CPU job

The GPU phases and the gap add up to the step exactly (one clock, consecutive stamps). Given the host's decode
calls (``host_calls``: each step's dispatch start and end, ``time.monotonic_ns``: the coordinator's clock), per
step also:

  host call   the decode call's time on the host (enqueue; the step's command-buffer updates)
  host lead   the previous step's last collect end less this step's dispatch end: > 0 the host had the step
              enqueued before the GPU needed it; < 0 the GPU waited that long for the host

The two clocks differ by an unknown offset: "to cpu" and "to gpu" assume the fastest crossing is the same
both ways (offset = half the difference of the two smallest apparent crossings); their sum per job is
exact (the GPU's round trip less the coordinator's own time).
"""
from __future__ import annotations

import numpy as np

GPU_PHASES = ("submit", "gpu work", "gpu waits", "y copy", "to next")
CPU_PHASES = ("to cpu", "cpu job", "to gpu")
STEP_PHASES = ("gpu work, job calls", "gpu work, other calls") + tuple(p for p in GPU_PHASES if p != "gpu work") + (
    "step gap", "step")
HOST_PHASES = ("host call", "host lead")


def _rows(st: dict, channel: int, calls: int) -> tuple[dict, dict]:
    from ftjax.host.cuda import HOST_STAMP_COLUMNS, STAMP_COLUMNS

    if st["submits"] != st["collects"]:
        raise RuntimeError(f"channel {channel}: {st['submits']} stamped submits against {st['collects']} collects "
                           "(a path without the fused submit ran): no per-call cut")
    gpu, host = st["gpu"][-calls:], st["host"]
    if gpu.shape[0] < calls:
        raise RuntimeError(f"channel {channel} holds {gpu.shape[0]} stamped calls, {calls} asked for (the ring "
                           "keeps the last calls only)")
    g = {name: gpu[:, i] for i, name in enumerate(STAMP_COLUMNS)}
    h = {name: host[:, i] for i, name in enumerate(HOST_STAMP_COLUMNS)}
    return g, h


def layer_phases(channels: list[int], steps: int, read=None, host_calls=None) -> dict:
    """Per layer call of the last ``steps`` decode steps, ``channels`` the layers' CPU-branch channels in layer
    order (``OffloadExperts.channel_base + layer``; every call through the fused handshake): each phase's
    duration in us, for the calls with a CPU job and those without. ``read``: ``cuda.channel_stamps``;
    ``host_calls``: (start, end) ns of those steps' decode calls on the host's monotonic clock."""
    if read is None:
        from ftjax.host.cuda import channel_stamps as read
    L = len(channels)
    per = [_rows(read(ch), ch, steps) for ch in channels]
    out = {"with job": {p: [] for p in GPU_PHASES + CPU_PHASES}, "without": {p: [] for p in GPU_PHASES}}
    d1, d2, pairs = [], [], []
    for layer, (g, h) in enumerate(per):
        job = g["submit_seq"] > 0
        span = {"submit": g["published"] - g["submit_start"], "gpu work": g["collect_start"] - g["published"],
                "gpu waits": g["done_seen"] - g["collect_start"], "y copy": g["collect_end"] - g["done_seen"]}
        if layer + 1 < L:
            span["to next"] = per[layer + 1][0]["submit_start"] - g["collect_end"]
        for p, v in span.items():
            out["with job"][p].extend(v[job] / 1e3)
            out["without"][p].extend(v[~job] / 1e3)
        served = {int(s): (int(seen), int(done)) for s, seen, done, j in zip(h["seq"], h["seen"], h["done"], h["job"])}
        for s, pub, seen_gpu in zip(g["submit_seq"][job], g["published"][job], g["done_seen"][job]):
            if int(s) in served:  # (the host ring keeps as many rows as the GPU's)
                seen, done = served[int(s)]
                d1.append(seen - int(pub))      # offset + the crossing to the CPU
                d2.append(int(seen_gpu) - done)  # the crossing back - offset
                pairs.append(done - seen)
    offset = None
    if pairs:
        d1, d2 = np.asarray(d1, np.float64), np.asarray(d2, np.float64)
        offset = (d1.min() - d2.min()) / 2  # host clock - GPU clock
        out["with job"]["to cpu"] = list((d1 - offset) / 1e3)
        out["with job"]["cpu job"] = list(np.asarray(pairs, np.float64) / 1e3)
        out["with job"]["to gpu"] = list((d2 + offset) / 1e3)
    out["per step"] = _per_step(per, steps)
    if host_calls is not None:
        if offset is None:
            raise RuntimeError("host calls given, but no CPU job in these steps to align the two clocks")
        out["per step"].update(_host_per_step([g for g, _ in per], host_calls, steps, offset))
    out["calls"] = {"with job": int(sum(int((g["submit_seq"] > 0).sum()) for g, _ in per)),
                    "without": int(sum(int((g["submit_seq"] == 0).sum()) for g, _ in per))}
    out["steps"], out["layers"] = steps, L
    return out


def _per_step(per: list, steps: int) -> dict:
    """ms per step of each of ``STEP_PHASES`` and the job calls' count, one value per step but the last."""
    g = [gi for gi, _ in per]
    n = steps - 1
    first, last = g[0], g[-1]
    out = {p: np.zeros(n) for p in STEP_PHASES}
    out["job calls"] = np.zeros(n)
    for layer, gl in enumerate(g):
        job = (gl["submit_seq"] > 0)[:n]
        work = (gl["collect_start"] - gl["published"])[:n] / 1e6
        out["gpu work, job calls"] += np.where(job, work, 0.0)
        out["gpu work, other calls"] += np.where(job, 0.0, work)
        out["submit"] += (gl["published"] - gl["submit_start"])[:n] / 1e6
        out["gpu waits"] += (gl["done_seen"] - gl["collect_start"])[:n] / 1e6
        out["y copy"] += (gl["collect_end"] - gl["done_seen"])[:n] / 1e6
        if layer + 1 < len(g):
            out["to next"] += (g[layer + 1]["submit_start"] - gl["collect_end"])[:n] / 1e6
        out["job calls"] += job
    out["step gap"] = (first["submit_start"][1:] - last["collect_end"][:-1])[:n] / 1e6
    out["step"] = np.diff(first["submit_start"])[:n] / 1e6
    return {k: list(v) for k, v in out.items()}


def _host_per_step(g: list, host_calls, steps: int, offset: float) -> dict:
    """``HOST_PHASES`` per step boundary: the host's call of step i + 1 against the GPU's end of step i."""
    calls = np.asarray(host_calls, np.float64).reshape(-1, 2)
    if calls.shape[0] != steps:
        raise RuntimeError(f"{calls.shape[0]} host calls given for {steps} steps")
    end_gpu = calls[1:, 1] - offset  # step i + 1's dispatch end on the GPU's clock
    return {"host call": list((calls[1:, 1] - calls[1:, 0]) / 1e6),
            "host lead": list((g[-1]["collect_end"][:-1] - end_gpu) / 1e6)}


def table(ph: dict, title: str) -> str:
    """The phases as a table: median / mean us per call, calls with a CPU job and without."""
    def cell(v):
        return f"{np.median(v):7.1f} / {np.mean(v):7.1f}" if len(v) else f"{'-':>17}"

    lines = [f"layer calls, {title}: {ph['layers']} layers x {ph['steps']} steps; {ph['calls']['with job']} with a "
             f"CPU job, {ph['calls']['without']} without (us per call, median / mean; the handshake's stamps)",
             f"{'phase':12} {'with a CPU job':>17} {'without':>17}"]
    for p in GPU_PHASES + CPU_PHASES:
        lines.append(f"{p:12} {cell(ph['with job'].get(p, []))} {cell(ph['without'].get(p, []))}")
    st = ph.get("per step")
    if st and len(st["step"]):
        lines.append(f"per step ({len(st['step'])} steps; ms, median / mean; {np.mean(st['job calls']):.1f} calls "
                     "with a CPU job per step)")
        for p in STEP_PHASES + HOST_PHASES:
            if p not in st:
                continue
            v = st[p]
            lines.append(f"{p:22} {np.median(v):7.3f} / {np.mean(v):7.3f}")
    return "\n".join(lines)
