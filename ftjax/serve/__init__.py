"""gRPC serving of ftjax: ``ftjax.v1.InferenceService`` (``protos/ftjax/v1/inference.proto``), health,
reflection, and Python clients.

Names are imported lazily so ``import ftjax.serve`` works without grpc; using them without grpc or
without the generated stubs raises ``ServeUnavailableError`` saying what to install.

- ``Client`` / ``AsyncClient`` (``client.py``): blocking and asyncio clients with streaming.
- ``InferenceServer`` / ``ThreadedServer`` / ``ServerConfig`` (``server.py``): the server.
"""
from __future__ import annotations

import importlib

from ftjax.serve.stubs import SERVICE_NAME, ServeUnavailableError

_LAZY = {"Client": "client", "AsyncClient": "client", "Completion": "client", "Chunk": "client",
         "InferenceServer": "server", "ThreadedServer": "server", "ServerConfig": "server"}

__all__ = ["SERVICE_NAME", "ServeUnavailableError", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        from ftjax.serve.stubs import load

        load()  # a clear ServeUnavailableError before any import of grpc fails
        return getattr(importlib.import_module(f"ftjax.serve.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'ftjax.serve' has no attribute {name!r}")
