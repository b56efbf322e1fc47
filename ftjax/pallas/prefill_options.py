"""Option checks and resolution of the prefill kernels (`prefill_gemm`): tile sizes against the SMEM
and TMA limits, the routing arguments' shapes, and the per-kernel pipeline and walk settings.

`resolve_tiles` turns the keyword options of `prefill_gemm.prefill_experts` into the static tuple
the kernels take, raising ValueError that names the offending size and what would be valid. Per
kernel, ``stages`` and ``cross_tile`` are one value or a ``(gate_up, down)`` pair; ``walk_band`` is
``"auto"``, None, an int or such a pair (`walk_bands`).
"""
from __future__ import annotations

import jax

from ftjax.pallas import gate_up_cuda
from ftjax.pallas.int4 import GROUP as QUANT_GROUP
from ftjax.pallas.route_tables import IMPLS as PLAN_IMPLS

SCALE_BLOCK = 8  # scale columns per TMA copy: 8 bf16 = the 16-byte TMA minimum = 256 inputs
SMEM_LIMIT_BYTES = 232448  # H100/H200 per-block shared memory (227 KiB)
WG_ROWS = 64  # WGMMA M granularity per warpgroup
EPI_N = 64  # epilogue SMEM tile width (columns)
TMA_MAX_BOX = 256  # elements per dimension of one TMA copy


def plgpu_module():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def default_num_sms() -> int:
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            return int(dev.core_count)
    except (RuntimeError, AttributeError):
        pass
    return 132  # H100 / H200 SXM


def check_tiles(*, what, n_out, k_dim, tile_m, tile_n, tile_k, stages, int4, n_b):
    """Raise ValueError naming the offending size and what would be valid; return SMEM bytes."""
    if tile_m % WG_ROWS or tile_m <= 0:
        raise ValueError(f"tile_m must be a positive multiple of {WG_ROWS} (WGMMA rows per "
                         f"warpgroup), got {tile_m}")
    if tile_n % 8 or tile_n <= 0 or (tile_n > EPI_N and tile_n % EPI_N):
        raise ValueError(f"{what}: tile_n must be a multiple of 8, and of {EPI_N} above {EPI_N}, "
                         f"got {tile_n}")
    if tile_k not in (32, 64, 128, 256) or (int4 and tile_k < 64):
        valid = "64, 128, 256" if int4 else "32, 64, 128, 256"
        raise ValueError(f"{what}: tile_k must be one of {valid}, got {tile_k}")
    if stages < 2:
        raise ValueError(f"stages must be >= 2, got {stages}")
    cta_n = 2 * tile_n
    if n_out % cta_n:
        raise ValueError(f"{what}: the output dim {n_out} must be a multiple of 2 * tile_n = "
                         f"{cta_n} (two compute warpgroups); pick tile_n dividing {n_out // 2}")
    if k_dim % tile_k:
        raise ValueError(f"{what}: the reduction dim {k_dim} must be a multiple of tile_k = "
                         f"{tile_k}")
    if int4 and tile_n % WG_ROWS:
        raise ValueError(f"{what}: int4 needs tile_n to be a multiple of {WG_ROWS} (dequantized "
                         f"rows are a WGMMA-layout register tile), got {tile_n}")
    if int4 and cta_n > TMA_MAX_BOX:
        raise ValueError(f"{what}: int4 needs 2 * tile_n <= {TMA_MAX_BOX} (the scale block is "
                         f"one TMA copy of 2 * tile_n rows), got tile_n = {tile_n}")
    if int4 and k_dim % (QUANT_GROUP * SCALE_BLOCK):
        raise ValueError(f"{what}: int4 needs the input dim divisible by "
                         f"{QUANT_GROUP * SCALE_BLOCK} (8 scale groups per copy), got {k_dim}")
    a_bytes = tile_m * tile_k * 2
    w_bytes = n_b * cta_n * tile_k // 2 if int4 else n_b * cta_n * tile_k * 2
    s_bytes = n_b * cta_n * SCALE_BLOCK * 2 if int4 else 0
    deq_bytes = 2 * n_b * tile_n * tile_k * 2 if int4 else 0
    epi_bytes = 2 * tile_m * min(tile_n, EPI_N) * 2
    smem = stages * (a_bytes + w_bytes + s_bytes) + deq_bytes + epi_bytes
    if smem > SMEM_LIMIT_BYTES - 1024:
        raise ValueError(f"{what}: tile_m={tile_m}, tile_n={tile_n}, tile_k={tile_k}, "
                         f"stages={stages} needs {smem} bytes of SMEM, over the "
                         f"{SMEM_LIMIT_BYTES} available; lower stages or the tiles")
    return smem


def check_routing(x, expert_ids, gate_weights, token_valid, slot_of_expert):
    num_tokens = x.shape[0]
    if expert_ids.ndim != 2 or expert_ids.shape[0] != num_tokens:
        raise ValueError(f"expert_ids must be [T={num_tokens}, k], got {expert_ids.shape}")
    if gate_weights.shape != expert_ids.shape:
        raise ValueError(f"gate_weights {gate_weights.shape} must match expert_ids "
                         f"{expert_ids.shape}")
    if token_valid.shape not in ((num_tokens,), expert_ids.shape):
        raise ValueError(f"token_valid must be [{num_tokens}] (per token) or {list(expert_ids.shape)} "
                         f"(per route), got {token_valid.shape}")
    if slot_of_expert.ndim != 1:
        raise ValueError(f"slot_of_expert must be [E], got {slot_of_expert.shape}")


