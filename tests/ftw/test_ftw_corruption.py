"""Every kind of damage raises StoreError naming the file, the tensor and, for banks, the expert."""
from __future__ import annotations

import json
import re
import shutil

import pytest

from ftjax.ftw import StoreError, load_store, verify_store

BANK_CHUNK = "experts/gate_up/c/5/0/0"  # flat id 5 = layer 1, expert 1 (E = 4)
DENSE_CHUNK = "params/layers.1.attn.q_proj/c/0/0"


@pytest.fixture
def store(tiny_store_bf16, tmp_path):
    """A private copy of the tiny store to damage."""
    return shutil.copytree(tiny_store_bf16, tmp_path / "store")


def _manifest(store):
    return json.loads((store / "ftw.json").read_text())


def _edit_manifest(store, edit):
    man = _manifest(store)
    edit(man)
    (store / "ftw.json").write_text(json.dumps(man))


def _flip_bit(path, byte=17):
    data = bytearray(path.read_bytes())
    data[byte] ^= 0x04
    path.write_bytes(bytes(data))


def _truncate(path, keep=100):
    path.write_bytes(path.read_bytes()[:keep])


def _raises(fn, *patterns):
    with pytest.raises(StoreError) as info:
        fn()
    for p in patterns:
        assert re.search(p, str(info.value)), f"{p!r} not in: {info.value}"
    return str(info.value)


def test_truncated_bank_chunk(store):
    _truncate(store / BANK_CHUNK)
    for fn in (lambda: load_store(store), lambda: verify_store(store)):
        _raises(fn, re.escape(str(store / BANK_CHUNK)), "expert bank 'gate_up'", "expert flat id 5",
                r"layer 1, expert 1", "100 bytes, expected 2048", "truncated")


def test_deleted_bank_chunk(store):
    (store / BANK_CHUNK).unlink()
    _raises(lambda: load_store(store), re.escape(str(store / BANK_CHUNK)), "chunk file missing",
            "expert bank 'gate_up'", "expert flat id 5")


def test_bit_flipped_bank_chunk(store):
    _flip_bit(store / BANK_CHUNK)
    load_store(store, device=False)  # the default load only size-checks banks
    for fn in (lambda: verify_store(store), lambda: load_store(store, verify="full")):
        _raises(fn, re.escape(str(store / BANK_CHUNK)), "checksum mismatch", "expert bank 'gate_up'",
                "expert flat id 5")


def test_verify_store_names_every_corrupt_chunk(store):
    _flip_bit(store / BANK_CHUNK)
    _flip_bit(store / "experts/down/c/2/0/0")
    _flip_bit(store / DENSE_CHUNK)
    msg = _raises(lambda: verify_store(store), "3 corrupt", "expert bank 'down', expert flat id 2",
                  "expert bank 'gate_up', expert flat id 5", "tensor 'layers.1.attn.q_proj'")
    assert str(store / "experts/down/c/2/0/0") in msg


def test_tensorstore_reader_checks_too(store):
    _flip_bit(store / BANK_CHUNK)
    _raises(lambda: load_store(store, verify="full", reader="tensorstore"), "expert flat id 5", "checksum mismatch")


def test_bit_flipped_dense_chunk(store):
    _flip_bit(store / DENSE_CHUNK)
    _raises(lambda: load_store(store), re.escape(str(store / "params/layers.1.attn.q_proj")),
            "checksum mismatch", "tensor 'layers.1.attn.q_proj'")
    load_store(store, verify=False)  # structure is fine; only the checksum knows


def test_truncated_dense_chunk(store):
    _truncate(store / DENSE_CHUNK)
    _raises(lambda: load_store(store, verify=False), re.escape(str(store / DENSE_CHUNK)),
            "tensor 'layers.1.attn.q_proj'", "truncated")


def test_missing_array(store):
    shutil.rmtree(store / "params/layers.0.gdn.conv1d")
    _raises(lambda: load_store(store), re.escape(str(store / "params/layers.0.gdn.conv1d")),
            "array missing", "tensor 'layers.0.gdn.conv1d'")
    shutil.rmtree(store / "experts/down")
    _raises(lambda: verify_store(store), "array missing")


