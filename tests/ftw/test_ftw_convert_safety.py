"""convert never leaves a half-written store and never silently replaces one."""
from __future__ import annotations

import importlib

import pytest

from ftjax.ftw import convert, load_store


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_refuses_to_overwrite_non_empty_dir(tiny_ckpt, tmp_path):
    out = tmp_path / "store"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"store exists and is not empty; pass overwrite=True"):
        convert(tiny_ckpt.path, out, progress=False)
    assert (out / "precious.txt").read_text() == "keep me"


def test_empty_dir_is_fine_and_overwrite_replaces(tiny_ckpt, tmp_path):
    out = tmp_path / "store"
    out.mkdir()
    convert(tiny_ckpt.path, out, dtype="fp32", progress=False)
    convert(tiny_ckpt.path, out, dtype="bf16", progress=False, overwrite=True)
    assert load_store(out, device=False).experts["down"].dtype.name == "bfloat16"
    assert _leftovers(tmp_path) == []


def test_unknown_dtype(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"dtype 'int8' unknown; valid: 'bf16', 'fp32' or None"):
        convert(tiny_ckpt.path, tmp_path / "s", dtype="int8", progress=False)
    assert not (tmp_path / "s").exists()


def _fail_at_expert(monkeypatch, n_ok, exc):
    cls = importlib.import_module("ftjax.ftw.hf").HFCheckpoint
    real = cls.expert
    calls = []

    def expert(self, layer, e):
        calls.append((layer, e))
        if len(calls) > n_ok:
            raise exc
        return real(self, layer, e)

    monkeypatch.setattr(cls, "expert", expert)
    return calls


@pytest.mark.parametrize("exc", [RuntimeError("injected read failure"), KeyboardInterrupt()])
def test_failure_mid_convert_leaves_nothing(tiny_ckpt, tmp_path, monkeypatch, exc):
    calls = _fail_at_expert(monkeypatch, 5, exc)
    with pytest.raises(type(exc)):
        convert(tiny_ckpt.path, tmp_path / "store", progress=False)
    assert len(calls) == 6  # failed in the middle of the expert stream
    assert not (tmp_path / "store").exists()
    assert _leftovers(tmp_path) == []


def test_failed_overwrite_keeps_the_old_store(tiny_ckpt, tmp_path, monkeypatch):
    out = convert(tiny_ckpt.path, tmp_path / "store", dtype="fp32", progress=False)
    _fail_at_expert(monkeypatch, 3, RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        convert(tiny_ckpt.path, out, dtype="bf16", progress=False, overwrite=True)
    assert load_store(out, device=False, verify="full").experts["down"].dtype.name == "float32"
    assert _leftovers(tmp_path) == []
