"""convert -> load round trips on tiny checkpoints: every tensor equals the source."""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

from ftjax.ftw import LoadedModel, convert, load_store, verify_store
from ftjax.ftw.load import open_store
from ftjax.ftw.store import ALIGN_BYTES, alloc_aligned, read_bank
from ftjax.models.params import flatten, param_shapes
from tiny_hf import VARIANTS, write_tiny_hf

DTYPES = {"bf16": ml_dtypes.bfloat16, "fp32": np.float32}


def _host(x):
    return np.asarray(x)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_roundtrip_every_tensor(tiny_ckpt, tmp_path, dtype):
    out = convert(tiny_ckpt.path, tmp_path / "store", dtype=dtype, progress=False)
    m = load_store(out)
    assert isinstance(m, LoadedModel) and m.path == out
    want = DTYPES[dtype]
    flat = flatten(m.params)
    assert set(flat) == set(param_shapes(m.config)) == set(tiny_ckpt.dense)
    for name, src in tiny_ckpt.dense.items():
        got = _host(flat[name])
        assert got.dtype == want, name
        np.testing.assert_array_equal(got.astype(np.float32), src, err_msg=name)
    for bank, src in (("gate_up", tiny_ckpt.gate_up), ("down", tiny_ckpt.down)):
        assert m.experts[bank].dtype == want
        np.testing.assert_array_equal(m.experts[bank].astype(np.float32), src)


def test_banks_equal_direct_stack_of_experts(tiny_ckpt, tiny_store_bf16):
    from ftjax.ftw.hf import HFCheckpoint

    ckpt = HFCheckpoint(tiny_ckpt.path)
    cfg = ckpt.config
    experts = [ckpt.expert(l, e) for l in range(cfg.num_layers) for e in range(cfg.num_experts)]
    m = load_store(tiny_store_bf16, device=False)
    for bank in ("gate_up", "down"):
        stacked = np.stack([np.asarray(x[bank]) for x in experts]).astype(ml_dtypes.bfloat16)
        assert m.experts[bank].view(np.uint16).tobytes() == stacked.view(np.uint16).tobytes()
    gate = tiny_ckpt.gate_up[:, : cfg.moe_intermediate_size]
    np.testing.assert_array_equal(m.experts["gate_up"][:, : cfg.moe_intermediate_size].astype(np.float32), gate)


def test_banks_are_aligned_host_buffers(tiny_store_bf16):
    m = load_store(tiny_store_bf16, device=False)
    for bank in m.experts.values():
        assert isinstance(bank, np.ndarray) and bank.flags.c_contiguous
        assert bank.ctypes.data % ALIGN_BYTES == 0


@pytest.fixture(scope="module")
def wide_store(tmp_path_factory):
    """Chunks of 8 KiB / 4 KiB: block-aligned, so the O_DIRECT reader applies."""
    src = write_tiny_hf(tmp_path_factory.mktemp("hf") / "wide", "single", hidden_size=64, moe_intermediate_size=32)
    return src, convert(src.path, tmp_path_factory.mktemp("ftw") / "wide", progress=False)


@pytest.mark.parametrize("threads", [1, 3])
def test_all_bank_readers_agree(wide_store, threads):
    src, path = wide_store
    root, man, cfg = open_store(path)
    got = {}
    for reader in ("auto", "odirect", "buffered", "tensorstore"):
        entry = man["experts"]["banks"]["gate_up"]
        out = alloc_aligned(entry["shape"], ml_dtypes.bfloat16)
        used = read_bank(root, entry["path"], out, what="gate_up", threads=threads, reader=reader,
                         checksums=entry["checksums"], algorithm=man["checksum_algorithm"])
        if reader != "auto":  # auto: see test_auto_reader_follows_the_page_cache
            assert used == reader
        got[reader] = out.astype(np.float32)
    for reader, x in got.items():
        np.testing.assert_array_equal(x, src.gate_up, err_msg=reader)
    m = load_store(path, device=False, threads=threads)
    np.testing.assert_array_equal(m.experts["down"].astype(np.float32), src.down)


def _evict(files):
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs preadv2 RWF_NOWAIT (Linux)")
def test_auto_reader_follows_the_page_cache(wide_store):
    _, path = wide_store
    root, man, _ = open_store(path)
    entry = man["experts"]["banks"]["gate_up"]
    out = alloc_aligned(entry["shape"], ml_dtypes.bfloat16)
    read_bank(root, entry["path"], out, what="gate_up", threads=2, reader="buffered")  # now cached
    assert read_bank(root, entry["path"], out, what="gate_up", threads=2) == "buffered"
    _evict(sorted((path / entry["path"]).rglob("c/*/0/0")))
    if read_bank(root, entry["path"], out, what="gate_up", threads=2) != "odirect":
        pytest.skip("this filesystem kept the pages cached or has no O_DIRECT")


def test_unaligned_chunks_fall_back_to_buffered(tiny_store_bf16):
    root, man, _ = open_store(tiny_store_bf16)
    entry = man["experts"]["banks"]["down"]  # 1 KiB chunks
    out = alloc_aligned(entry["shape"], ml_dtypes.bfloat16)
    assert read_bank(root, entry["path"], out, what="down", threads=2) == "buffered"
    with pytest.raises(ValueError, match="reader 'fast' unknown"):
        read_bank(root, entry["path"], out, what="down", threads=2, reader="fast")


