"""``ftjax batch``: offline evaluation of a JSONL file of prompts, resumable.

Input, one JSON object per line (blank lines are skipped)::

    {"id": "q1", "prompt": "Once upon a time"}
    {"id": 2, "messages": [{"role": "user", "content": "Hi"}], "enable_thinking": false}

``id`` (string or integer, unique) and exactly one of ``prompt`` / ``messages`` are required;
``tools`` (a list) and ``enable_thinking`` go to the chat template; ``temperature``, ``top_k``,
``top_p``, ``seed``, ``max_tokens``, ``stop`` (string or list), ``stop_token_ids`` override the
command-line sampling defaults for that line. Any other key is an error. The whole input is checked
before the model loads.

Output, one line per finished request, in completion order::

    {"id": "q1", "text": "...", "finish_reason": "length", "prompt_tokens": 5, "completion_tokens": 64,
     "ttft_s": 0.12, "decode_tok_s": 41.0}                    (+ "token_ids" with --token-ids)
    {"id": 2, "error": "prompt: the prompt has 5000 tokens, ...", "finish_reason": "error"}

Each line is written with one ``write``, flushed and fsynced before the next, so a killed run loses
at most the requests in flight. Rerunning with the same ``--output`` skips the ids already there
(errors included; delete their lines to retry). A torn last line left by a kill is cut off and its
request run again; a damaged line anywhere else stops the run without touching the file.
"""
from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop", "stop_token_ids")
CHAT_KEYS = ("messages", "tools", "enable_thinking")
INPUT_KEYS = frozenset(("id", "prompt") + CHAT_KEYS + SAMPLING_KEYS)


class BatchError(ValueError):
    """Bad input or output file: the message names the file, the line and the problem."""


@dataclasses.dataclass(frozen=True)
class Item:
    id: str | int
    line: int
    prompt: str | None
    messages: list | None
    chat: dict[str, Any]
    sampling: dict[str, Any]


@dataclasses.dataclass
class Summary:
    total: int = 0
    resumed: int = 0
    written: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    finish: Counter = dataclasses.field(default_factory=Counter)

    def line(self) -> str:
        tok_s = self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0
        req_s = self.written / self.wall_s if self.wall_s > 0 else 0.0
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.finish.items())) or "-"
        return (f"{self.written} new results ({self.resumed} already done, {self.total} in the input) in "
                f"{self.wall_s:.1f}s | prompt tokens {self.prompt_tokens} | generated tokens "
                f"{self.completion_tokens} | {tok_s:.1f} tok/s | {req_s:.2f} req/s | finish: {reasons} | "
                f"errors {self.errors}")


# ---------------------------------------------------------------------------------------- input
def _check_item(obj: Any, where: str) -> Item:
    if not isinstance(obj, dict):
        raise BatchError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - INPUT_KEYS)
    if unknown:
        raise BatchError(f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(sorted(INPUT_KEYS))}")
    rid = obj.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise BatchError(f"{where}: 'id' is required and must be a non-empty string or an integer, got {rid!r}")
    if ("prompt" in obj) == ("messages" in obj):
        raise BatchError(f"{where}: give exactly one of 'prompt' and 'messages'")
    if "prompt" in obj and (not isinstance(obj["prompt"], str) or not obj["prompt"]):
        raise BatchError(f"{where}: 'prompt' must be a non-empty string")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise BatchError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    elif "tools" in obj or "enable_thinking" in obj:
        raise BatchError(f"{where}: 'tools' and 'enable_thinking' need 'messages'")
    if "tools" in obj and not isinstance(obj["tools"], list):
        raise BatchError(f"{where}: 'tools' must be a list")
    if "enable_thinking" in obj and not isinstance(obj["enable_thinking"], bool):
        raise BatchError(f"{where}: 'enable_thinking' must be true or false")
    return Item(rid, 0, obj.get("prompt"), obj.get("messages"),
                {k: obj[k] for k in ("tools", "enable_thinking") if k in obj},
                {k: obj[k] for k in SAMPLING_KEYS if k in obj})


