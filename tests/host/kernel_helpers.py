"""Helpers the CPU kernel tests share (tests/host/test_kernels.py, test_q15.py): the tiers, a filled pool with its
float reference weights, the relative error."""
import ml_dtypes
import numpy as np

from ftjax.host import HostPool, available_tiers, quant

TIERS = available_tiers()
BF16 = np.dtype(ml_dtypes.bfloat16)


def make_pool(rng, fmt, n, hidden, inter):
    banks = {"gate_up": rng.standard_normal((n, 2 * inter, hidden)).astype(np.float32) * 0.2,
             "down": rng.standard_normal((n, hidden, inter)).astype(np.float32) * 0.2}
    if fmt == "bf16":
        banks = {k: v.astype(BF16) for k, v in banks.items()}
    pool = HostPool(n, hidden, inter, fmt).fill(banks)
    if fmt == "int4":  # the reference multiplies the dequantized weights
        ref = {b: quant.dequantize_int4(*pool.int4_parts(b)) for b in ("gate_up", "down")}
    else:
        ref = {b: pool.bank(b).astype(np.float32) for b in ("gate_up", "down")}
    return pool, ref


def rel_err(y, ref):
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))
