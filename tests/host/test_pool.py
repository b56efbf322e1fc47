"""Host pool: alignment, views, lifetime, the loader's allocator."""
import numpy as np
import pytest

from ftjax import _host
from ftjax.host import HostPool


def test_banks_are_2mib_aligned_views():
    pool = HostPool(6, 64, 32, "bf16")
    assert pool.shape("gate_up") == (6, 64, 64) and pool.shape("down") == (6, 64, 32)
    for b in ("gate_up", "down"):
        view = pool.bank(b)
        assert view.ctypes.data % (2 << 20) == 0
        assert view.flags.c_contiguous and view.flags.writeable
        assert view.nbytes == 6 * pool.expert_bytes(b)
    assert pool.total_bytes == 6 * (64 * 64 + 64 * 32) * 2
    int4 = HostPool(2, 64, 32, "int4")
    assert int4.expert_bytes("gate_up") == 64 * 64 // 2 + 64 * 2 * 2
    with pytest.raises(ValueError, match="typed view"):
        int4.bank("gate_up")


def test_views_outlive_close_and_ids_are_unregistered():
    pool = HostPool(2, 32, 32, "f32")
    view = pool.bank("down")
    view[...] = 1.5
    pid = pool.id
    pool.close()
    assert view.sum() == 1.5 * view.size  # memory kept alive by the view
    x = np.ones((1, 32), np.float32)
    one = np.zeros(1, np.int32)
    # the handle still computes; only the id is gone from the registry used by FFI calls
    _host.run_experts(pool._h, x, one, one, np.ones(1, np.float32), 1)
    assert pool._h.closed and pid > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="format"):
        HostPool(2, 32, 32, "fp8")
    with pytest.raises(ValueError, match="divisible by 32"):
        HostPool(2, 48, 40, "int4")
    with pytest.raises(ValueError, match=">= 1"):
        _host.HostPool(0, 32, 32, "bf16")
    pool = HostPool(2, 32, 32, "bf16")
    with pytest.raises(KeyError, match="valid: gate_up, down"):
        pool.raw("up")
    alloc = pool.allocator()
    with pytest.raises(ValueError, match="pool holds"):
        alloc("down", (2, 32, 16), np.float32)


@pytest.mark.skipif(_host.cuda_built(), reason="CUDA build: pinning is covered by the GPU tests")
def test_pin_without_cuda_raises():
    with pytest.raises(RuntimeError, match="without CUDA"):
        HostPool(1, 32, 32).pin()
    assert HostPool(1, 32, 32).pin_if_cuda() is False
