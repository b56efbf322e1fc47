"""bench/thread_cpu.py: per-thread CPU time by group, and the names the runtime gives its threads."""
import ctypes
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import thread_cpu  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")


def _name_this_thread(name: bytes) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME


def test_busy_thread_counted_in_its_group():
    """A thread named as a pool worker that spins ~0.3 s shows ~300 ms in "ftjax workers"; a sleeping one
    named otherwise adds next to nothing; the main thread is "main"."""
    started, spun, stop = threading.Barrier(3), threading.Event(), threading.Event()

    def spin():  # stays alive until the second snapshot: a thread's time leaves /proc with it
        _name_this_thread(b"ftjax-w7")
        started.wait()
        t = time.thread_time()
        while time.thread_time() - t < 0.3:
            pass
        spun.set()
        stop.wait()

    def idle():
        _name_this_thread(b"idle-thread-12")
        started.wait()
        stop.wait()

    threads = [threading.Thread(target=spin), threading.Thread(target=idle)]
    for t in threads:
        t.start()
    before = thread_cpu.snapshot()
    started.wait()
    x = sum(i * i for i in range(200_000))  # the main thread runs too
    assert spun.wait(30)
    groups = thread_cpu.cpu_by_group(before, thread_cpu.snapshot())
    stop.set()
    for t in threads:
        t.join()
    assert x > 0
    assert 250 <= groups["ftjax workers"]["ms"] <= 600 and groups["ftjax workers"]["threads"] == 1, groups
    assert groups.get("idle-thread", {"ms": 0.0})["ms"] < 50, groups
    assert "main" in groups and list(groups) == sorted(groups, key=lambda k: -groups[k]["ms"])
    line = thread_cpu.summary({k: dict(g, ms=g["ms"] / 10) for k, g in groups.items()}, 1.0)
    assert line.startswith("busy CPUs 1.00; CPU ms per step: ") and "ftjax workers " in line


def test_stat_fallback_and_odd_names(tmp_path):
    """Without schedstat the time comes from stat's utime + stime (ticks), cut after the name's last ')'."""
    import os

    hz = os.sysconf("SC_CLK_TCK")
    task = tmp_path / "4242"
    task.mkdir()
    (task / "comm").write_text("odd ) name 3\n")
    rest = ["S"] + ["0"] * 10 + [str(3 * hz), str(hz)] + ["0"] * 30  # utime 3 s, stime 1 s
    (task / "stat").write_text("4242 (odd ) name 3) " + " ".join(rest) + "\n")
    gone = tmp_path / "4243"
    gone.mkdir()  # no comm: a thread that ended while being read is left out
    snap = thread_cpu.snapshot(tmp_path)
    assert snap == {4242: ("odd ) name 3", 4_000_000_000)}
    groups = thread_cpu.cpu_by_group({}, snap, main_tid=1)
    assert groups == {"odd ) name": {"ms": 4000.0, "threads": 1}}


def test_runtime_threads_are_named():
    """The worker pool's threads are named ftjax-w<i> (so the decode benchmark can tell them apart)."""
    from ftjax.host import _host

    info = _host.worker_info()
    _host.configure_workers(2, 20, False)  # a pool of its own size, whatever the host's default
    try:
        names = sorted(name for name, _ in thread_cpu.snapshot().values() if name.startswith("ftjax-w"))
        assert names == ["ftjax-w0", "ftjax-w1"], names
    finally:
        _host.configure_workers(info["n_workers"], info["spin_us"], info["pin"])
