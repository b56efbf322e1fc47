"""Fixtures of the engine tests: the tiny demo store, loaded once per session, and its tokenizer."""
import pytest

from ftjax.demo import DemoSpec, ensure_demo_model
from ftjax.ftw import load_store
from ftjax.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("engine-cache"), spec=DemoSpec.tiny(), progress=False)


@pytest.fixture(scope="session")
def tiny_model(tiny_store):
    return load_store(tiny_store)


@pytest.fixture(scope="session")
def tokenizer(tiny_store):
    return Tokenizer.from_dir(tiny_store)
