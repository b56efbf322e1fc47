"""``ftjax.v1.InferenceService`` on grpc.aio: a thin shell over the engine.

The engine owns threads, queues and slots; each RPC here validates and converts the request
(``messages.py``), submits it and relays the engine's stream. Error mapping, the same for every RPC:

| cause | status |
|---|---|
| InvalidRequestError (bad or unknown field; prompt empty or too long; bad sampling value) | INVALID_ARGUMENT, message names the field |
| QueueFullError | RESOURCE_EXHAUSTED |
| the model is still loading, or the engine stopped | UNAVAILABLE |
| the call's deadline passed | DEADLINE_EXCEEDED |
| anything else (a bug) | INTERNAL, logged with its traceback; the server keeps serving |

A stream that ends early for any reason (client cancel, deadline, disconnect, error) cancels its
engine request in ``finally``, so the slot is freed at the engine's next iteration.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time

import grpc

from ftjax import __version__
from ftjax.engine.api import EngineError, InvalidRequestError, QueueFullError, Request
from ftjax.serve import messages
from ftjax.serve.stubs import load

log = logging.getLogger(__name__)

pb, pb_grpc = load()
RESULT_WAIT_S = 10.0  # the result is published with the last event; this only bounds a broken engine


class NotReadyError(EngineError):
    """The model is still loading."""


class DeadlinePassedError(Exception):
    """The engine ended the request because the call's deadline passed."""


_SERVER_COUNTERS = ("rpcs", "streams_open", "invalid_argument", "resource_exhausted", "unavailable", "cancelled",
                    "deadline_exceeded", "internal")


# A call cancelled this close to its deadline was ended by the deadline: the client cancels its call at its
# own deadline, which comes before the server's by the request's transit (the timeout travels as a
# duration). Seen 0.7-1.6 ms early in 2 of 40 calls on a loaded 2-core box (session 23), where the server
# had counted those deadlines as client cancels (`test_deadline_frees_the_slot` failed in CI).
CANCEL_DEADLINE_SLACK_S = 0.1


def _deadline_passed(context, deadline: float | None, slack: float = 0.0) -> bool:
    """Whether the call's deadline has passed (less ``slack`` seconds), by our clock or by gRPC's. gRPC
    cancels the handler at the deadline by its own clock; ours (``deadline``, set from
    ``time_remaining()`` a moment after gRPC read its clock) runs a few microseconds later, so a handler
    cancelled at once could read "not yet". A cancel from the client takes `CANCEL_DEADLINE_SLACK_S`."""
    if deadline is None:
        return False
    remaining = context.time_remaining()
    return time.monotonic() >= deadline - slack or (remaining is not None and remaining <= slack)