def test_missing_manifest(store):
    (store / "ftw.json").unlink()
    _raises(lambda: load_store(store), re.escape(str(store / "ftw.json")), "manifest missing")
    _raises(lambda: load_store(store / "nowhere"), "not a directory")


def test_unknown_version_and_format(store):
    _edit_manifest(store, lambda m: m.update(version=2))
    _raises(lambda: load_store(store), re.escape(str(store / "ftw.json")), "unknown FTW format version 2",
            "reads version 1")
    _edit_manifest(store, lambda m: m.update(version=1, format="gguf"))
    _raises(lambda: verify_store(store), "format 'gguf' is not 'ftw'")
    (store / "ftw.json").write_text("{not json")
    _raises(lambda: load_store(store), "not valid JSON")


def test_manifest_shape_disagrees_with_array(store):
    _edit_manifest(store, lambda m: m["tensors"]["embed"].update(shape=[32, 64]))
    _raises(lambda: load_store(store), "tensor 'embed'", r"shape \[32, 64\] in the manifest", r"\[64, 32\]")


def test_array_disagrees_with_manifest(store):
    # the array on disk was replaced by one of another dtype: zarr.json says float32
    meta = json.loads((store / "params/final_norm/zarr.json").read_text())
    meta["data_type"] = "float32"
    (store / "params/final_norm/zarr.json").write_text(json.dumps(meta))
    _raises(lambda: load_store(store), re.escape(str(store / "params/final_norm")), "tensor 'final_norm'",
            r"float32\[32\] on disk", r"manifest says bfloat16\[32\]")


def test_manifest_dtype_disagrees(store):
    _edit_manifest(store, lambda m: m["experts"]["banks"]["down"].update(dtype="float32"))
    _raises(lambda: load_store(store), "expert bank 'down'", "float32")
    _edit_manifest(store, lambda m: m["tensors"]["embed"].update(dtype="int3"))
    _raises(lambda: load_store(store), "tensor 'embed'", "dtype 'int3'", "valid")


def test_manifest_config_disagrees(store):
    _edit_manifest(store, lambda m: m["config"].update(hidden_size=48))
    _raises(lambda: load_store(store), re.escape(str(store / "ftw.json")), "tensor 'embed'",
            r"shape \[64, 32\] in the manifest but the model config gives \[64, 48\]")
    _edit_manifest(store, lambda m: m["config"].update(hidden_size=32, num_layers=3,
                                                       layer_types=["linear_attention"] * 3))
    _raises(lambda: load_store(store), "manifest tensors disagree with the model config", "missing")
    _edit_manifest(store, lambda m: m["config"].update(bogus_field=1))
    _raises(lambda: load_store(store), "model config in the manifest is invalid", "bogus_field")


def test_checksum_list_wrong_length(store):
    _edit_manifest(store, lambda m: m["experts"]["banks"]["gate_up"]["checksums"].pop())
    _raises(lambda: load_store(store), "expert bank 'gate_up'", "7 chunk checksums for 8 experts")


@pytest.mark.parametrize("wide", [False, True])
def test_reader_detects_truncation_without_the_size_check(tmp_path, wide):
    """read_bank itself names a short chunk (buffered and O_DIRECT paths)."""
    import ml_dtypes

    from ftjax.ftw import convert
    from ftjax.ftw.load import open_store
    from ftjax.ftw.store import alloc_aligned, read_bank
    from tiny_hf import write_tiny_hf

    dims = {"hidden_size": 64, "moe_intermediate_size": 32} if wide else {}
    src = write_tiny_hf(tmp_path / "hf", "single", **dims)
    path = convert(src.path, tmp_path / "s", progress=False)
    _truncate(path / BANK_CHUNK, keep=4096 if wide else 100)
    root, man, _ = open_store(path)
    entry = man["experts"]["banks"]["gate_up"]
    out = alloc_aligned(entry["shape"], ml_dtypes.bfloat16)
    with pytest.raises(StoreError, match=r"c/5/0/0: chunk file of expert bank 'gate_up', expert flat id 5 .*truncated"):
        read_bank(root, entry["path"], out, what="expert bank 'gate_up'", threads=2)
