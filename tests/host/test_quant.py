"""int4 group-32 layout: packing order, round trip, zero groups."""
import numpy as np
import pytest

from ftjax.host import quant


def test_roundtrip_error_is_within_half_a_step():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 5, 64)).astype(np.float32)
    packed, scales = quant.quantize_int4(w)
    assert packed.shape == (3, 5, 32) and packed.dtype == np.uint8
    assert scales.shape == (3, 5, 2) and scales.dtype == quant.BF16
    back = quant.dequantize_int4(packed, scales)
    step = np.repeat(scales.astype(np.float32), 32, -1)
    # bf16 rounding of the scale can push the largest value a little past +-7 steps: clip error.
    assert np.all(np.abs(back - w) <= 0.5 * step + 0.02 * np.abs(w) + 1e-7)


def test_nibble_order_low_is_even_column():
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1] = 7.0, -7.0  # scale 1: q = 15 and 1
    packed, scales = quant.quantize_int4(w)
    assert float(scales[0, 0]) == 1.0
    assert packed[0, 0] == (15 | (1 << 4))
    assert np.all(packed[0, 1:] == (8 | (8 << 4)))


def test_zero_group_and_bad_width():
    packed, scales = quant.quantize_int4(np.zeros((2, 32), np.float32))
    np.testing.assert_array_equal(quant.dequantize_int4(packed, scales), 0.0)
    with pytest.raises(ValueError, match="divisible by 32"):
        quant.quantize_int4(np.ones((2, 40), np.float32))


def test_split_rows_views_the_bank_layout():
    raw = np.zeros((2, quant.matrix_bytes(4, 64)), np.uint8)
    packed, scales = quant.split_rows(raw, 4, 64)
    assert packed.shape == (2, 4, 32) and scales.shape == (2, 4, 2)
    packed[1, 3, 31] = 0xAB
    assert raw[1, 4 * 32 - 1] == 0xAB
