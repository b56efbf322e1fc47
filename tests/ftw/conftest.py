"""FTW test fixtures. Until ``ftjax/ftw/hf.py`` exists (or with FTJAX_TEST_STANDIN_HF=1), a test-only
stand-in HFCheckpoint is used."""
from __future__ import annotations

import importlib
import os
import sys

import pytest



def _use_standin() -> bool:
    if os.environ.get("FTJAX_TEST_STANDIN_HF") == "1":  # isolate FTW failures from hf.py ones
        return True
    try:
        importlib.import_module("ftjax.ftw.hf")
        return False
    except ModuleNotFoundError as e:
        if e.name != "ftjax.ftw.hf":
            raise
        return True


USING_STANDIN_HF = _use_standin()
if USING_STANDIN_HF:
    import standin_hf

    sys.modules["ftjax.ftw.hf"] = standin_hf

from tiny_hf import write_tiny_hf  # noqa: E402


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The single-file tiny checkpoint (read-only: tests that damage things work on copies)."""
    return write_tiny_hf(tmp_path_factory.mktemp("hf") / "single", "single")


@pytest.fixture(scope="session")
def tiny_store_bf16(tiny_ckpt, tmp_path_factory):
    from ftjax.ftw import convert

    return convert(tiny_ckpt.path, tmp_path_factory.mktemp("ftw") / "store", dtype="bf16", progress=False)
