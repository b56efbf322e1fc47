"""Fixtures of the serving tests: the tiny demo store, a fast server (the real Engine over the
FakeAccelerator), and one real-model server shared by the session (loading observed from the start).

Everything listens on 127.0.0.1 with an ephemeral port.
"""
from __future__ import annotations

import pytest

from ftjax.demo import DemoSpec, ensure_demo_model
from ftjax.tokenizer import Tokenizer

from fake_engine import make_fake_engine
from serve_helpers import REAL_MAX_LEN, REAL_SLOTS, STUBS_ERROR

if STUBS_ERROR is not None:
    collect_ignore_glob = ["test_serve_*.py"]  # they need a server; test_grpc_stubs.py reports the skip


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("serve-demo"), spec=DemoSpec.tiny(), progress=False)


@pytest.fixture(scope="session")
def tokenizer(tiny_store):
    return Tokenizer.from_dir(tiny_store)


def _need_stubs() -> None:
    if STUBS_ERROR:
        pytest.skip(f"gRPC stubs not built: {STUBS_ERROR}")


@pytest.fixture(scope="module")
def fake_server(tokenizer):
    """A server over a fake-accelerator engine: 2 slots, queue of 2, 20 ms per step."""
    _need_stubs()
    from ftjax.serve import ThreadedServer

    engine = make_fake_engine(tokenizer, max_slots=2, max_queue=2, step_delay_s=0.02)
    with ThreadedServer(engine) as server:
        server.wait_ready(10)
        server.engine = engine
        yield server
    engine.stop()


@pytest.fixture
def client(fake_server):
    from ftjax.serve import Client

    with Client(fake_server.target, timeout=30) as c:
        yield c


@pytest.fixture(scope="session")
def real_server(tiny_store):
    """The tiny demo model behind a real server, started while the model still loads; ``early``
    holds what the server said before the model was ready."""
    _need_stubs()
    import grpc

    from ftjax.engine import Engine, EngineConfig
    from ftjax.serve import Client, ThreadedServer

    engine = Engine.from_store_async(tiny_store, EngineConfig(max_slots=REAL_SLOTS, max_len=REAL_MAX_LEN,
                                                              prefill_chunk=32))
    engine.start()
    server = ThreadedServer(engine)
    early = {}
    with Client(server.target, timeout=10) as c:
        early["health"] = c.health()
        early["stats"] = c.stats()
        try:
            c.generate("The lighthouse", max_tokens=2)
        except grpc.RpcError as e:
            early["generate"] = (e.code(), e.details())
    server.wait_ready(300)
    server.engine, server.early = engine, early
    yield server
    server.stop()
    engine.stop()