def read_input(path: Path, defaults: dict[str, Any]) -> list[Item]:
    """Every item of the input; BatchError naming ``file:line`` for the first bad one."""
    from ftjax.engine.sampling import SamplingParams

    items, seen = [], {}
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise BatchError(f"{where}: not valid JSON ({e})") from None
            item = dataclasses.replace(_check_item(obj, where), line=n)
            key = _id_key(item.id)
            if key in seen:
                raise BatchError(f"{where}: duplicate id {item.id!r} (first on line {seen[key]})")
            seen[key] = n
            try:
                SamplingParams(**{**defaults, **item.sampling})
            except (TypeError, ValueError) as e:
                raise BatchError(f"{where}: {e}") from None
            items.append(item)
    if not items:
        raise BatchError(f"{path}: no prompts (the file is empty)")
    return items


def _id_key(rid: str | int) -> str:
    return json.dumps(rid)  # 1 and "1" are different ids


# --------------------------------------------------------------------------------------- output
def scan_output(path: Path) -> set[str]:
    """Ids already written to ``path``. A torn last line (a killed run) is cut off the file; any
    other damaged line raises BatchError and the file is left as it is."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    done: set[str] = set()
    pos, lines = 0, data.split(b"\n")
    for i, raw in enumerate(lines):
        last = i == len(lines) - 1  # no newline after it: "" for a clean file, else a torn write
        try:
            obj = json.loads(raw) if raw.strip() else None
            if obj is not None and (not isinstance(obj, dict) or "id" not in obj):
                raise ValueError("not a result object")
        except ValueError as e:
            if last or (i == len(lines) - 2 and not lines[-1]):
                log.warning("%s: dropping a torn last line (%d bytes) from an interrupted run; its request "
                            "runs again", path, len(raw))
                with open(path, "r+b") as f:
                    f.truncate(pos)
                    f.flush()
                    os.fsync(f.fileno())
                return done
            raise BatchError(f"{path}:{i + 1}: not a result line ({e}); refusing to resume into a damaged "
                             "file (fix or remove that line)") from None
        if obj is not None:
            if last:  # complete JSON missing only its newline
                with open(path, "ab") as f:
                    f.write(b"\n")
            done.add(_id_key(obj["id"]))
        pos += len(raw) + 1
    return done


class ResultWriter:
    """Appends one JSON line per result: one write, flush, fsync. Holds an exclusive lock on the file
    so two runs cannot interleave their lines."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "ab")
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.close()
            raise BatchError(f"{path} is being written by another ftjax batch run") from None

    def write(self, record: dict[str, Any]) -> None:
        self._f.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


# ------------------------------------------------------------------------------------------ run
def _request(engine, item: Item, defaults: dict[str, Any]):
    from ftjax.engine import InvalidRequestError, Request, SamplingParams

    sp = SamplingParams(**{**defaults, **item.sampling})
    prompt = item.prompt
    if item.messages is not None:
        try:
            prompt = engine.tokenizer.apply_chat_template(item.messages, add_generation_prompt=True, **item.chat)
        except (ValueError, TypeError, KeyError) as e:
            raise InvalidRequestError("messages", f"the chat template cannot render them: {e}") from None
    return Request(prompt=prompt, sampling=sp, request_id=f"batch-{item.line}")


async def _finish(handle):
    async for _ in handle.aiter():
        pass
    return await asyncio.to_thread(handle.result, 10.0)


