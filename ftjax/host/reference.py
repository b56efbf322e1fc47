"""numpy reference of the CPU expert kernel (``cpu_experts`` / ``_host.run_experts``), in float64."""
from __future__ import annotations

import numpy as np


def silu(v):
    return v / (1.0 + np.exp(-v))


def experts_reference(x, token_idx, expert_ids, weights, n_valid, gate_up, down, *, bf16_act: bool = False,
                      unit_start=None):
    """``y[t] += w * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` over the first ``n_valid`` tasks;
    with ``unit_start`` only the intermediate units ``[u, I)`` of each task's expert count.

    gate_up [N, 2I, H] and down [N, H, I] as floats (dequantize int4 first). With ``bf16_act`` the
    SwiGLU intermediate is rounded to bf16, as the kernel does for bf16 activations.
    """
    import ml_dtypes

    x = np.asarray(x, np.float64)
    y = np.zeros(x.shape, np.float64)
    inter = gate_up.shape[1] // 2
    for i in range(int(n_valid)):
        t, e, w = int(token_idx[i]), int(expert_ids[i]), float(weights[i])
        h = np.asarray(gate_up[e], np.float64) @ x[t]
        act = silu(h[:inter]) * h[inter:]
        if bf16_act:
            act = act.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
        if unit_start is not None:
            act[:int(unit_start[i])] = 0.0
        y[t] += w * (np.asarray(down[e], np.float64) @ act)
    return y


def q15_reference(bits):
    """The q15 activation layout (cpp/kernels.h) of one bf16 vector (uint16 bits, length % 8 == 0), as the
    bytes ``_host.q15_layout`` writes: per lane of 8 columns a power-of-two scale 2^-s from the lane's largest
    exponent field e (at least 14), s = 140 - e, q = round-half-even(x * 2^s) = 128 hi + lo; streams hi of the
    even columns, hi of the odd, lo of the even, lo of the odd (int8), -8 * sum(q) per lane (int32), 2^-s per
    lane (float32). Lanes holding an inf or NaN: only their scale is defined (NaN)."""
    bits = np.asarray(bits, np.uint16)
    x = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    e = np.maximum(((bits >> 7) & 0xFF).astype(np.int64).reshape(-1, 8).max(1), 14)
    s = 140 - e
    with np.errstate(invalid="ignore"):
        q = np.rint(x * np.exp2(np.repeat(s, 8)))
        q = np.where(np.isfinite(q), q, 0).astype(np.int64)
    hi = q >> 7
    lo = q - 128 * hi
    lane_scale = np.where(e == 255, np.nan, np.exp2(-s.astype(np.float64))).astype(np.float32)
    return np.concatenate([hi[0::2].astype(np.int8), hi[1::2].astype(np.int8), lo[0::2].astype(np.int8),
                           lo[1::2].astype(np.int8), (-8 * q.reshape(-1, 8).sum(1)).astype(np.int32).view(np.int8),
                           lane_scale.view(np.int8)])


def q8_reference(bits):
    """The q8 form of the layout (cpp/kernels.h, ``int4_act_bits`` 8) of one bf16 vector, as the bytes
    ``_host.q15_layout(bits, 8)`` writes: per lane of 8 columns m = the largest magnitude, q = round-half-even(x *
    f32(127 / m)) (float32 arithmetic), scale f32(m / 127); lanes with m < 2^-100 are zeros (scale 0). Streams q of the
    even columns, q of the odd (int8), two left unwritten (returned as zeros: compare streams 0, 1, 4, 5), -8 * sum(q)
    per lane (int32), the scale (float32; NaN for a lane holding an inf or NaN, whose q are undefined)."""
    bits = np.asarray(bits, np.uint16)
    x = (bits.astype(np.uint32) << 16).view(np.float32)
    m = (bits & 0x7FFF).reshape(-1, 8).max(1)
    live = m >= (27 << 7)
    mf = (m.astype(np.uint32) << 16).view(np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        inv = np.where(live, np.float32(127) / mf, np.float32(0)).astype(np.float32)
        q = np.rint(x * np.repeat(inv, 8))
        q = np.where(np.isfinite(q), q, 0).astype(np.int64)
        scale = np.where(m >= 0x7F80, np.float32(np.nan), np.where(live, mf / np.float32(127), np.float32(0)))
    zero = np.zeros(len(bits) // 2, np.int8)
    return np.concatenate([q[0::2].astype(np.int8), q[1::2].astype(np.int8), zero, zero,
                           (-8 * q.reshape(-1, 8).sum(1)).astype(np.int32).view(np.int8),
                           scale.astype(np.float32).view(np.int8)])