def _status_for(e: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, DeadlinePassedError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(e)
    if isinstance(e, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"the request queue is full, retry later ({e})"
    if isinstance(e, EngineError):
        return grpc.StatusCode.UNAVAILABLE, str(e)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"


def _rpc(fn):
    """Count the call and map exceptions to statuses (see the module docstring)."""
    @functools.wraps(fn)
    async def unary(self, request, context):
        self.counters["rpcs"] += 1
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes a status, never a dead server
            await self._abort(context, e, fn.__name__)
    return unary


def _stream_rpc(fn):
    @functools.wraps(fn)
    async def stream(self, request, context):
        self.counters["rpcs"] += 1
        try:
            # aclosing: when gRPC ends the call while this generator waits on a send, the generators below
            # are closed now (their `finally` cancels the engine request, `_relay` counts the end), not
            # whenever the garbage collector finalizes them
            async with contextlib.aclosing(fn(self, request, context)) as items:
                async for item in items:
                    yield item
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001
            await self._abort(context, e, fn.__name__)
    return stream


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, engine):
        self.engine = engine
        self.counters: collections.Counter[str] = collections.Counter()

    # ---- helpers ----
    async def _abort(self, context, e: Exception, rpc: str) -> None:
        code, message = _status_for(e)
        self.counters[code.name.lower()] += 1
        if code is grpc.StatusCode.INTERNAL:
            log.error("%s failed", rpc, exc_info=e)
        else:
            log.info("%s: %s: %s", rpc, code.name, message)
        try:
            await context.abort(code, message)
        except grpc.aio.AbortError:
            raise
        except Exception as err:  # noqa: BLE001 - the call already ended (deadline, cancel): nothing to send
            log.debug("%s: the call had ended before its %s status could be sent (%s)", rpc, code.name, err)

    def _ready_engine(self):
        if not self.engine.ready:
            raise NotReadyError(f"the model is still loading ({self.engine.load_progress:.0%}); "
                                "wait for grpc.health.v1 to report SERVING")
        return self.engine

    async def _relay(self, context, kwargs: dict):
        """Submit one request and yield GenerateResponses until it finishes."""
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            handle = self.engine.submit(Request(deadline_s=deadline, **kwargs))
        except InvalidRequestError as e:
            if e.field in messages.SAMPLING_FIELDS:  # the engine's names -> the request's field path
                raise InvalidRequestError(f"sampling.{e.field}", e.message) from None
            raise
        rid = handle.request_id
        finished = delivered = False  # the engine finished the request / its last response was handed on
        self.counters["streams_open"] += 1
        try:
            async for ev in handle.aiter():
                resp = pb.GenerateResponse(request_id=rid, token_ids=ev.token_ids, text=ev.text)
                if ev.finished:
                    finished = True
                    if ev.finish_reason == "cancelled" and _deadline_passed(context, deadline):
                        raise DeadlinePassedError(f"request {rid}: the deadline passed during generation")
                    result = await asyncio.to_thread(handle.result, RESULT_WAIT_S)
                    resp.finish_reason = messages.finish_reason(pb, ev.finish_reason)
                    resp.usage.CopyFrom(messages.usage(pb, result))
                yield resp
                delivered = finished
        except (asyncio.CancelledError, GeneratorExit):  # cancelled in an await here, or closed at a yield
            if not delivered:
                passed = _deadline_passed(context, deadline, slack=CANCEL_DEADLINE_SLACK_S)
                self.counters["deadline_exceeded" if passed else "cancelled"] += 1
                log.info("request %s: %s", rid, "deadline exceeded" if passed else "cancelled by the client")
            raise
        finally:
            if not finished:
                handle.cancel()
            self.counters["streams_open"] -= 1

    # ---- RPCs ----
    @_stream_rpc
    async def Generate(self, request, context):
        self._ready_engine()
        async with contextlib.aclosing(self._relay(context, messages.generate_inputs(request))) as relay:
            async for resp in relay:
                yield resp

    @_stream_rpc
    async def Chat(self, request, context):
        engine = self._ready_engine()
        async with contextlib.aclosing(self._relay(context, messages.chat_inputs(request, engine.tokenizer))) as relay:
            async for resp in relay:
                yield resp

    @_rpc
    async def Tokenize(self, request, context):
        messages.check_unknown_fields(request)
        tok = self._ready_engine().tokenizer
        if request.text and len(request.messages):
            raise InvalidRequestError("text", "set only one of text and messages")
        text = (messages.render_chat(tok, request, request.add_generation_prompt) if len(request.messages)
                else request.text)
        return pb.TokenizeResponse(token_ids=tok.encode(text), text=text)

    @_rpc
    async def Detokenize(self, request, context):
        messages.check_unknown_fields(request)
        tok = self._ready_engine().tokenizer
        ids = messages.token_ids(request.token_ids, tok.vocab_size)
        return pb.DetokenizeResponse(text=tok.decode(ids, skip_special_tokens=request.skip_special_tokens))

    @_rpc
    async def GetModelInfo(self, request, context):
        messages.check_unknown_fields(request)
        engine = self._ready_engine()
        return messages.model_info_message(pb, engine.model_info(), engine.tokenizer, __version__)

    @_rpc
    async def GetStats(self, request, context):
        messages.check_unknown_fields(request)
        ready = bool(self.engine.ready)
        stats = self.engine.stats() if ready else {}
        server = {k: int(self.counters[k]) for k in _SERVER_COUNTERS}
        return messages.stats_message(pb, stats, ready=ready, load_progress=float(self.engine.load_progress),
                                      server=server)
