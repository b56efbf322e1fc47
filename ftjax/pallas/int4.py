"""The int4 weight layout the Pallas kernels read (the host pool's, `ftjax.host.quant`) in jnp.

``packed uint8 [..., rows, cols/2]`` (column 2j in the low nibble of byte j, 2j+1 in the high one) and
``scales bf16 [..., rows, cols/GROUP]``; value ``(q - 8) * scale``.
"""
from __future__ import annotations

import jax.numpy as jnp

from ftjax.host.quant import GROUP  # int4 inputs per scale


def dequantize_int4(packed, scales):
    """fp32 ``[..., rows, cols]``: the jnp twin of `ftjax.host.quant.dequantize_int4`."""
    q = jnp.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    s = jnp.repeat(scales.astype(jnp.float32), GROUP, axis=-1)
    return (q.astype(jnp.float32) - 8.0) * s
