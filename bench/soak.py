"""Soak test of ``ftjax serve``: N concurrent streams with random cancels, deadlines, disconnects and
malformed requests for T minutes, loopback only; then checks that nothing leaked.

Starts its own server (``python -m ftjax serve --port 0``, default the embedded demo model) or uses
``--target 127.0.0.1:PORT``. Each of ``--streams`` workers loops until the time is up, picking:

| action | share | expected outcome |
|---|---|---|
| full stream (greedy or sampled, 4..64 tokens) | 55% | completed (or queue full) |
| cancel after 1..8 chunks | 15% | cancelled |
| deadline 0.2..8 s | 15% | completed or DEADLINE_EXCEEDED |
| disconnect (close the channel mid-stream) | 5% | the server cancels |
| malformed (bad field, unknown field, bad role, ...) | 10% | INVALID_ARGUMENT |

Every call has a deadline, so no loop can hang. At the end the server must be idle again: no active
slot, nothing queued, no open stream (and no KV pages in use, when the engine reports pages), the
server process alive and SERVING. Prints a table and writes JSON to bench/out/.

    PYTHONPATH=. python bench/soak.py [--streams 64] [--minutes 10] [--model DIR | --target 127.0.0.1:PORT]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from ftjax.serve.client import Client, chat_request, generate_request, pb, pb_grpc

PROMPTS = ["The lighthouse keeper", "Once upon a time there was a clockmaker on Hollow Street",
           "In the morning the river", "She opened the door and", "The old map showed"]
LOOPBACK = ("127.0.0.1", "localhost", "[::1]")
CALL_LIMIT_S = 300.0  # the deadline of every call without a chosen one
OVERRUN_S = 60.0  # no call runs longer than this past the end of the soak


def _malformed(rng: random.Random):
    """(method, request bytes or message, expected code) of one bad request."""
    cases = [
        ("Generate", generate_request(""), "empty prompt"),
        ("Generate", generate_request("hi", temperature=-1.0), "temperature"),
        ("Generate", generate_request("hi", top_p=0.0), "top_p"),
        ("Generate", generate_request("hi", max_tokens=10**6), "max_tokens"),
        ("Generate", generate_request([10**7]), "prompt_ids"),
        ("Generate", generate_request("hi").SerializeToString() + b"\xf8\x06\x01", "unknown field"),
        ("Chat", chat_request([{"role": "robot", "content": "x"}]), "role"),
        ("Chat", chat_request([]), "no messages"),
    ]
    return cases[rng.randrange(len(cases))]


class Soak:
    def __init__(self, target: str, streams: int, seconds: float, seed: int):
        self.target, self.streams, self.seconds, self.seed = target, streams, seconds, seed
        self.counts = collections.Counter()
        self.ttft_s: list[float] = []
        self.latency_s: list[float] = []
        self.tokens = 0
        self.end = 0.0

    async def _stream(self, stub, rng: random.Random, action: str) -> str:
        """One stream; returns its outcome (a key of ``counts``)."""
        sampling = {"max_tokens": rng.randint(4, 64), "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(2**16)}
        timeout = rng.uniform(0.2, 8.0) if action == "deadline" else CALL_LIMIT_S
        timeout = min(timeout, max(1.0, self.end + OVERRUN_S - time.monotonic()))  # bounded past the end
        stop_after = rng.randint(1, 8) if action in ("cancel", "disconnect") else None
        t0 = time.monotonic()
        call = stub.Generate(generate_request(rng.choice(PROMPTS), **sampling), timeout=timeout)
        n, first = 0, None
        try:
            async for resp in call:
                if first is None:
                    first = time.monotonic() - t0
                n += 1
                self.tokens += len(resp.token_ids)
                if stop_after is not None and n >= stop_after:
                    if action == "cancel":
                        call.cancel()
                    outcome = "cancelled" if action == "cancel" else "disconnected"
                    self.counts[outcome] += 1
                    return outcome  # a disconnect: the caller closes the channel without cancelling
        except asyncio.CancelledError:
            raise
        except grpc.RpcError as e:
            return self._count_error(e)
        self.counts["completed"] += 1  # (a cancel or disconnect that came too late also ends here)
        self.latency_s.append(time.monotonic() - t0)
        if first is not None:
            self.ttft_s.append(first)
        return "completed"

    def _count_error(self, e: grpc.RpcError) -> str:
        code = e.code()
        outcome = {grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded",
                   grpc.StatusCode.RESOURCE_EXHAUSTED: "queue_full",
                   grpc.StatusCode.CANCELLED: "cancelled"}.get(code, "errors")
        self.counts[outcome] += 1
        if outcome == "errors":
            self.counts[f"error_{code.name}"] += 1
            print(f"soak: unexpected {code.name}: {e.details()}", file=sys.stderr)
        return outcome

    async def _malformed_call(self, channel, rng: random.Random) -> str:
        method, req, _what = _malformed(rng)
        payload = req if isinstance(req, bytes) else req.SerializeToString()
        call = channel.unary_stream(f"/ftjax.v1.InferenceService/{method}",
                                    response_deserializer=pb.GenerateResponse.FromString)(payload, timeout=30)
        try:
            async for _ in call:
                pass
            self.counts["errors"] += 1
            print(f"soak: a malformed {method} request was accepted", file=sys.stderr)
            return "errors"
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                return self._count_error(e)
            self.counts["rejected_invalid"] += 1
            return "rejected_invalid"

    async def _worker(self, i: int, channel, end: float) -> None:
        rng = random.Random(self.seed * 1000 + i)
        stub = pb_grpc.InferenceServiceStub(channel)
        while time.monotonic() < end:
            r = rng.random()
            action = ("full" if r < 0.55 else "cancel" if r < 0.70 else "deadline" if r < 0.85
                      else "disconnect" if r < 0.90 else "malformed")
            self.counts["requests"] += 1
            if action == "malformed":
                outcome = await self._malformed_call(channel, rng)
            elif action == "disconnect":  # a channel of its own, closed mid-stream without a cancel
                async with grpc.aio.insecure_channel(self.target) as own:
                    outcome = await self._stream(pb_grpc.InferenceServiceStub(own), rng, action)
            else:
                outcome = await self._stream(stub, rng, action)
            if outcome == "queue_full":  # back off like a real client, with jitter
                await asyncio.sleep(rng.uniform(0.2, 1.0))

    async def run(self) -> None:
        end = self.end = time.monotonic() + self.seconds
        async with grpc.aio.insecure_channel(self.target) as channel:
            workers = [asyncio.ensure_future(self._worker(i, channel, end)) for i in range(self.streams)]
            done, pending = await asyncio.wait(workers, timeout=self.seconds + OVERRUN_S + 60)
            for w in pending:
                w.cancel()
                self.counts["workers_stuck"] += 1
            for w in done:
                if w.exception() is not None:
                    self.counts["errors"] += 1
                    print(f"soak: a worker failed: {w.exception()!r}", file=sys.stderr)


def wait_idle(client: Client, timeout: float = 60.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        s = client.stats()
        if (s["active_slots"] == 0 and s["queued"] == 0 and s["server"]["streams_open"] == 0) or time.monotonic() > end:
            return s
        time.sleep(0.1)


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "ftjax", "serve", "--host", "127.0.0.1", "--port", "0",
           "--max-slots", str(args.max_slots), "--max-queue", str(args.max_queue)]
    if args.model:
        cmd += ["--model", args.model]
    if args.max_len:
        cmd += ["--max-len", str(args.max_len)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: queue.Queue = queue.Queue()

    def drain():  # keeps the pipe from filling up during a long run
        for line in proc.stderr:
            sys.stderr.write(line)
            lines.put(line)

    threading.Thread(target=drain, daemon=True).start()
    end = time.monotonic() + 600
    while time.monotonic() < end and proc.poll() is None:
        try:
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", lines.get(timeout=1.0))
        except queue.Empty:
            continue
        if m:
            return proc, f"127.0.0.1:{m.group(1)}"
    proc.kill()
    raise SystemExit("soak: the server did not start")


def pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams (default 64)")
    ap.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    ap.add_argument("--target", help="an already running server, 127.0.0.1:PORT (default: start one)")
    ap.add_argument("--model", help="FTW store for the server started here (default: the demo model)")
    ap.add_argument("--max-slots", type=int, default=4)
    ap.add_argument("--max-queue", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="output (default bench/out/soak-<time>.json)")
    args = ap.parse_args(argv)
    if args.target and not args.target.startswith(LOOPBACK):
        raise SystemExit(f"soak: --target must be a loopback address ({', '.join(LOOPBACK)}), got {args.target}")
    proc, target = (None, args.target) if args.target else start_server(args)
    try:
        with Client(target, timeout=30) as c:
            c.wait_ready(timeout=600)
            info, before = c.model_info(), c.stats()
        soak = Soak(target, args.streams, args.minutes * 60, args.seed)
        t0 = time.monotonic()
        asyncio.run(soak.run())
        wall = time.monotonic() - t0
        with Client(target, timeout=30) as c:
            after = wait_idle(c)
            health = c.health()
        alive = proc is None or proc.poll() is None
    finally:
        rc = None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    pages = {k: v for k, v in after["memory"].items() if "pages" in k and ("used" in k or "in_use" in k)}
    leaks = {"active_slots": after["active_slots"], "queued": after["queued"],
             "streams_open": after["server"]["streams_open"],
             "slots_missing": info["max_slots"] - after["free_slots"], "pages_in_use": sum(pages.values())}
    delta = {k: after[k] - before[k] for k in ("completed", "cancelled", "errors", "tokens_generated")}
    report = {"target": target, "model": info.get("store_path"), "streams": args.streams, "minutes": args.minutes,
              "wall_s": wall, "client": dict(soak.counts), "engine": delta, "server": after["server"],
              "leaks": leaks, "pages_reported": bool(pages), "health_after": health, "server_alive": alive,
              "server_exit_code": rc, "ttft_s": pct(soak.ttft_s), "latency_s": pct(soak.latency_s),
              "stream_tok_s": soak.tokens / wall if wall else 0.0}
    internal = after["server"]["internal"] - before["server"]["internal"]  # server-side failures (logged there)
    report["server_internal_errors"] = internal
    ok = (all(v == 0 for v in leaks.values()) and alive and health == "SERVING" and internal == 0
          and soak.counts["errors"] == 0 and soak.counts["workers_stuck"] == 0)
    report["ok"] = ok
    print(f"\nsoak: {args.streams} streams for {wall / 60:.1f} min against {target} ({info.get('family')}, "
          f"{info.get('max_slots')} slots)")
    rows = [("requests", soak.counts["requests"]), ("completed", soak.counts["completed"]),
            ("cancelled (client)", soak.counts["cancelled"]), ("disconnected", soak.counts["disconnected"]),
            ("deadline exceeded", soak.counts["deadline_exceeded"]), ("queue full", soak.counts["queue_full"]),
            ("malformed rejected", soak.counts["rejected_invalid"]), ("errors (client seen)", soak.counts["errors"]),
            ("server INTERNAL errors", internal),
            ("engine completed / cancelled / errors", f"{delta['completed']} / {delta['cancelled']} / {delta['errors']}"),
            ("tokens streamed", soak.tokens), ("stream tok/s", f"{report['stream_tok_s']:.1f}"),
            ("TTFT p50 / p90 / p99 (s)", " / ".join(f"{report['ttft_s'][k]:.2f}" for k in ("p50", "p90", "p99"))),
            ("latency p50 / p90 / p99 (s)", " / ".join(f"{report['latency_s'][k]:.2f}" for k in ("p50", "p90", "p99"))),
            ("leaked slots / queued / streams / pages", f"{leaks['active_slots'] + leaks['slots_missing']} / "
             f"{leaks['queued']} / {leaks['streams_open']} / "
             f"{leaks['pages_in_use'] if pages else 'n/a (no paged KV yet)'}"),
            ("server alive, health, exit code", f"{alive}, {health}, {rc}"), ("verdict", "OK" if ok else "FAIL")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    out = args.json or Path("bench/out") / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"soak: wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
