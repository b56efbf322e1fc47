"""bench/layer_stamps.py's cut of layer calls, on stamps made up with known phases (the GPU writes real ones:
tests/host/test_cuda.py checks those)."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import layer_stamps  # noqa: E402

OFFSET = 7_000_000  # the host clock ahead of the GPU's, ns


def stamps(layers, steps, job, lat=(1500, 2500)):
    """Stamps of ``steps`` steps over ``layers`` channels, calls ``job[layer][step]`` with a CPU job; every
    phase a fixed length (ns): submit 6 us, GPU work 20 us, a job 50 us after a crossing of lat[0], back after
    lat[1], the y copy 2 us, 30 us to the next layer."""
    gpu = [[] for _ in range(layers)]
    host = [[] for _ in range(layers)]
    t, seq = 1_000_000, [0] * layers
    for s in range(steps):
        for layer in range(layers):
            start = t
            pub = start + 6000
            cstart = pub + 20000
            if job[layer][s]:
                seq[layer] += 1
                seen = pub + lat[0]
                done = seen + 50000
                dseen = max(cstart, done + lat[1])
                host[layer].append((seq[layer], seen + OFFSET, done + OFFSET, 1))
                q = seq[layer]
            else:
                dseen, q = cstart, 0
            end = dseen + 2000
            gpu[layer].append((q, start, pub, q, cstart, dseen, end))
            t = end + 30000
    out = []
    for layer in range(layers):
        g = np.asarray(gpu[layer], np.int64)
        h = np.asarray(host[layer], np.int64).reshape(-1, 4)
        out.append({"gpu": g, "host": h, "submits": len(g), "collects": len(g), "served": len(h)})
    return out


def test_phases_of_made_up_stamps():
    job = [[1, 0, 1, 1], [0, 0, 1, 0], [1, 1, 1, 1]]
    st = stamps(3, 4, job)
    ph = layer_stamps.layer_phases([10, 11, 12], 4, read=lambda ch: st[ch - 10])
    assert ph["calls"] == {"with job": 8, "without": 4}
    w, wo = ph["with job"], ph["without"]
    for phase, us in (("submit", 6), ("gpu work", 20), ("y copy", 2), ("to next", 30), ("cpu job", 50)):
        np.testing.assert_allclose(w[phase], us)
    np.testing.assert_allclose(wo["gpu waits"], 0)
    np.testing.assert_allclose(w["gpu waits"], 1.5 + 50 + 2.5 - 20)
    assert len(w["to next"]) == 4 and len(wo["to next"]) == 4  # the last layer's calls have no next layer
    # the crossings: equal split of the fastest pair (both fixed here: 1.5 + 2.5 = 4 us, 2 us each way)
    np.testing.assert_allclose(np.add(w["to cpu"], w["to gpu"]), 4.0)
    np.testing.assert_allclose(w["to cpu"], 2.0)
    assert "cpu job" in layer_stamps.table(ph, "made up")


def test_last_steps_only_and_mismatch_refused():
    job = [[1, 1, 0, 1]]
    st = stamps(1, 4, job)
    ph = layer_stamps.layer_phases([0], 2, read=lambda ch: st[ch])  # the last two steps: one with a job
    assert ph["calls"] == {"with job": 1, "without": 1}
    with pytest.raises(RuntimeError, match="asked for"):
        layer_stamps.layer_phases([0], 5, read=lambda ch: st[ch])
    bad = dict(st[0], collects=st[0]["collects"] + 1)
    with pytest.raises(RuntimeError, match="fused submit"):
        layer_stamps.layer_phases([0], 2, read=lambda ch: bad)


def test_per_step_phases_add_up_to_the_step():
    job = [[1, 0, 1, 1], [0, 0, 1, 0], [1, 1, 1, 1]]
    st = stamps(3, 4, job)
    ph = layer_stamps.layer_phases([0, 1, 2], 4, read=lambda ch: st[ch])
    ps = ph["per step"]
    assert len(ps["step"]) == 3  # the last step has no next one to end it
    np.testing.assert_allclose(ps["job calls"], [2, 1, 3])
    parts = sum(np.asarray(ps[p]) for p in layer_stamps.STEP_PHASES if p != "step")
    np.testing.assert_allclose(parts, ps["step"])
    np.testing.assert_allclose(ps["step gap"], 0.030)  # the made-up 30 us after the last layer's collect
    np.testing.assert_allclose(ps["submit"], 3 * 0.006)
    # a job call's GPU work is the made-up 20 us, the job's wait shows under "gpu waits"
    np.testing.assert_allclose(ps["gpu work, job calls"], np.asarray([2, 1, 3]) * 0.020)
    np.testing.assert_allclose(ps["gpu waits"], np.asarray([2, 1, 3]) * (54 - 20) / 1e3)
    assert "step gap" in layer_stamps.table(ph, "made up")


def test_host_lead_on_the_coordinators_clock():
    job = [[1, 1, 1, 1], [0, 1, 0, 1]]
    st = stamps(2, 4, job)
    starts = st[0]["gpu"][:, 1]  # layer 0's submit starts, the GPU's clock
    # each step's dispatch ends 5 us before its first submit, after a 100 us call (the host clock: + OFFSET)
    calls = [(int(s) - 105_000 + OFFSET, int(s) - 5_000 + OFFSET) for s in starts]
    ph = layer_stamps.layer_phases([0, 1], 4, read=lambda ch: st[ch], host_calls=calls)
    ps = ph["per step"]
    np.testing.assert_allclose(ps["host call"], 0.1)
    # the gap after the last collect is 30 us: the host ended 25 us late; the offset's estimate is off by half
    # the two crossings' difference (0.5 us)
    np.testing.assert_allclose(ps["host lead"], -0.025, atol=0.001)
    assert "host lead" in layer_stamps.table(ph, "made up")
    with pytest.raises(RuntimeError, match="host calls"):
        layer_stamps.layer_phases([0, 1], 4, read=lambda ch: st[ch], host_calls=calls[1:])
