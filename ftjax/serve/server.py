"""The gRPC server: ``ftjax.v1.InferenceService`` + ``grpc.health.v1`` + server reflection on grpc.aio.

Health is NOT_SERVING (for the whole server, ``""``, and for ``ftjax.v1.InferenceService``) until the
engine reports ``ready``, then SERVING; it turns NOT_SERVING again on shutdown. Reflection lists the
inference, health and reflection services (``grpcurl -plaintext 127.0.0.1:PORT list``).

``InferenceServer`` runs on the caller's event loop; ``ThreadedServer`` runs one on its own loop in a
daemon thread (tests, benchmarks, notebooks); ``serve_until_signal`` is ``ftjax serve``'s main loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import threading
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ftjax.engine.api import EngineError
from ftjax.serve.servicer import InferenceServicer, pb, pb_grpc
from ftjax.serve.stubs import SERVICE_NAME

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Where and how the server listens.

    host: address to bind (default loopback only). port: TCP port; 0 = any free port (see ``port``
    after ``start``). grace_s: on shutdown, how long running streams may finish. poll_s: how often
    the load progress is checked. max_message_bytes: largest request or response.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    grace_s: float = 5.0
    poll_s: float = 0.1
    max_message_bytes: int = 16 * 2**20

    def __post_init__(self):
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host={self.host!r} is not valid; give an address such as 127.0.0.1")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port!r} is out of range; port must be in [0, 65535] (0 = any free port)")
        for name in ("grace_s", "poll_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes={self.max_message_bytes} must be >= 1024")


class InferenceServer:
    def __init__(self, engine, config: ServerConfig | None = None):
        self.engine = engine
        self.config = config or ServerConfig()
        self.port: int | None = None
        self.servicer = InferenceServicer(engine)
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._watcher: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind and start serving (NOT_SERVING until the engine is ready); returns the bound port."""
        c = self.config
        opts = [("grpc.so_reuseport", 0),  # a port in use is an error, not a silently shared port
                ("grpc.max_receive_message_length", c.max_message_bytes),
                ("grpc.max_send_message_length", c.max_message_bytes)]
        server = grpc.aio.server(options=opts)
        pb_grpc.add_InferenceServiceServicer_to_server(self.servicer, server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, NOT_SERVING)
        reflection.enable_server_reflection(
            [pb.DESCRIPTOR.services_by_name["InferenceService"].full_name, health.SERVICE_NAME,
             reflection.SERVICE_NAME], server)
        address = f"{c.host}:{c.port}"
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {address}: {e} (is the port in use?)") from None
        if port == 0:
            raise OSError(f"cannot listen on {address} (is the port in use?)")
        await server.start()
        self._server, self.port = server, port
        self._watcher = asyncio.create_task(self._watch_load(), name="ftjax-load-watch")
        log.info("listening on %s:%d", c.host, port)
        return port

    async def _watch_load(self) -> None:
        while not self.engine.ready:
            error = getattr(self.engine, "load_error", None)
            if error is not None:
                raise EngineError(f"the model failed to load: {type(error).__name__}: {error}")
            await asyncio.sleep(self.config.poll_s)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, SERVING)
        log.info("model ready: health SERVING")

    async def wait_ready(self) -> None:
        """Return once health is SERVING; EngineError if the model failed to load."""
        if self._watcher is None:
            raise RuntimeError("start() the server first")
        await asyncio.shield(self._watcher)

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, then stop; streams still running after ``grace_s`` are cancelled."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()
        await self._server.stop(self.config.grace_s if grace_s is None else grace_s)
        self._server = None
        log.info("server stopped")


class ThreadedServer:
    """An InferenceServer on its own event loop in a daemon thread; ``with ThreadedServer(engine) as s:``."""

    def __init__(self, engine, config: ServerConfig | None = None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ftjax-grpc", daemon=True)
        self._thread.start()
        self.server = InferenceServer(engine, config or ServerConfig(port=0))
        try:
            self.port = self._call(self.server.start(), 30.0)
        except BaseException:
            self._shutdown_loop()
            raise
        self.target = f"{self.server.config.host}:{self.port}"

    def _call(self, coro, timeout: float | None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def servicer(self) -> InferenceServicer:
        return self.server.servicer

    def wait_ready(self, timeout: float | None = None) -> None:
        self._call(self.server.wait_ready(), timeout)

    def stop(self, grace_s: float = 1.0) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self.server.stop(grace_s), grace_s + 10.0)
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> "ThreadedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


async def serve_until_signal(engine, config: ServerConfig, on_event: Callable[[str], None] = print) -> None:
    """Serve until SIGINT/SIGTERM; ``on_event`` gets one line when listening and one when ready.
    Raises EngineError if the model fails to load (after stopping the server)."""
    server = InferenceServer(engine, config)
    port = await server.start()
    on_event(f"listening on {config.host}:{port} (health NOT_SERVING while the model loads)")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    ready = asyncio.ensure_future(server.wait_ready())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            ready.result()  # raises if the load failed
            on_event(f"model ready; health SERVING on {config.host}:{port}")
            await stopping
        on_event("shutting down")
    finally:
        for task in (ready, stopping):
            task.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await server.stop()
