"""The loader reads expert banks straight into the C++ host pool."""
import numpy as np

from ftjax.ftw import load_store
from ftjax.host.pool import load_store_into_pool


def test_load_into_host_pool_equals_plain_load(tiny_store_bf16):
    plain = load_store(tiny_store_bf16, device=False)
    model, pool = load_store_into_pool(tiny_store_bf16, device=False, pin=False)
    assert pool.format == "bf16" and not pool.pinned
    for bank in ("gate_up", "down"):
        assert model.experts[bank].ctypes.data == pool.bank(bank).ctypes.data  # no copy
        np.testing.assert_array_equal(model.experts[bank], plain.experts[bank])
