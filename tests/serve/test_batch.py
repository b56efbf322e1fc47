"""``ftjax batch``: input checks, resume, torn last lines, and a real run killed and resumed."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from ftjax.batch import BatchError, read_input, run_batch, scan_output
from ftjax.engine import SamplingParams
from fake_engine import make_fake_engine

DEFAULTS = {"temperature": 0.0, "max_tokens": 6}


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _results(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def engine(tokenizer):
    e = make_fake_engine(tokenizer, max_slots=2, max_queue=2)
    yield e
    e.stop()


@pytest.mark.parametrize("row, message", [
    ({"prompt": "x"}, "'id' is required"),
    ({"id": 1}, "exactly one of 'prompt' and 'messages'"),
    ({"id": 1, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "exactly one"),
    ({"id": 1, "prompt": ""}, "'prompt' must be a non-empty string"),
    ({"id": 1, "prompt": "x", "temprature": 0}, "unknown key 'temprature'"),
    ({"id": 1, "prompt": "x", "top_p": 2}, "top_p"),
    ({"id": 1, "messages": []}, "'messages' must be a non-empty list"),
    ({"id": 1, "prompt": "x", "enable_thinking": True}, "need 'messages'"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_input_names_line_and_key(tmp_path, row, message):
    p = _write_jsonl(tmp_path / "in.jsonl", [{"id": 0, "prompt": "fine"}, row])
    with pytest.raises(BatchError, match=f"in.jsonl:2: .*{message}"):
        read_input(p, DEFAULTS)


def test_duplicate_ids_and_bad_json(tmp_path):
    p = _write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    with pytest.raises(BatchError, match="in.jsonl:2: duplicate id 'a' \\(first on line 1\\)"):
        read_input(p, DEFAULTS)
    p.write_text('{"id": 1, "prompt": "x"}\n{"id": 2, \n')
    with pytest.raises(BatchError, match="in.jsonl:2: not valid JSON"):
        read_input(p, DEFAULTS)


def test_run_resume_and_errors(tmp_path, engine):
    rows = [{"id": i, "prompt": f"prompt number {i}"} for i in range(6)]
    rows += [{"id": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
             {"id": "too-long", "prompt": "word " * 300}]
    inp, out = _write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    s = run_batch(engine, inp, out, DEFAULTS, progress=False, token_ids=True)
    assert (s.written, s.resumed, s.errors) == (8, 0, 1)
    res = {r["id"]: r for r in _results(out)}
    assert set(res) == {r["id"] for r in rows}
    assert res["too-long"]["finish_reason"] == "error" and res["too-long"]["error"].startswith("prompt:")
    assert res["chat"]["completion_tokens"] == 3 and res[0]["completion_tokens"] == 6
    ref = engine.generate(["prompt number 0"], SamplingParams(**DEFAULTS))[0]
    assert res[0]["text"] == ref.text and res[0]["token_ids"] == list(ref.token_ids)
    before = out.read_bytes()
    s = run_batch(engine, inp, out, DEFAULTS, progress=False)
    assert (s.written, s.resumed) == (0, 8) and out.read_bytes() == before


def test_torn_last_line_is_redone_and_damage_elsewhere_refused(tmp_path, engine):
    rows = [{"id": i, "prompt": f"prompt {i}"} for i in range(3)]
    inp, out = _write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    run_batch(engine, inp, out, DEFAULTS, progress=False)
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:2]) + lines[2][:15])  # killed in the middle of the third write
    assert len(scan_output(out)) == 2 and out.read_bytes() == b"".join(lines[:2])
    out.write_bytes(b"".join(lines[:2]) + lines[2][:15])
    s = run_batch(engine, inp, out, DEFAULTS, progress=False)
    assert (s.written, s.resumed) == (1, 2)
    assert out.read_bytes().startswith(b"".join(lines[:2])) and len(_results(out)) == 3
    out.write_bytes(lines[0] + b"garbage\n" + lines[1])
    with pytest.raises(BatchError, match="out.jsonl:2: not a result line"):
        run_batch(engine, inp, out, DEFAULTS, progress=False)
    assert out.read_bytes() == lines[0] + b"garbage\n" + lines[1]  # untouched


def test_killed_run_resumes_without_loss(tmp_path, tiny_store, real_server):
    """A real ``ftjax batch`` (1 slot) is SIGKILLed after a few results; the rerun (3 slots) finishes
    the rest; every id appears once, earlier lines are untouched, and the greedy results equal the
    server's (4 slots)."""
    n = 40
    rows = [{"id": f"r{i}", "prompt": f"Story {i}: the lighthouse keeper"} for i in range(n)]
    inp, out = _write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    base = [sys.executable, "-m", "ftjax", "batch", "--model", str(tiny_store), "--input", str(inp), "--output",
            str(out), "--max-tokens", "24", "--max-len", "128", "--prefill-chunk", "32", "--no-progress"]
    proc = subprocess.Popen(base + ["--max-slots", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 120
        while not (out.exists() and out.read_bytes().count(b"\n") >= 3):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < end, "the first run wrote nothing within 120s"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    first = out.read_bytes()
    k = first.count(b"\n")
    assert 3 <= k < n, f"the kill came too late ({k} of {n} results)"
    out.write_bytes(first + b'{"id": "r39", "text": "tor')  # as if killed mid-write
    r = subprocess.run(base + ["--max-slots", "3"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert f"{n - k} new results ({k} already done, {n} in the input)" in r.stderr
    assert out.read_bytes().startswith(first)
    res = _results(out)
    assert sorted(x["id"] for x in res) == sorted(x["id"] for x in rows)
    from ftjax.serve import Client
    with Client(real_server.target, timeout=60) as c:
        for x in (res[0], res[k], res[-1]):
            ref = c.generate(rows[int(x["id"][1:])]["prompt"], temperature=0.0, max_tokens=24)
            assert x["text"] == ref.text and x["finish_reason"] == ref.finish_reason
