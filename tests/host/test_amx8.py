"""The amx8 path (int4 weights x bf16 activations on AMX-INT8: cpp/kernels_amx8.cc): its activation layout, its
kernel and the MoE call through it, against numpy; on the scalar model of the tile unit wherever the CPU has
AVX-512 VBMI (CI), on the tile unit itself where AMX-INT8 runs (the GPU machine's Xeon), and the two bit for bit."""
import zlib

import numpy as np
import pytest
from kernel_helpers import BF16, make_pool, rel_err

from ftjax import _host
from ftjax.host import kernel_knobs, set_kernel_knobs
from ftjax.host.reference import amx8_quantize, amx8_reference, experts_reference


def _modes():
    modes = []
    _host.set_amx8_emulate(False)
    if _host.amx8_runs():
        modes.append("hardware")
    try:
        _host.set_amx8_emulate(True)
        modes.append("model")
    except ValueError:
        pass
    finally:
        _host.set_amx8_emulate(False)
    return modes


MODES = _modes()
needs_amx8 = pytest.mark.skipif(not MODES, reason="no amx8 path here (AMX-INT8, or AVX-512 VBMI for its tile model)")


@pytest.fixture(params=MODES or ["none"])
def mode(request):
    if request.param == "none":
        pytest.skip("no amx8 path here (AMX-INT8, or AVX-512 VBMI for its tile model)")
    _host.set_amx8_emulate(request.param == "model")
    yield request.param
    _host.set_amx8_emulate(False)


