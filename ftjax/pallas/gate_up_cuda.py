"""The prefill's gate+up kernel with the input-row gather fused in, as a CUDA FFI call (Hopper), beside its
jnp reference. The prefill's ``gather="fused"``.

`prefill_gemm` computes kernel 1 (gate+up with SwiGLU) on ``x_rows``, a copy of ``x`` in expert order
(`routing.gather_input_rows`): at 8K tokens (Qwen3.6 shape, 256 experts top-8) ~0.27 GB written by XLA's
take and read back by the Mosaic GPU kernel, which is DRAM-bound there (session 16). Hopper's TMA has no row
gather, and a TMA box per row and 64-column slice ran 3.88x slower (session 11), so this kernel is CUDA
(`cpp/prefill_gate_up_cuda.cu`, sm_90a): its producer warpgroup reads each row tile's rows straight from
``x`` through ``token_of_input_row`` by cp.async into the 128-byte-swizzled layout that WGMMA reads (the
weights by TMA), and two consumer warpgroups run one m64n256k16 WGMMA per 16 reduction columns (128 gate +
128 up weight rows per work item). Same tables, same output layout (`act [R_pad, I]` bf16, rows past a tile's
routes undefined) as the Mosaic kernel, so the down kernel and the combine are unchanged.

Needs a CUDA build of the host module with the sm_90a part, an sm_90 GPU (H100 / H200), bf16 weights,
128-row tiles, ``H % 64 == 0`` and ``I % 128 == 0`` (`check`).

Measured on the H200 (`bench/gate_up_fused.py`, `bench/kernels.py --pipelines`, bench/RESULTS.md): at 8K tokens
(Qwen3.6 shape) kernel 1 took 0.58-0.59 ms in session 23 against 0.64-0.65 for XLA's take + the Mosaic kernel (0.53
for that kernel alone, on rows already gathered), reading 2.07-2.22 GB from HBM (Nsight Compute) against the Mosaic
kernel's 1.55-1.63. Walking the tiles in expert bands of 2 row tiles (the prefill's ``walk_band="auto"`` for this
kernel) cut that to 1.65 GB, and the SMEM epilogue (whole-row stores) took a further ~4%: 0.558 ms (session 24).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

TARGET = "ftjax_prefill_gate_up"
TILE_M = 128  # rows per row tile (the route tables' tile)
BLOCK_N = 128  # act columns per work item
TILE_K = 64  # reduction columns per pipeline stage


def reference_gate_up(x, token_of_input_row, tile_slot, tile_row0, tile_rows, w, *, tile=TILE_M):
    """``act [M * tile, I]`` fp32: row tile m's rows ``silu(x_r @ Wg^T) * (x_r @ Wu^T)`` with ``x_r`` the
    tokens of input rows ``tile_row0[m] ..`` and ``W = w[tile_slot[m]]``; rows past ``tile_rows[m]``
    zero (the kernel leaves them undefined)."""
    inter = w.shape[1] // 2
    hi = lax.Precision.HIGHEST
    rows = tile_row0[:, None] + jnp.arange(tile, dtype=jnp.int32)[None, :]  # [M, tile]
    tokens = token_of_input_row[jnp.clip(rows, 0, token_of_input_row.shape[0] - 1)]
    xr = x.astype(jnp.float32)[tokens]  # [M, tile, H]
    wt = w.astype(jnp.float32)[tile_slot]  # [M, 2I, H]
    gu = jnp.einsum("mrh,mih->mri", xr, wt, precision=hi)
    act = jax.nn.silu(gu[..., :inter]) * gu[..., inter:]
    live = jnp.arange(tile)[None, :, None] < tile_rows[:, None, None]
    return jnp.where(live, act, 0.0).reshape(-1, inter)


def built() -> bool:
    """Whether this build of the host module has the target (a CUDA build with the sm_90a part)."""
    from ftjax import _host

    return TARGET in _host.ffi_handlers().get("CUDA", {})


def available() -> bool:
    """Whether the call can run here: the target built, JAX's GPU backend, an sm_90 device."""
    from ftjax.host import cuda

    if not (built() and cuda.available()):
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"


def check(*, hidden: int, inter: int, tile_m: int, tile_n_gate_up: int, int4: bool, interpret: bool) -> None:
    """Raise ValueError naming why ``gather="fused"`` cannot run with these options here."""
    reasons = why_not(hidden=hidden, inter=inter, tile_m=tile_m, tile_n_gate_up=tile_n_gate_up, int4=int4,
                      interpret=interpret)
    if reasons:
        raise ValueError("gather='fused': " + "; ".join(reasons) + "; use gather='xla'")


def why_not(*, hidden: int, inter: int, tile_m: int, tile_n_gate_up: int, int4: bool, interpret: bool) -> list:
    """The reasons ``gather="fused"`` cannot run with these options here (empty: it can)."""
    reasons = []
    if int4:
        reasons.append("it takes bf16 weights only (use prefill_experts, not the int4 entry)")
    if tile_m != TILE_M:
        reasons.append(f"it needs tile_m={TILE_M}, got {tile_m}")
    if 2 * tile_n_gate_up != BLOCK_N:
        reasons.append(f"it computes {BLOCK_N} act columns per work item: tile_n_gate_up must be "
                       f"{BLOCK_N // 2}, got {tile_n_gate_up}")
    if hidden % TILE_K or inter % BLOCK_N:
        reasons.append(f"it needs H % {TILE_K} == 0 and I % {BLOCK_N} == 0, got H {hidden}, I {inter}")
    if interpret:
        reasons.append("it is a CUDA kernel: no interpret mode")
    elif not available():
        reasons.append("it needs a CUDA build of ftjax._host with the sm_90a part and an sm_90 GPU "
                       "(H100 / H200) on JAX's GPU backend")
    return reasons


