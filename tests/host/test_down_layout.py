"""The transposed down bank (``HostPool(down_layout="ih")``): the pool's views, the axpy pass of every ISA tier
against numpy, and the CPU expert call on an "ih" pool against the same experts in an "hi" pool and the float64
reference (few tokens: the fused pass into per-thread partials; many: down by column blocks)."""
import zlib

import numpy as np
import pytest
from kernel_helpers import BF16, TIERS, rel_err

from ftjax import _host
from ftjax.host import HostPool, kernel_knobs, set_kernel_knobs, set_tier
from ftjax.host.reference import experts_reference


def banks(rng, fmt, n, hidden, inter):
    b = {"gate_up": rng.standard_normal((n, 2 * inter, hidden)).astype(np.float32) * 0.2,
         "down": rng.standard_normal((n, hidden, inter)).astype(np.float32) * 0.2}
    return {k: v.astype(BF16) for k, v in b.items()} if fmt == "bf16" else b


def run(pool, x, tok, eid, w, n_valid, unit=None):
    bf16 = x.dtype == BF16
    return _host.run_experts(pool._h, x.view(np.uint16) if bf16 else x, tok, eid, w, n_valid, x_bf16=bf16,
                             unit_start=unit)


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_ih_pool_views(fmt):
    rng = np.random.default_rng(1)
    b = banks(rng, fmt, 3, 40, 24)
    pool = HostPool.from_banks(b, down_layout="ih")
    assert pool.down_layout == "ih" and pool._h.down_layout == "ih"
    assert pool.stored_shape("down") == (3, 24, 40) and pool.shape("down") == (3, 40, 24)
    np.testing.assert_array_equal(pool.bank("down"), b["down"])
    np.testing.assert_array_equal(pool.stored("down"), b["down"].swapaxes(1, 2))
    np.testing.assert_array_equal(pool.bank("gate_up"), b["gate_up"])
    assert pool.stored("down").flags.c_contiguous
    assert pool.expert_bytes("down") == HostPool(3, 40, 24, fmt).expert_bytes("down")


def test_ih_pool_views_square():
    """H == I: the stored and logical shapes agree, the views must still transpose."""
    rng = np.random.default_rng(2)
    b = banks(rng, "bf16", 2, 32, 32)
    pool = HostPool.from_banks(b, down_layout="ih")
    np.testing.assert_array_equal(pool.bank("down"), b["down"])
    np.testing.assert_array_equal(pool.stored("down"), b["down"].swapaxes(1, 2))


def test_ih_pool_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="int4 pools keep down"):
        HostPool(2, 64, 32, "int4", down_layout="ih")
    with pytest.raises(ValueError, match="int4 experts keep down"):
        _host.HostPool(2, 64, 32, "int4", "ih")
    with pytest.raises(ValueError, match="down layout 'xy' unknown"):
        _host.HostPool(2, 64, 32, "bf16", "xy")
    with pytest.raises(ValueError, match="down layout"):
        HostPool(2, 64, 32, "bf16", down_layout="HI")


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 9])
def test_axpy_rows_matches_numpy(tier, fmt, n):
    """Rows not a multiple of the 4-row step, columns not a multiple of a tile, a column window, n vectors in
    passes of the tier's width; out0 is added to."""
    set_tier(tier)
    rng = np.random.default_rng(zlib.crc32(f"axpy{tier}{fmt}{n}".encode()))
    rows, cols = 23, 77
    pool = HostPool.from_banks(banks(rng, fmt, 2, cols, rows), down_layout="ih")
    w = pool.stored("down")[1].astype(np.float64)  # [rows, cols]
    coef = rng.standard_normal((n, rows)).astype(np.float32)
    for i0, i1, h0, h1 in [(0, rows, 0, cols), (5, 18, 3, 70), (7, 8, 32, 64), (4, 4, 0, cols)]:
        out0 = rng.standard_normal((n, h1 - h0)).astype(np.float32)
        got = _host.axpy_rows(pool._h, "down", 1, coef, i0, i1, h0, h1, out0)
        want = out0 + coef[:, i0:i1].astype(np.float64) @ w[i0:i1, h0:h1]
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-5, (i0, i1, h0, h1)
    with pytest.raises(ValueError, match="outside the matrix"):
        _host.axpy_rows(pool._h, "down", 1, coef, 0, rows + 1, 0, cols, np.zeros((n, cols), np.float32))