def bf16_groups(rng, n, K, spread):
    """bf16 vectors [n, K] whose groups of 32 columns mix magnitudes over 2^spread around a per-group scale (random
    signs, a zero group, subnormals where a group's scale is tiny)."""
    mag = rng.uniform(1, 2, (n, K)) * np.exp2(rng.integers(-spread, 1, (n, K)) +
                                              rng.integers(-20, 20, (n, K // 32)).repeat(32, 1))
    x = (mag * rng.choice([-1.0, 1.0], (n, K))).astype(np.float32)
    if K >= 64:
        x[:, 32:64] = 0.0
    return x.astype(BF16)


@needs_amx8
def test_amx8_layout_equals_numpy():
    """The amx8 layout byte for byte equal to its numpy reference: 1-8 vectors (the groups' slots per C tile), wide
    and narrow groups, zeros, subnormals, the largest finite bf16; a group holding an inf or NaN gets NaN factors
    and zero B columns."""
    rng = np.random.default_rng(8)
    for nb in (1, 2, 3, 4, 5, 8):
        for K, spread in ((32, 3), (96, 12), (256, 30)):
            x = bf16_groups(rng, nb, K, spread)
            if K >= 96:
                x[0, 70:72] = np.array([3e38, -1e-39], np.float32).astype(BF16)
            bits = x.view(np.uint16)
            np.testing.assert_array_equal(_host.amx8_layout(bits), amx8_reference(bits), err_msg=f"{nb} x {K}")
    bits = bf16_groups(rng, 2, 96, 4).view(np.uint16).copy()
    bits[0, 3], bits[1, 40] = 0x7F80, 0x7FC0  # +inf in vector 0's group 0, NaN in vector 1's group 1
    got = _host.amx8_layout(bits)
    np.testing.assert_array_equal(got.view(np.uint8), amx8_reference(bits).view(np.uint8))
    factors = got.reshape(3, 576)[:, 512:].view(np.float32)
    assert np.isnan(factors[0, 0:2]).all() and np.isnan(factors[1, 4 + 2:4 + 4]).all()  # (slots: 4 per step at nb 2)
    assert np.isfinite(factors[0, 2:4]).all() and np.isfinite(factors[2, 0:4]).all()
    for bad in (np.zeros((1, 48), np.uint16), np.zeros((9, 32), np.uint16)):
        with pytest.raises(ValueError, match="1-8 vectors of whole groups"):
            _host.amx8_layout(bad)


@needs_amx8
def test_amx8_dot_rows(mode):
    """One int4 matrix times 1-17 bf16 vectors (token blocks of 8) through the amx8 path alone: whole and column
    windows (starting at 32, 96, 160: steps cut by the window, slots not starting at 0), gate/up's 64 rows (four
    tile blocks) of 352 columns and down's 352 rows of one group: equal to the float64 product of the dequantized
    weights with the layout's activations to f32 summation, and to the exact one within the layout's bound (2^-14
    of each group's largest element per product)."""
    rng = np.random.default_rng(zlib.crc32(f"amx8{mode}".encode()))
    pool, ref = make_pool(rng, "int4", 2, 352, 32)
    for bank in ("gate_up", "down"):
        w = ref[bank][1].astype(np.float64)
        K = w.shape[1]
        for n in (1, 2, 3, 5, 8, 9, 17):
            for spread in (6, 30):
                x = bf16_groups(rng, n, K, spread)
                bits = x.view(np.uint16)
                q, e = amx8_quantize(bits)
                xq = q * np.exp2(np.repeat(e - 140.0, 32, axis=1))
                xf = x.astype(np.float64)
                group_max = np.abs(xf).reshape(n, -1, 32).max(2).repeat(32, 1)
                for col0 in (c for c in (0, 32, 96, 160) if c < K):
                    got = _host.dot_rows(pool._h, bank, 1, bits, x_bf16=True, col0=col0, amx8=True)
                    wc = w[:, col0:]
                    scale = np.abs(wc) @ np.abs(xf[:, col0:]).T
                    np.testing.assert_array_less(np.abs(got - wc @ xq[:, col0:].T), 1e-6 * scale + 1e-30,
                                                 err_msg=f"{bank}, {n} tokens, col0 {col0}")
                    bound = 1e-6 * scale + (np.abs(wc) @ group_max[:, col0:].T) * 2.0 ** -14
                    assert (np.abs(got - wc @ xf[:, col0:].T) <= bound).all(), (bank, n, spread, col0)
    bits = bf16_groups(rng, 3, 352, 4).view(np.uint16).copy()
    bits[1, 100] = 0x7FC0  # a NaN: token 1's outputs only
    got = _host.dot_rows(pool._h, "gate_up", 1, bits, x_bf16=True, amx8=True)
    assert np.isnan(got[:, 1]).all() and np.isfinite(got[:, [0, 2]]).all()
    bf16_pool, _ = make_pool(rng, "bf16", 2, 64, 32)
    with pytest.raises(ValueError, match="amx8: int4 weights, bf16 x"):
        _host.dot_rows(bf16_pool._h, "gate_up", 1, np.zeros((1, 64), np.uint16), x_bf16=True, amx8=True)


@pytest.mark.skipif(MODES != ["hardware", "model"], reason="needs AMX-INT8 (the tile unit against its model)")
def test_amx8_hardware_equals_model():
    """The tile unit and its scalar model give the same bits (exact integer sums, then the same f32 epilogue): the
    model that CI runs stands for the hardware."""
    rng = np.random.default_rng(88)
    pool, _ = make_pool(rng, "int4", 2, 512, 256)
    try:
        for n in (1, 2, 4, 8, 11):
            bits = bf16_groups(rng, n, 512, 20).view(np.uint16)
            outs = []
            for emulate in (False, True):
                _host.set_amx8_emulate(emulate)
                outs.append([_host.dot_rows(pool._h, bank, 1, bits if bank == "gate_up" else bits[:, :256],
                                            x_bf16=True, col0=col0, amx8=True)
                             for bank in ("gate_up", "down") for col0 in (0, 64)])
            for a, b in zip(*outs):
                np.testing.assert_array_equal(a, b)
    finally:
        _host.set_amx8_emulate(False)


@needs_amx8
def test_amx8_moe_call(mode):
    """Whole CPU expert calls with int4 experts taking the amx8 path (up to 2, 8 and 64 tokens per expert; unit
    starts cut the down windows and the gate/up rows): equal to the numpy reference as the other int4 loops are, and
    the path really ran (its call counter); 0 leaves it."""
    rng = np.random.default_rng(81)
    H, I, N = 256, 96, 6
    pool, ref = make_pool(rng, "int4", N, H, I)
    default = kernel_knobs()
    info = _host.worker_info()
    _host.configure_workers(3, info["spin_us"], False)
    try:
        for T, k in ((1, 4), (3, 6), (10, 6)):
            x = rng.standard_normal((T, H)).astype(BF16)
            tok = np.repeat(np.arange(T), k).astype(np.int32)
            eid = np.concatenate([rng.choice(N, k, replace=False) for _ in range(T)]).astype(np.int32)
            wt = rng.uniform(0.1, 1, T * k).astype(np.float32)
            unit = (rng.integers(0, 3, T * k) * 32).astype(np.int32)
            want = experts_reference(x.astype(np.float32), tok, eid, wt, T * k, ref["gate_up"], ref["down"],
                                     bf16_act=True, unit_start=unit)
            for a8 in (0, 2, 8, 64):
                set_kernel_knobs(int4_amx8_tokens=a8)
                before = _host.amx_route_counts()["amx8"]
                y = _host.run_experts(pool._h, x.view(np.uint16), tok, eid, wt, T * k, x_bf16=True, unit_start=unit)
                ran = _host.amx_route_counts()["amx8"] - before
                assert (ran > 0) == (a8 > 0), (T, a8, ran)
                assert rel_err(y, want) < 2e-3, (T, a8, rel_err(y, want))
    finally:
        set_kernel_knobs(**default)
        _host.configure_workers(info["n_workers"], info["spin_us"], info["pin"])
