"""``ftjax serve`` as a real process on loopback; what it says when the stubs are missing; grpc is
never needed by ``import ftjax``."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

from ftjax.serve import Client

GREEDY = {"temperature": 0.0, "max_tokens": 12}
BLOCK_STUBS = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("ftjax.serve._gen"):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
from ftjax.cli import main
sys.exit(main(["serve", "--model", sys.argv[1]]))
"""


def _lines(stream) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [q.put(line) for line in stream], daemon=True).start()
    return q


def _wait_for(q: queue.Queue, pattern: str, timeout: float, seen: list[str]) -> re.Match:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            line = q.get(timeout=max(0.01, end - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r} within {timeout}s; got:\n{''.join(seen)}")


def test_ftjax_serve_process(tiny_store, real_server):
    cmd = [sys.executable, "-m", "ftjax", "serve", "--model", str(tiny_store), "--host", "127.0.0.1", "--port", "0",
           "--max-slots", "2", "--max-len", "128", "--prefill-chunk", "32"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen: list[str] = []
    try:
        lines = _lines(proc.stderr)
        port = int(_wait_for(lines, r"listening on 127\.0\.0\.1:(\d+)", 60, seen).group(1))
        with Client(f"127.0.0.1:{port}", timeout=60) as c:
            c.wait_ready(timeout=240)
            got = c.generate("The lighthouse keeper", **GREEDY)
        with Client(real_server.target, timeout=60) as c:  # 4 slots in-process vs 2 slots here
            assert got.token_ids == c.generate("The lighthouse keeper", **GREEDY).token_ids
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        _wait_for(lines, r"shutting down", 5, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_without_stubs_says_what_is_missing(tiny_store):
    r = subprocess.run([sys.executable, "-c", BLOCK_STUBS, str(tiny_store)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stderr
    assert "ftjax: error: cannot serve" in r.stderr and "grpcio-tools" in r.stderr


def test_import_ftjax_needs_no_grpc():
    code = "import sys, ftjax, ftjax.serve, ftjax.batch, ftjax.cli; ftjax.cli.build_parser(); " \
           "assert not any(m == 'grpc' or m.startswith('grpc.') for m in sys.modules), 'grpc imported'"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env)
