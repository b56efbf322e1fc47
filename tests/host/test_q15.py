"""The q15 activation layout (int4 x bf16: VPDPBUSD on the AVX-512 tiers, VPMADDUBSW + VPMADDWD on AVX2; written in
AVX-512 where the CPU has it, else in AVX2) and the int4 dot products through it, against numpy."""
import zlib

import numpy as np
import pytest
from kernel_helpers import BF16, TIERS, make_pool, rel_err

from ftjax import _host
from ftjax.host import kernel_knobs, set_kernel_knobs, set_tier
from ftjax.host.reference import experts_reference, q8_reference, q15_reference

Q15_TIERS = [t for t in TIERS if t in ("avx2", "avx512bf16", "amx")]  # the tiers that read the layout


def bf16_lanes(rng, n, K, spread):
    """bf16 vectors [n, K] whose lanes of 8 columns mix magnitudes over 2^spread (random signs, some zero
    lanes, some subnormals): spread <= 6 keeps every element exact in the q15 layout."""
    mag = rng.uniform(1, 2, (n, K)) * np.exp2(rng.integers(-spread, 1, (n, K)) + rng.integers(-20, 20, (n, K // 8)).repeat(8, 1))
    x = (mag * rng.choice([-1.0, 1.0], (n, K))).astype(np.float32)
    x[:, 8:16] = 0.0
    return x.astype(BF16)


@pytest.mark.skipif(not Q15_TIERS, reason="the q15 layout is AVX2 / AVX-512 code; this CPU has neither")
def test_q15_layout_equals_numpy():
    """The q15 layout (int4 x bf16 activations for VPDPBUSD) byte for byte equal to its numpy reference: wide
    and narrow lanes, zeros, subnormals, the largest finite bf16, a tail lane (length % 16 == 8); a lane with an
    inf or NaN gets a NaN scale."""
    rng = np.random.default_rng(15)
    for K, spread in ((8, 3), (24, 12), (256, 30), (2048, 6)):
        x = bf16_lanes(rng, 1, K, spread)[0]
        if K >= 24:
            x[16:18] = np.array([3e38, -1e-39], np.float32).astype(BF16)  # the largest finite, a subnormal
        bits = x.view(np.uint16)
        np.testing.assert_array_equal(_host.q15_layout(bits), q15_reference(bits))
    bits = bf16_lanes(rng, 1, 32, 4)[0].view(np.uint16).copy()
    bits[3], bits[20] = 0x7F80, 0x7FC0  # +inf in lane 0, NaN in lane 2
    got, want = _host.q15_layout(bits), q15_reference(bits)
    lane_scale = got[5 * 16:].view(np.float32)
    assert np.isnan(lane_scale[[0, 2]]).all() and np.isfinite(lane_scale[[1, 3]]).all()
    np.testing.assert_array_equal(lane_scale[[1, 3]], want[5 * 16:].view(np.float32)[[1, 3]])
    with pytest.raises(ValueError, match="whole lanes of 8"):
        _host.q15_layout(np.zeros(12, np.uint16))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("vnni", [64, 0])
def test_int4_dot_rows_bf16(tier, vnni):
    """One int4 matrix times 1-5 bf16 vectors, whole and column windows (starting at 32, 96, 160: a last span
    of 1-3 groups), through `_host.dot_rows` (the kernel alone, no bf16 rounding of an intermediate): with
    activations exact in the q15 layout (lanes within 2^6), equal to the float64 reference to f32 summation;
    with lanes over 2^30, within the layout's bound (2^-14 of each lane's largest element per product)."""
    set_tier(tier)
    default = kernel_knobs()
    set_kernel_knobs(int4_vnni_tokens=vnni)
    try:
        rng = np.random.default_rng(zlib.crc32(f"dot{tier}{vnni}".encode()))
        rows, K = 64, 352  # 2 spans of 128 and 3 groups; 64 rows: 16 tiles of 4 (AMX: 4 tiles of 16)
        pool, ref = make_pool(rng, "int4", 3, K, rows // 2)  # gate_up [2 * inter, hidden] = [64, 352]
        w = ref["gate_up"][1].astype(np.float64)
        for n in (1, 2, 3, 5):
            for spread, exact in ((6, True), (30, False)):
                x = bf16_lanes(rng, n, K, spread)
                xf = x.astype(np.float64)
                for col0 in (0, 32, 96, 160):
                    got = _host.dot_rows(pool._h, "gate_up", 1, x.view(np.uint16), x_bf16=True, col0=col0)
                    want = w[:, col0:] @ xf[:, col0:].T
                    scale = np.abs(w[:, col0:]) @ np.abs(xf[:, col0:]).T  # f32 summation bound's scale
                    lane_max = np.abs(xf[:, col0:]).reshape(n, -1, 8).max(2).repeat(8, 1)
                    bound = 1e-6 * scale + (0 if exact or not vnni or tier not in Q15_TIERS else
                                            (np.abs(w[:, col0:]) @ lane_max.T) * 2.0 ** -14)
                    assert (np.abs(got - want) <= bound).all(), (n, spread, col0, np.abs(got - want).max())
    finally:
        set_kernel_knobs(**default)
    with pytest.raises(ValueError, match="group boundary"):
        _host.dot_rows(pool._h, "gate_up", 1, x.view(np.uint16), x_bf16=True, col0=48)
    with pytest.raises(ValueError, match="bank is gate_up or down"):
        _host.dot_rows(pool._h, "up", 1, x.view(np.uint16), x_bf16=True)


@pytest.mark.skipif(not Q15_TIERS, reason="the q8 form is AVX2 / AVX-512 code; this CPU has neither")
def test_q8_layout_equals_numpy():
    """The q8 form of the layout (int4_act_bits 8) byte for byte equal to its numpy reference in the streams it writes
    (q of the even and odd columns, -8 sum q, the scale): wide and narrow lanes, zeros, subnormals, the largest finite
    bf16, lanes below 2^-100 (zeros), a tail lane; a lane with an inf or NaN gets a NaN scale; every |q| <= 127."""
    rng = np.random.default_rng(8)
    for K, spread in ((8, 3), (24, 12), (256, 30), (2048, 6)):
        x = bf16_lanes(rng, 1, K, spread)[0]
        if K >= 24:
            x[16:18] = np.array([3e38, -1e-39], np.float32).astype(BF16)  # the largest finite, a subnormal
            x[8:16] = np.float32(2.0 ** -110)  # a lane below 2^-100: zeros
        bits = x.view(np.uint16)
        got, want, S = _host.q15_layout(bits, 8), q8_reference(bits), K // 2
        for stream in (0, 1, 4, 5):
            np.testing.assert_array_equal(got[stream * S:(stream + 1) * S], want[stream * S:(stream + 1) * S])
        assert (got[:2 * S] != -128).all()
    bits = bf16_lanes(rng, 1, 32, 4)[0].view(np.uint16).copy()
    bits[3], bits[20] = 0x7F80, 0x7FC0  # +inf in lane 0, NaN in lane 2
    lane_scale = _host.q15_layout(bits, 8)[5 * 16:].view(np.float32)
    assert np.isnan(lane_scale[[0, 2]]).all() and np.isfinite(lane_scale[[1, 3]]).all()
    np.testing.assert_array_equal(lane_scale[[1, 3]], q8_reference(bits)[5 * 16:].view(np.float32)[[1, 3]])
    with pytest.raises(ValueError, match="15 or 8"):
        _host.q15_layout(bits, 4)


@pytest.mark.parametrize("tier", Q15_TIERS)
def test_int4_dot_rows_q8(tier):
    """One int4 matrix times 1-5 bf16 vectors with int8 activations (int4_act_bits 8, the VNNI loop for every count),
    whole and column windows: equal to the float64 product of the weights with the numpy q8 activations (q * scale)
    to f32 summation, and to the exact product within the form's bound (m / 254 per element, m its lane's largest)."""
    set_tier(tier)
    default = kernel_knobs()
    set_kernel_knobs(int4_q8_tokens=64, int4_act_bits=8)
    try:
        rng = np.random.default_rng(zlib.crc32(f"q8{tier}".encode()))
        rows, K = 64, 352
        pool, ref = make_pool(rng, "int4", 3, K, rows // 2)
        w = ref["gate_up"][1].astype(np.float64)
        for n in (1, 2, 3, 5):
            for spread in (6, 30):
                x = bf16_lanes(rng, n, K, spread)
                xf = x.astype(np.float64)
                for col0 in (0, 32, 96, 160):
                    xs = x[:, col0:].view(np.uint16)
                    lay = [q8_reference(v) for v in xs]
                    S = xs.shape[1] // 2
                    xq = np.empty(xs.shape)
                    for j, b in enumerate(lay):
                        q = np.empty(2 * S)
                        q[0::2], q[1::2] = b[:S], b[S:2 * S]
                        xq[j] = q * np.repeat(b[5 * S:].view(np.float32).astype(np.float64), 8)
                    got = _host.dot_rows(pool._h, "gate_up", 1, x.view(np.uint16), x_bf16=True, col0=col0)
                    scale = np.abs(w[:, col0:]) @ np.abs(xq).T
                    np.testing.assert_array_less(np.abs(got - w[:, col0:] @ xq.T), 1e-6 * scale + 1e-30)
                    lane_max = np.abs(xf[:, col0:]).reshape(n, -1, 8).max(2).repeat(8, 1)
                    bound = 1e-6 * scale + (np.abs(w[:, col0:]) @ lane_max.T) / 250
                    assert (np.abs(got - w[:, col0:] @ xf[:, col0:].T) <= bound).all()
    finally:
        set_kernel_knobs(**default)
    with pytest.raises(ValueError, match="15 \\(exact\\) or 8"):
        set_kernel_knobs(int4_act_bits=4)
    assert kernel_knobs()["int4_act_bits"] == 15


@pytest.mark.parametrize("tier", Q15_TIERS)
def test_run_experts_q8(tier):
    """The whole CPU expert call on int4 weights with int8 activations (int4_act_bits 8) for x and the intermediate:
    1 and 4 tokens per expert, unit windows, 1 and 2 threads' worth of items; close to the float64 reference (as the
    exact q15 path is) and not bit-equal to the q15 path (the q8 form really ran)."""
    set_tier(tier)
    hidden, inter = 256, 512
    rng = np.random.default_rng(zlib.crc32(f"q8run{tier}".encode()))
    pool, ref = make_pool(rng, "int4", 4, hidden, inter)
    x = rng.standard_normal((4, hidden)).astype(BF16)
    tok = np.array([0, 1, 2, 3, 0, 1], np.int32)
    eid = np.array([2, 2, 2, 2, 1, 3], np.int32)
    w = rng.random(6).astype(np.float32)
    unit = np.array([0, 0, 0, 0, 224, 32], np.int32)
    want = experts_reference(x.astype(np.float32), tok, eid, w, 6, ref["gate_up"], ref["down"], bf16_act=True,
                             unit_start=unit)
    default = kernel_knobs()
    try:
        outs = {}
        for bits in (15, 8):
            set_kernel_knobs(int4_vnni_tokens=64, int4_q8_tokens=64, int4_act_bits=bits)
            outs[bits] = _host.run_experts(pool._h, x.view(np.uint16), tok, eid, w, 6, x_bf16=True, unit_start=unit)
    finally:
        set_kernel_knobs(**default)
    assert rel_err(outs[15], want) < 2e-3
    assert rel_err(outs[8], want) < 2e-2
    assert not np.array_equal(outs[8], outs[15])
