"""CPU time of this process's threads over a stretch of work, by thread group (Linux ``/proc/self/task``).

Which threads burn the host's CPUs while a decode step runs: the worker pool ("ftjax-w<i>"), the CPU branch's
coordinator ("ftjax-coord"), the Python thread that dispatches the steps (the main thread), XLA's and the CUDA
driver's threads (their own names). A thread's time is ``schedstat``'s first field (ns on a CPU) where the
kernel has it, else ``stat``'s utime + stime (clock ticks, 10 ms apart at 100 Hz).

    before = snapshot(); ...work...; groups = cpu_by_group(before, snapshot())
"""
from __future__ import annotations

import os
import re
from pathlib import Path

TASKS = Path("/proc/self/task")


def _thread_ns(task: Path) -> int | None:
    """ns on a CPU so far, or None when the thread is gone."""
    try:
        return int((task / "schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    try:
        stat = (task / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the name may hold spaces and parentheses: cut after the last ')'
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def snapshot(tasks: Path = TASKS) -> dict[int, tuple[str, int]]:
    """{tid: (name, ns on a CPU)} of the threads alive now."""
    out = {}
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        ns = _thread_ns(task)
        if ns is not None:
            out[int(task.name)] = (name, ns)
    return out


def group_of(tid: int, name: str, main_tid: int) -> str:
    """The main thread; our workers and coordinator; anything else by its name less trailing numbers."""
    if tid == main_tid:
        return "main"
    if name.startswith("ftjax-w"):
        return "ftjax workers"
    return re.sub(r"[-_:#/ ]*\d+$", "", name) or name


def cpu_by_group(before: dict, after: dict, main_tid: int | None = None) -> dict[str, dict]:
    """{group: {"ms": CPU ms in between, "threads": threads that ran}}, busiest first. A thread born in between
    counts from zero; one that ended in between is lost (its time is not in ``after``)."""
    main_tid = os.getpid() if main_tid is None else main_tid
    groups: dict[str, dict] = {}
    for tid, (name, ns) in after.items():
        delta = ns - before.get(tid, (name, 0))[1]
        if delta <= 0:
            continue
        g = groups.setdefault(group_of(tid, name, main_tid), {"ms": 0.0, "threads": 0})
        g["ms"] += delta / 1e6
        g["threads"] += 1
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]["ms"]))


def summary(groups: dict[str, dict], busy_cpus: float, top: int = 6) -> str:
    """One line: busy CPUs (CPU time over wall time), then the busiest groups' CPU ms (e.g. per step) and,
    where more than one, their threads."""
    parts = [f"{name} {g['ms']:.2f}" + (f" ({g['threads']})" if g["threads"] > 1 else "")
             for name, g in list(groups.items())[:top]]
    return f"busy CPUs {busy_cpus:.2f}; CPU ms per step: " + ", ".join(parts)