L2_KEEP_BYTES = 24 << 20  # x-row bytes marked L2 evict_last by default (of the H100 / H200's 50 MiB of L2)


def default_x_keep(x_shape, itemsize=2) -> float:
    """The fraction of x's row reads marked L2 evict_last by default: ``L2_KEEP_BYTES / x bytes``, at most 1."""
    nbytes = int(np.prod(x_shape)) * itemsize
    return min(1.0, L2_KEEP_BYTES / max(nbytes, 1))


W_PROMOTIONS = {"none": 0, "64": 1, "128": 2, "256": 3}  # the weights' TMA L2 promotion (CUtensorMapL2promotion)


EPILOGUES = ("direct", "smem")
SILUS = ("exp", "tanh")  # the epilogue's sigmoid: 1 / (1 + exp(-g)) (two MUFU ops) or 0.5 (1 + tanh(g / 2)) (one)


OPTIONS = ("x_keep", "stages", "w_promotion", "epilogue", "silu")  # `gate_up`'s kernel options


def check_options(*, x_keep=None, stages=4, w_promotion="256", epilogue="smem", silu="exp") -> None:
    """Raise ValueError naming the first of `gate_up`'s kernel options out of its range."""
    if x_keep is not None and not (isinstance(x_keep, (int, float)) and 0.0 <= x_keep <= 1.0):
        raise ValueError(f"x_keep must be in [0, 1], got {x_keep}")
    if stages not in (3, 4):
        raise ValueError(f"stages must be 3 or 4, got {stages}")
    if w_promotion not in W_PROMOTIONS:
        raise ValueError(f"w_promotion must be one of {tuple(W_PROMOTIONS)}, got {w_promotion!r}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if silu not in SILUS:
        raise ValueError(f"silu must be one of {SILUS}, got {silu!r}")


def kernel_options(options) -> dict:
    """``options`` (None, a dict or ``(name, value)`` pairs: the prefill's hashable form) as `gate_up` keywords,
    checked (ValueError for an unknown name or a value out of range)."""
    opts = dict(options or ())
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown fused kernel option(s) {unknown}: the options are {OPTIONS}")
    check_options(**opts)
    return opts


def gate_up(x, tables, w, *, num_sms: int, x_keep: float | None = None, stages: int = 4,
            w_promotion: str = "256", epilogue: str = "smem", silu: str = "exp"):
    """Kernel 1 of the prefill on ``x [T, H]`` bf16 (T >= 1) with the route tables (`route_tables`, tile
    128) and ``w [S, 2I, H]`` bf16 -> ``act [R_pad, I]`` bf16 (`check` first).

    ``x_keep``: the fraction of the x-row reads marked L2 ``evict_last`` (each row is read by ``k`` row
    tiles at different times, while the weights stream through L2); None: `default_x_keep`; 0: no hint.
    ``stages``: the SMEM ring's depth, 3 or 4 (48 KiB each). ``w_promotion``: the L2 fetch size of the
    weight tiles' TMA reads (``"none"``, ``"64"``, ``"128"``, ``"256"`` bytes). ``epilogue``: the act rows
    stored through a per-warpgroup SMEM tile as whole 256-byte row pieces (``"smem"``, default: +32 KiB of SMEM)
    or by each thread straight from its accumulator registers (``"direct"``: 4-byte stores, 16-byte runs).
    ``silu``: the sigmoid in ``silu(g) = g * sigmoid(g)`` as ``1 / (1 + exp(-g))`` (``"exp"``, default: ex2 and
    rcp, two MUFU ops) or ``0.5 (1 + tanh(g / 2))`` (``"tanh"``: one ``tanh.approx.f32``, absolute error ~5e-4
    in the sigmoid, up to one bf16 step off the exp form; no clear gain measured, session 24).
    """
    from ftjax.host.ffi import register_targets

    register_targets()
    n_row_tiles = tables.tile_slot.shape[0]
    inter = w.shape[1] // 2
    n_blocks = inter // BLOCK_N
    check_options(x_keep=x_keep, stages=stages, w_promotion=w_promotion, epilogue=epilogue, silu=silu)
    walk = tables.walks[0]
    use_walk = walk is not None
    if walk is None:
        walk = jnp.zeros((1,), jnp.int32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((n_row_tiles * TILE_M, inter), jnp.bfloat16))
    return call(x.astype(jnp.bfloat16), tables.token_of_input_row, tables.tile_slot, tables.tile_row0,
                tables.tile_rows, tables.n_launch, walk, w.astype(jnp.bfloat16),
                n_blocks=np.int64(n_blocks), use_walk=np.int64(use_walk), grid=np.int64(num_sms),
                x_keep=np.float32(default_x_keep(x.shape) if x_keep is None else x_keep), stages=np.int64(stages),
                w_promotion=np.int64(W_PROMOTIONS[w_promotion]), epilogue_smem=np.int64(epilogue == "smem"),
                silu_tanh=np.int64(silu == "tanh"))