async def _run(engine, todo: list[Item], defaults, writer: ResultWriter, summary: Summary, bar,
               token_ids: bool) -> None:
    from ftjax.engine import InvalidRequestError, QueueFullError

    window = engine.config.max_slots + min(engine.config.max_queue, engine.config.max_slots)
    pending, inflight = list(reversed(todo)), {}
    try:
        while pending or inflight:
            while pending and len(inflight) < window:
                item = pending.pop()
                try:
                    handle = engine.submit(_request(engine, item, defaults))
                except InvalidRequestError as e:
                    writer.write({"id": item.id, "error": str(e), "finish_reason": "error"})
                    summary.written += 1
                    summary.errors += 1
                    summary.finish["error"] += 1
                    bar.update(1)
                    continue
                except QueueFullError:
                    pending.append(item)
                    break
                inflight[asyncio.ensure_future(_finish(handle))] = (item, handle)
            if not inflight:
                continue
            done, _ = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                item, _ = inflight.pop(task)
                r = task.result()
                rec = {"id": item.id, "text": r.text, "finish_reason": r.finish_reason,
                       "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                       "ttft_s": round(r.ttft_s, 4), "decode_tok_s": round(r.decode_tok_s, 2)}
                if token_ids:
                    rec["token_ids"] = list(r.token_ids)
                writer.write(rec)
                summary.written += 1
                summary.prompt_tokens += r.prompt_tokens
                summary.completion_tokens += r.completion_tokens
                summary.finish[r.finish_reason] += 1
                summary.errors += r.finish_reason == "error"
                bar.update(1)
    finally:
        for task, (_, handle) in inflight.items():
            handle.cancel()
            task.cancel()


def run_batch(engine, input_path: str | Path, output_path: str | Path, defaults: dict[str, Any] | None = None, *,
              progress: bool = True, token_ids: bool = False) -> Summary:
    """Run every input item not yet in the output through ``engine`` (started); returns the summary."""
    from tqdm import tqdm

    defaults = dict(defaults or {})
    items = read_input(Path(input_path), defaults)
    out = Path(output_path)
    writer = ResultWriter(out)  # lock before reading, so a concurrent run cannot change it under us
    try:
        done = scan_output(out)
        todo = [it for it in items if _id_key(it.id) not in done]
        summary = Summary(total=len(items), resumed=len(items) - len(todo))
        if summary.resumed:
            log.info("resuming: %d of %d ids already in %s", summary.resumed, len(items), out)
        t0 = time.perf_counter()
        with tqdm(total=len(items), initial=summary.resumed, unit="req", disable=not progress, file=sys.stderr,
                  desc="batch", dynamic_ncols=True) as bar:
            asyncio.run(_run(engine, todo, defaults, writer, summary, bar, token_ids))
        summary.wall_s = time.perf_counter() - t0
    finally:
        writer.close()
    return summary


# ------------------------------------------------------------------------------------------ CLI
def add_parser(sub) -> None:
    from ftjax.serve.command import add_engine_args

    p = sub.add_parser("batch", help="generate for every line of a JSONL file (resumable)",
                       description="Run every prompt of --input (JSONL: {\"id\", \"prompt\"} or {\"id\", "
                       "\"messages\"} plus optional sampling keys) and append one result line per prompt to "
                       "--output, with a progress bar and a throughput summary. Rerunning skips the ids "
                       "already in --output; a torn last line from a killed run is redone.")
    p.add_argument("--model", metavar="DIR", help="FTW store directory (default: the demo model)")
    p.add_argument("--cache-dir", metavar="DIR", help="demo model cache (default $FTJAX_CACHE or ~/.cache/ftjax)")
    p.add_argument("--input", required=True, metavar="FILE", help="prompts, JSON lines")
    p.add_argument("--output", required=True, metavar="FILE", help="results, JSON lines (appended)")
    p.add_argument("--token-ids", action="store_true", help="also write the generated token ids")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("sampling defaults (a line's own keys win)")
    g.add_argument("--max-tokens", type=int, default=128, metavar="N", help="default 128")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="default 0 (greedy)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="default 0 (off)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="default 1 (off)")
    g.add_argument("--seed", type=int, default=0, help="default 0")
    add_engine_args(p)
    p.set_defaults(func=cmd_batch)


def cmd_batch(args) -> None:
    from ftjax.engine import Engine
    from ftjax.serve.command import engine_config, model_dir

    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
                "top_p": args.top_p, "seed": args.seed}
    read_input(Path(args.input), defaults)  # bad input fails before the model loads
    config = engine_config(args)
    engine = Engine.from_store(model_dir(args), config)
    with engine:
        summary = run_batch(engine, args.input, args.output, defaults, progress=not args.no_progress,
                            token_ids=args.token_ids)
    print(f"ftjax: batch: {summary.line()}", file=sys.stderr)
    print(f"ftjax: results in {args.output}", file=sys.stderr)
