"""int4 group-quantized expert weights: the layout the CPU kernels read, and its numpy reference.

Layout of one ``[rows, cols]`` matrix (torch ``[out, in]``), ``cols % 32 == 0``:

- ``packed`` uint8 ``[rows, cols // 2]``: column ``2j`` in the low nibble of byte ``j``, column
  ``2j + 1`` in the high nibble;
- ``scales`` bfloat16 ``[rows, cols // 32]``: one scale per 32 consecutive inputs of an output row;
- value ``= (q - 8) * scale`` with ``q`` in ``0..15`` (symmetric: ``scale = absmax / 7`` rounded to
  bf16, so quantized values span ``-7..7``; ``q = 0`` is never produced but decodes as ``-8``).

In the host pool one expert's row of a bank is ``packed`` (all rows) followed by ``scales``.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

GROUP = 32
BF16 = np.dtype(ml_dtypes.bfloat16)


def _check_cols(cols: int) -> None:
    if cols % GROUP:
        raise ValueError(f"int4 quantization needs the input dim divisible by {GROUP}, got {cols}")


def quantize_int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w [..., rows, cols]`` (any float) -> ``(packed uint8 [..., rows, cols/2], scales bf16 [..., rows, cols/32])``."""
    w = np.asarray(w, np.float32)
    _check_cols(w.shape[-1])
    g = w.reshape(*w.shape[:-1], -1, GROUP)
    scale = (np.abs(g).max(-1) / 7.0).astype(BF16)
    s = scale.astype(np.float32)[..., None]
    q = np.where(s > 0, np.rint(g / np.where(s > 0, s, 1.0)), 0.0)
    q = (np.clip(q, -8, 7) + 8).astype(np.uint8).reshape(w.shape)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return packed, scale


def dequantize_int4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Inverse of :func:`quantize_int4` (float32)."""
    q = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.float32)
    q[..., 0::2] = packed & 0x0F
    q[..., 1::2] = packed >> 4
    s = np.repeat(np.asarray(scales).astype(np.float32), GROUP, axis=-1)
    return (q - 8.0) * s


def matrix_bytes(rows: int, cols: int) -> int:
    _check_cols(cols)
    return rows * cols // 2 + rows * (cols // GROUP) * 2


def split_rows(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Views ``(packed [N, rows, cols/2], scales [N, rows, cols/32])`` of a bank ``raw [N, bytes]``."""
    n_packed = rows * cols // 2
    if raw.shape[-1] != matrix_bytes(rows, cols):
        raise ValueError(f"int4 bank rows are {raw.shape[-1]} bytes, expected {matrix_bytes(rows, cols)} "
                         f"for a [{rows}, {cols}] matrix")
    packed = raw[:, :n_packed].reshape(raw.shape[0], rows, cols // 2)
    scales = raw[:, n_packed:].view(BF16).reshape(raw.shape[0], rows, cols // GROUP)
    return packed, scales
