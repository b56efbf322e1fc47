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
