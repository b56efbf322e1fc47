"""``ftjax serve``: load a store in the background and serve it over gRPC until SIGINT/SIGTERM.

The server listens at once (health NOT_SERVING, ``GetStats`` shows the load progress) and turns
SERVING when the engine is ready. Lines on stderr: ``ftjax: listening on HOST:PORT ...`` (with the
bound port when ``--port 0``), ``ftjax: model ready; health SERVING ...``, ``ftjax: shutting down``.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

log = logging.getLogger(__name__)

DEFAULT_PORT = 50051


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """--max-slots / --max-len / --max-queue / --prefill-chunk / --dtype (``EngineConfig``)."""
    g = p.add_argument_group("engine")
    g.add_argument("--max-slots", type=int, default=4, metavar="N", help="requests decoded together (default 4)")
    g.add_argument("--max-len", type=int, metavar="N",
                   help="context per request, prompt + generated (default: min(4096, the model's))")
    g.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests waiting for a slot; more get RESOURCE_EXHAUSTED (default 64)")
    g.add_argument("--prefill-chunk", type=int, default=256, metavar="N",
                   help="prompt tokens per slot per prefill step (default 256)")
    g.add_argument("--dtype", choices=("bf16", "fp32"), help="weights and KV dtype (default: the store's)")
    from ftjax.cli import add_expert_args  # --policy / --vram-gib, shared with generate and demo

    add_expert_args(p)


def engine_config(args):
    from ftjax.engine import EngineConfig

    return EngineConfig(max_slots=args.max_slots, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                        max_queue=args.max_queue, dtype=args.dtype, policy=args.policy,
                        vram_gib=args.vram_gib, online_split=not args.fixed_split,
                        expert_kernel=args.expert_kernel, background_fills=args.background_fills,
                        unit_split=args.unit_split, down_layout=args.down_layout)


def model_dir(args) -> str:
    """--model, or the embedded demo model (built into the cache on first use)."""
    if args.model:
        return args.model
    from ftjax.demo import ensure_demo_model

    store = ensure_demo_model(getattr(args, "cache_dir", None))
    print(f"ftjax: no --model given; using the demo model {store}", file=sys.stderr)
    return str(store)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over gRPC (ftjax.v1.InferenceService, health, reflection)",
                       description="Serve the FTW store at --model (default: the embedded demo model) over gRPC: "
                       "Generate/Chat (streaming), Tokenize, Detokenize, GetModelInfo, GetStats, grpc.health.v1 "
                       "(NOT_SERVING while loading) and server reflection. Stops on SIGINT/SIGTERM.")
    p.add_argument("--model", metavar="DIR", help="FTW store directory (default: the demo model)")
    p.add_argument("--cache-dir", metavar="DIR", help="demo model cache (default $FTJAX_CACHE or ~/.cache/ftjax)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"TCP port (default {DEFAULT_PORT}; 0 = any free port, printed on stderr)")
    p.add_argument("--grace", type=float, default=5.0, metavar="S",
                   help="on shutdown, seconds running streams may take to finish (default 5)")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> None:
    from ftjax.cli import CLIError
    from ftjax.serve.stubs import ServeUnavailableError, load

    try:
        load()
    except ServeUnavailableError as e:
        raise CLIError(f"cannot serve: {e}") from None
    from ftjax.engine import Engine, EngineError
    from ftjax.serve.server import ServerConfig, serve_until_signal

    server_config = ServerConfig(host=args.host, port=args.port, grace_s=args.grace)
    config = engine_config(args)
    engine = Engine.from_store_async(model_dir(args), config)  # bad stores fail here, before listening
    engine.start()
    try:
        asyncio.run(serve_until_signal(engine, server_config,
                                       on_event=lambda line: print(f"ftjax: {line}", file=sys.stderr, flush=True)))
    except EngineError as e:
        raise CLIError(str(e)) from None
    finally:
        engine.stop()