GATHERS = ("auto", "tma", "xla", "fused")


def has_pipeline_of_pipelines() -> bool:
    """This jax's Mosaic GPU pipelines take ``pipeline_state`` (START / STEADY / STOP)."""
    import inspect

    try:
        plgpu = plgpu_module()
    except ImportError:  # no Mosaic GPU in this jax: the kernels cannot run here at all
        return False
    return hasattr(plgpu, "PipelinePipeline") and "pipeline_state" in inspect.signature(
        plgpu.emit_pipeline_warp_specialized).parameters


AUTO_WALK_BAND = 2  # "auto": this band for a kernel of >= AUTO_WALK_MIN_BLOCKS output blocks
AUTO_WALK_MIN_BLOCKS = 16


def walk_bands(walk_band, n_blocks=(1, 1), fused=False):
    """``walk_band`` as ``(gate_up band, down band)``, each None (the default walk) or >= 1;
    ``n_blocks``: the two kernels' output-column blocks, for ``"auto"``; ``fused``: kernel 1 is the fused CUDA
    call (`gate_up_cuda`).

    ``"auto"``: band 2 for a kernel of 16 or more output blocks and for the fused kernel 1, else None. On the
    H200 (session 20, 8K and 16K tokens, 256 experts top-8) band 2 lifted the DeepSeek-like shape (16 and 16
    blocks, 32 + 16 MiB of weights per expert) from 0.53-0.59 to 0.62-0.66 of the matmul ceiling
    at 8K, 0.62-0.64 to 0.72-0.73 at 16K, and moved the Qwen3.6 shape's Mosaic kernels (4 and 8 blocks) by -0.03
    to +0.00. The fused kernel 1 at the Qwen3.6 shape (4 blocks of 128 act columns) read 2.07 GB from HBM
    walking the output blocks fastest and 1.65 GB in bands of 2 (Nsight Compute, 8K tokens), and ran 3-4% faster
    (session 24; band 4: 5-10% slower).
    """
    if walk_band == "auto":
        return tuple(AUTO_WALK_BAND if n >= AUTO_WALK_MIN_BLOCKS or (fused and i == 0) else None
                     for i, n in enumerate(n_blocks))
    bands = walk_band if isinstance(walk_band, tuple) else (walk_band, walk_band)
    ok = len(bands) == 2 and all(b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 1)
                                 for b in bands)
    if not ok:
        raise ValueError(f"walk_band must be \"auto\", None, a positive int or a (gate_up, down) "
                         f"pair of None / positive ints, got {walk_band!r}")
    return bands


def per_kernel(value, name):
    """An option given once for both kernels, or as a ``(gate_up, down)`` pair: the pair."""
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(f"{name} as a tuple must be a (gate_up, down) pair, got {value!r}")
        return value
    return (value, value)


def resolve_tiles(hidden, inter, *, int4, tile_m, tile_n_gate_up, tile_n_down, tile_k,
                      stages, num_sms, interpret, cross_tile, gather, walk_band, plan_impl="auto"):
    if plan_impl not in PLAN_IMPLS:
        raise ValueError(f"plan_impl must be one of {PLAN_IMPLS}, got {plan_impl!r}")
    if gather not in GATHERS:
        raise ValueError(f"gather must be one of {GATHERS}, got {gather!r}")
    if gather in ("fused", "auto"):
        fused = dict(hidden=hidden, inter=inter, tile_m=tile_m, tile_n_gate_up=tile_n_gate_up, int4=int4,
                     interpret=interpret)
        if gather == "fused":
            gate_up_cuda.check(**fused)
        else:  # "auto": fused where it can run (sm_90, bf16, the default tiles), else XLA's take
            gather = "xla" if gate_up_cuda.why_not(**fused) else "fused"
    walk_band = walk_bands(walk_band, (inter // (2 * tile_n_gate_up), hidden // (2 * tile_n_down)),
                           fused=gather == "fused")
    stages, cross_tile = per_kernel(stages, "stages"), per_kernel(cross_tile, "cross_tile")
    if not all(isinstance(st, int) and not isinstance(st, bool) for st in stages):
        raise ValueError(f"stages must be an int or a (gate_up, down) pair of ints, got {stages!r}")
    kernels = (("gate_up", inter, hidden, tile_n_gate_up, 2, "H"), ("down", hidden, inter, tile_n_down,
                                                                    1, "I"))
    cross = []
    for (what, n_out, k_dim, tile_n, n_b, k_name), st, ct in zip(kernels, stages, cross_tile):
        check_tiles(what=what, n_out=n_out, k_dim=k_dim, tile_m=tile_m, tile_n=tile_n, tile_k=tile_k,
                     stages=st, int4=int4, n_b=n_b)
        divisible = (k_dim // tile_k) % st == 0
        if ct is None:
            ct = divisible and has_pipeline_of_pipelines()
        elif ct and not divisible:
            raise ValueError(f"{what}: cross_tile needs the reduction's step count ({k_name} / tile_k "
                             f"= {k_dim // tile_k}) divisible by stages = {st}; pick stages dividing "
                             f"it, or cross_tile=False")
        elif ct and not has_pipeline_of_pipelines():
            raise ValueError(f"cross_tile needs Mosaic GPU's pipeline_state (jax {jax.__version__} "
                             f"has none); use cross_tile=False")
        cross.append(bool(ct))
    if num_sms is None:
        num_sms = default_num_sms()
    return (tile_m, tile_n_gate_up, tile_n_down, tile_k, stages, num_sms, interpret,
            tuple(cross), gather, walk_band, plan_impl)