def tasks(rng, T, n_tasks, n_experts):
    tok = rng.integers(0, T, n_tasks).astype(np.int32)
    eid = rng.integers(0, n_experts, n_tasks).astype(np.int32)
    eid[: n_tasks // 3] = eid[0]  # duplicate experts: several tokens on one expert
    return tok, eid, rng.random(n_tasks).astype(np.float32)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt,act", [("f32", "f32"), ("bf16", "f32"), ("bf16", "bf16")])
# T * H up to 32768 per thread: the fused pass; (T 200, H 192): down by column blocks
@pytest.mark.parametrize("T,n_tasks,hidden,inter", [(1, 8, 192, 128), (4, 14, 96, 160), (9, 24, 37, 23),
                                                    (200, 420, 192, 64)])
def test_ih_call_matches_hi_and_reference(tier, fmt, act, T, n_tasks, hidden, inter):
    set_tier(tier)
    rng = np.random.default_rng(zlib.crc32(f"ih{tier}{fmt}{act}{T}{hidden}".encode()))
    b = banks(rng, fmt, 7, hidden, inter)
    hi, ih = HostPool.from_banks(b), HostPool.from_banks(b, down_layout="ih")
    x = rng.standard_normal((T, hidden)).astype(np.float32)
    if act == "bf16":
        x = x.astype(BF16)
    tok, eid, w = tasks(rng, T, n_tasks, 7)
    ref = {k: v.astype(np.float32) for k, v in b.items()}
    tol = 2e-5 if act == "f32" else 2e-2  # bf16: the intermediate's bf16 rounding may flip
    starts = [0, 5, 37, 64, inter - 1, inter]
    for n_valid, unit in [(n_tasks, None), (n_tasks // 2 + 1, None),
                          (n_tasks, rng.choice([s for s in starts if s <= inter], n_tasks).astype(np.int32))]:
        y = run(ih, x, tok, eid, w, n_valid, unit)
        want = experts_reference(x.astype(np.float32), tok, eid, w, n_valid, ref["gate_up"], ref["down"],
                                 bf16_act=act == "bf16", unit_start=unit)
        assert rel_err(y, want) < tol
        assert rel_err(y, run(hi, x, tok, eid, w, n_valid, unit)) < tol


@pytest.mark.parametrize("tier", TIERS)
def test_ih_call_empty_and_all_units_elsewhere(tier):
    set_tier(tier)
    rng = np.random.default_rng(7)
    pool = HostPool.from_banks(banks(rng, "bf16", 3, 64, 32), down_layout="ih")
    x = rng.standard_normal((2, 64)).astype(np.float32)
    z = np.zeros(0, np.int32)
    np.testing.assert_array_equal(run(pool, x, z, z, np.zeros(0, np.float32), 0), 0.0)
    tok, eid, w = tasks(rng, 2, 4, 3)
    np.testing.assert_array_equal(run(pool, x, tok, eid, w, 4, np.full(4, 32, np.int32)), 0.0)


@pytest.mark.parametrize("tier", TIERS)
def test_ih_prefetch_changes_no_bits(tier):
    set_tier(tier)
    rng = np.random.default_rng(8)
    pool = HostPool.from_banks(banks(rng, "bf16", 4, 256, 96), down_layout="ih")
    x = rng.standard_normal((2, 256)).astype(BF16)
    tok, eid, w = tasks(rng, 2, 6, 4)
    saved = kernel_knobs()
    try:
        outs = []
        for pf in (0, 64, 512, 4096):
            set_kernel_knobs(prefetch_bytes=pf)
            outs.append(run(pool, x, tok, eid, w, 6))
    finally:
        set_kernel_knobs(**saved)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@pytest.mark.parametrize("T,n_tasks", [(1, 3), (4, 12)])
def test_ih_fused_call_is_deterministic(T, n_tasks):
    """The fused pass sums each item's partial in item order, whichever thread ran it: repeated calls with more
    workers than cores (items land on different threads every time) give the same bits."""
    rng = np.random.default_rng(9)
    pool = HostPool.from_banks(banks(rng, "bf16", 6, 256, 128), down_layout="ih")
    x = rng.standard_normal((T, 256)).astype(BF16)
    tok, eid, w = tasks(rng, T, n_tasks, 6)
    try:
        _host.configure_workers(5, 0, False)
        first = run(pool, x, tok, eid, w, n_tasks)
        for _ in range(30):
            np.testing.assert_array_equal(run(pool, x, tok, eid, w, n_tasks), first)
    finally:
        _host.configure_workers(-1, 100, True)
