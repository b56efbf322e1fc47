"""The loader reads expert banks straight into the C++ host pool."""
import numpy as np
import pytest

from ftjax.ftw import load_store
from ftjax.ftw.manifest import StoreError
from ftjax.host.pool import load_store_into_pool


def test_load_into_host_pool_equals_plain_load(tiny_store_bf16):
    plain = load_store(tiny_store_bf16, device=False)
    model, pool = load_store_into_pool(tiny_store_bf16, device=False, pin=False)
    assert pool.format == "bf16" and not pool.pinned
    for bank in ("gate_up", "down"):
        assert model.experts[bank].ctypes.data == pool.bank(bank).ctypes.data  # no copy
        np.testing.assert_array_equal(model.experts[bank], plain.experts[bank])


@pytest.mark.parametrize("reader", ["auto", "buffered", "tensorstore"])  # (O_DIRECT needs block-sized chunks)
def test_load_into_transposed_down_pool(tiny_store_bf16, reader):
    """A pool of down_layout "ih": the loader transposes each down chunk into the pool's [I, H] rows; every
    reader, with full checksums; the logical views equal the plain load."""
    plain = load_store(tiny_store_bf16, device=False)
    model, pool = load_store_into_pool(tiny_store_bf16, device=False, pin=False, down_layout="ih", reader=reader,
                                       verify="full")
    assert pool.down_layout == "ih"
    for bank in ("gate_up", "down"):
        np.testing.assert_array_equal(model.experts[bank], plain.experts[bank])
        np.testing.assert_array_equal(pool.bank(bank), plain.experts[bank])
    np.testing.assert_array_equal(pool.stored("down"), plain.experts["down"].swapaxes(1, 2))


def test_transposed_load_names_a_corrupt_chunk(tiny_store_bf16, tmp_path):
    import shutil

    from ftjax.ftw.store import array_meta, chunk_path

    store = tmp_path / "store"
    shutil.copytree(tiny_store_bf16, store)
    from ftjax.ftw.load import open_store

    _, man, _ = open_store(store)
    rel = man["experts"]["banks"]["down"]["path"]
    meta = array_meta(store, rel)
    path = chunk_path(store, rel, meta, (3, 0, 0))
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="checksum mismatch.*expert"):
        load_store_into_pool(store, device=False, pin=False, down_layout="ih", reader="buffered", verify="full")