def test_keep_source_dtype(tmp_path):
    src = write_tiny_hf(tmp_path / "hf", "bf16")
    man = json.loads((convert(src.path, tmp_path / "s", dtype=None, progress=False) / "ftw.json").read_text())
    assert {t["dtype"] for t in man["tensors"].values()} == {"bfloat16"}
    assert man["experts"]["dtype"] == "bfloat16"
    src32 = write_tiny_hf(tmp_path / "hf32", "single")
    man = json.loads((convert(src32.path, tmp_path / "s32", dtype=None, progress=False) / "ftw.json").read_text())
    assert man["experts"]["dtype"] == "float32"


def test_load_options(tiny_store_bf16):
    m = load_store(tiny_store_bf16, device=False, dtype=np.float32, verify=False)
    assert isinstance(m.params["embed"], np.ndarray) and m.params["embed"].dtype == np.float32
    assert m.experts["gate_up"].dtype == ml_dtypes.bfloat16  # banks keep the stored dtype
    assert load_store(tiny_store_bf16, device=False, dtype="fp32").params["final_norm"].dtype == np.float32
    m = load_store(tiny_store_bf16, verify="full")
    assert not isinstance(m.params["embed"], np.ndarray)  # a jax.Array on the default device
    assert len(m.params["layers"]) == m.config.num_layers
    with pytest.raises(ValueError, match="verify"):
        load_store(tiny_store_bf16, verify="yes")


def test_manifest_contents(tiny_ckpt, tiny_store_bf16):
    man = json.loads((tiny_store_bf16 / "ftw.json").read_text())
    assert man["format"] == "ftw" and man["version"] == 1 and man["ftjax_version"]
    assert man["created"] and man["config"]["num_experts"] == 4
    assert man["experts"]["quant"] == "none" and man["experts"]["dtype"] == "bfloat16"
    gu = man["experts"]["banks"]["gate_up"]
    assert gu["shape"] == [8, 32, 32] and len(gu["checksums"]) == 8
    assert all({"path", "shape", "dtype", "checksum"} <= set(t) for t in man["tensors"].values())
    src = man["source"]
    assert src["model_type"] == "qwen3_5_moe_text" and src["dir"]
    assert {"name": "model.safetensors", "bytes": (tiny_ckpt.path / "model.safetensors").stat().st_size} in src["files"]
    # self-contained: config and tokenizer files are copied
    assert "hf/config.json" in man["files"] and "hf/tokenizer.json" in man["files"]
    for rel in man["files"]:
        assert (tiny_store_bf16 / rel).is_file()
    # bank arrays: one uncompressed chunk per expert
    meta = json.loads((tiny_store_bf16 / "experts/gate_up/zarr.json").read_text())
    assert meta["codecs"] == [{"name": "bytes", "configuration": {"endian": "little"}}]
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [1, 32, 32]
    assert (tiny_store_bf16 / "experts/gate_up/c/7/0/0").stat().st_size == 32 * 32 * 2
    assert verify_store(tiny_store_bf16)["experts"] == 8


def _comparable(store):
    man = json.loads((store / "ftw.json").read_text())
    cfg = {k: v for k, v in man["config"].items() if k != "model_type"}  # outer vs text model_type
    return cfg, man["tensors"], man["experts"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_all_variants_convert_to_identical_stores(tmp_path, dtype):
    stores = {}
    for variant in VARIANTS:
        src = write_tiny_hf(tmp_path / f"hf-{variant}", variant)
        stores[variant] = _comparable(convert(src.path, tmp_path / f"ftw-{variant}", dtype=dtype, progress=False))
    ref = stores["single"]
    for variant, got in stores.items():
        assert got == ref, variant


def test_progress_bar_can_be_disabled(tiny_ckpt, tmp_path, capfd):
    capfd.readouterr()
    convert(tiny_ckpt.path, tmp_path / "quiet", progress=False)
    assert capfd.readouterr().err == ""
    convert(tiny_ckpt.path, tmp_path / "loud", progress=True)
    err = capfd.readouterr().err
    assert "convert" in err and "40/40" in err


def test_all_zero_tensors_and_experts_round_trip(tmp_path):
    """Zero-centred norms are all zeros in fresh checkpoints; an all-zero chunk must still be stored."""
    import tiny_hf

    make = tiny_hf.make_weights

    def zeroed(cfg, seed=0):
        dense, gate_up, down = make(cfg, seed)
        dense["final_norm"] = np.zeros_like(dense["final_norm"])
        dense["layers.0.input_norm"] = np.zeros_like(dense["layers.0.input_norm"])
        gate_up[3] = 0.0
        down[3] = 0.0
        return dense, gate_up, down

    tiny_hf.make_weights = zeroed
    try:
        ck = write_tiny_hf(tmp_path / "hf")
    finally:
        tiny_hf.make_weights = make
    out = convert(ck.path, tmp_path / "store", dtype="fp32", progress=False)
    m = load_store(out, verify="full")
    flat = flatten(m.params)
    assert not np.asarray(flat["final_norm"]).any() and not m.experts["gate_up"][3].any()
    np.testing.assert_array_equal(m.experts["down"], ck.down)
