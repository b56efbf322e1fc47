"""Decode grouped GEMV (ftjax.pallas.decode_gemv), bf16 and int4, against its jnp references: in
Mosaic GPU interpret mode on the CPU (skips where this jax has none, e.g. jax 0.10.2), lowered for
CUDA (sm_90) on any machine, and compiled on a Hopper GPU (marked gpu)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.host.quant import dequantize_int4 as np_dequantize_int4
from ftjax.host.quant import matrix_bytes, quantize_int4
from ftjax.pallas.decode_gemv import (
    decode_bytes_read,
    decode_experts,
    decode_experts_int4,
    reference_decode_experts,
    reference_decode_experts_int4,
)


def _on_hopper():
    try:
        dev = jax.devices()[0]
        return jax.default_backend() == "gpu" and getattr(dev, "compute_capability", "") == "9.0"
    except RuntimeError:
        return False


def _inputs(seed, *, T, H, I, S, R, x_dtype=jnp.bfloat16, dup=False):
    k = jax.random.split(jax.random.key(seed), 4)
    x = (jax.random.normal(k[0], (T, H)) + 0.1).astype(x_dtype)
    gate_up = (jax.random.normal(k[1], (S, 2 * I, H)) / np.sqrt(H) + 0.01).astype(jnp.bfloat16)
    down = (jax.random.normal(k[2], (S, H, I)) / np.sqrt(I) + 0.01).astype(jnp.bfloat16)
    slots = np.array(jax.random.permutation(k[3], max(S, R))[:R] % S, np.int32)
    if dup:
        slots[1::2] = slots[0]
    tokens = np.arange(R, dtype=np.int32) % T
    return x, jnp.asarray(slots), jnp.asarray(tokens), gate_up, down


def _quantize(gate_up, down):
    """int4 banks (host pool layout) of bf16 banks: gu_packed, gu_scales, d_packed, d_scales."""
    gp, gs = quantize_int4(np.asarray(gate_up, np.float32))
    dp, ds = quantize_int4(np.asarray(down, np.float32))
    return tuple(jnp.asarray(a) for a in (gp, gs, dp, ds))


def _check(out, ref, n_valid):
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.dtype == np.float32 and out.shape == ref.shape
    assert np.all(out[n_valid:] == 0.0)
    if n_valid:
        scale = np.max(np.abs(ref[:n_valid]))
        assert scale > 0
        np.testing.assert_allclose(out[:n_valid], ref[:n_valid], rtol=0, atol=1e-2 * scale)


# --------------------------------------------------------------------------------------------
# references and helpers (plain jnp / numpy)

def test_reference_matches_numpy_loop():
    x, slots, tokens, gate_up, down = _inputs(0, T=2, H=12, I=6, S=3, R=4)
    n_valid = 3
    ref = np.asarray(reference_decode_experts(x, slots, tokens, jnp.int32(n_valid), gate_up, down))
    xs, gu, dn = (np.asarray(a, np.float64) for a in (x, gate_up, down))
    for r in range(4):
        s, t = int(slots[r]), int(tokens[r])
        h = gu[s] @ xs[t]
        g, u = h[:6], h[6:]
        want = dn[s] @ (g / (1 + np.exp(-g)) * u) if r < n_valid else np.zeros(12)
        np.testing.assert_allclose(ref[r], want, rtol=1e-5, atol=1e-5)


def test_int4_reference_dequantizes_like_host_layout():
    x, slots, tokens, gate_up, down = _inputs(1, T=2, H=64, I=32, S=3, R=4, dup=True)
    banks = _quantize(gate_up, down)
    gu = np_dequantize_int4(np.asarray(banks[0]), np.asarray(banks[1]))
    dn = np_dequantize_int4(np.asarray(banks[2]), np.asarray(banks[3]))
    nv = jnp.int32(3)
    want = reference_decode_experts(x, slots, tokens, nv, jnp.asarray(gu), jnp.asarray(dn))
    got = reference_decode_experts_int4(x, slots, tokens, nv, *banks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_decode_bytes_read():
    H, I = 2048, 512
    assert decode_bytes_read(8, H, I) == 8 * 3 * H * I * 2 == 8 * 6 * 2**20
    int4_route = matrix_bytes(2 * I, H) + matrix_bytes(H, I)
    assert decode_bytes_read(5, H, I, int4=True) == 5 * int4_route
    assert decode_bytes_read(0, H, I) == 0


# --------------------------------------------------------------------------------------------
# interpret mode (CPU)

@pytest.mark.parametrize("n_valid", [0, 2])
def test_decode_experts_unused_entries_may_be_negative(n_valid, mgpu_interpret):
    """Entries past n_valid hold -1 (as the offload plan leaves them); count 0 launches with one
    clamped route and returns zeros, without a lax.cond around the kernel (see decode_gemv's docstring)."""
    x, slots, tokens, gate_up, down = _inputs(2, T=2, H=64, I=32, S=3, R=4)
    slots = jnp.where(jnp.arange(4) < n_valid, slots, -1)
    tokens = jnp.where(jnp.arange(4) < n_valid, tokens, -1)
    nv = jnp.int32(n_valid)
    out = decode_experts(x, slots, tokens, nv, gate_up, down, interpret=True)
    ref = reference_decode_experts(x, jnp.maximum(slots, 0), jnp.maximum(tokens, 0), nv, gate_up, down)
    _check(out, ref, n_valid)
    jaxpr = jax.make_jaxpr(functools.partial(decode_experts, interpret=True))(x, slots, tokens, nv, gate_up, down)
    assert "cond" not in _outer_primitives(jaxpr.jaxpr)


def _outer_primitives(jaxpr):
    """Primitive names of a jaxpr and its nested jit calls, not looking inside kernels."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name != "pallas_call":
            for v in eqn.params.values():
                inner = getattr(v, "jaxpr", None)
                if inner is not None:
                    names |= _outer_primitives(getattr(inner, "jaxpr", inner))
    return names


@pytest.mark.parametrize(
    "case",
    [
        # odd sizes (3 gate steps, 3 down steps, 3 chunks), more steps than stages, partial count
        dict(T=3, H=192, I=96, S=5, R=6, n_valid=4, kw=dict(num_stages=2)),
        # count = capacity, duplicate slots, f32 activations, 64-row chunks (M = 128)
        dict(T=2, H=128, I=64, S=3, R=6, n_valid=6, dup=True, x_dtype=jnp.float32,
             kw=dict(block_i=64, block_k=64, block_h=64, num_stages=1)),
        # one route, the smallest sizes
        dict(T=1, H=64, I=32, S=2, R=1, n_valid=1, kw={}),
        # count 0
        dict(T=2, H=64, I=32, S=2, R=3, n_valid=0, kw={}),
    ],
    ids=["odd-partial", "full-dup-f32-bi64", "tiny", "count0"],
)
def test_decode_experts_matches_reference(case, mgpu_interpret):
    case = dict(case)
    n_valid, kw = case.pop("n_valid"), case.pop("kw")
    x, slots, tokens, gate_up, down = _inputs(1, **case)
    nv = jnp.int32(n_valid)
    out = decode_experts(x, slots, tokens, nv, gate_up, down, interpret=True, **kw)
    _check(out, reference_decode_experts(x, slots, tokens, nv, gate_up, down), n_valid)


@pytest.mark.parametrize(
    "case",
    [
        # one stage: every gate and down step refills it; 8 chunks, partial count
        dict(T=3, H=512, I=256, S=5, R=3, n_valid=2,
             kw=dict(block_k=256, block_h=256, num_stages=1)),
        # default tiles: 2 dequantized sub-steps per gate stage, 2 wgmmas per down stage
        dict(T=1, H=512, I=256, S=2, R=1, n_valid=1, kw={}),
        # odd sizes (3 x 256), count = capacity, duplicate slots, 64-row chunks (2 groups each),
        # two down scale windows of 8 groups
        dict(T=2, H=768, I=512, S=3, R=2, n_valid=2, dup=True, x_dtype=jnp.float32,
             kw=dict(block_i=64, block_k=256, num_stages=2)),
        # count 0
        dict(T=1, H=256, I=256, S=2, R=2, n_valid=0, kw={}),
    ],
    ids=["partial-refill", "default-tiles", "odd-full-dup-bi64", "count0"],
)
def test_decode_experts_int4_matches_reference(case, mgpu_interpret):
    case = dict(case)
    n_valid, kw = case.pop("n_valid"), case.pop("kw")
    x, slots, tokens, gate_up, down = _inputs(2, **case)
    banks = _quantize(gate_up, down)
    nv = jnp.int32(n_valid)
    out = decode_experts_int4(x, slots, tokens, nv, *banks, interpret=True, **kw)
    _check(out, reference_decode_experts_int4(x, slots, tokens, nv, *banks), n_valid)


@pytest.mark.parametrize("int4", [False, True], ids=["bf16", "int4"])
def test_decode_experts_units_match_reference(int4, mgpu_interpret):
    """Per-route units (the offload unit split): route r sums units [0, u_r) of its slot only: u = 0
    (route 0, whose block (0, 0) still runs), block-aligned, inside a block (int4: an odd u, which tells
    the chunk's even and odd halves apart), all units, and an invalid route; the rows past u of one route's
    own slot hold NaN (stale rows must be zeroed, never multiplied)."""
    if int4:
        T, H, I, R, n_valid, units = 2, 512, 256, 6, 5, [0, 32, 49, 256, 200, 64]
    else:
        T, H, I, R, n_valid, units = 3, 128, 96, 6, 5, [0, 8, 40, 96, 64, 17]
    x, _, tokens, gate_up, down = _inputs(5, T=T, H=H, I=I, S=R, R=R)
    slots = jnp.arange(R, dtype=jnp.int32)  # one slot per route
    units = jnp.asarray(units, jnp.int32)
    nv = jnp.int32(n_valid)
    if int4:
        banks = _quantize(gate_up, down)
        out = decode_experts_int4(x, slots, tokens, nv, *banks, units, interpret=True, block_k=256, block_h=256)
        ref = reference_decode_experts_int4(x, slots, tokens, nv, *banks, units)
        whole = reference_decode_experts_int4(x, slots, tokens, nv, *banks)
    else:
        u = int(units[2])
        stale = jnp.arange(2 * I)
        stale = ((stale % I) >= u)[:, None]  # gate rows and up rows past u
        gate_up = gate_up.at[2].set(jnp.where(stale, jnp.nan, gate_up[2]).astype(jnp.bfloat16))
        out = decode_experts(x, slots, tokens, nv, gate_up, down, units, interpret=True, block_i=32, block_k=64,
                             block_h=64)
        ref = reference_decode_experts(x, slots, tokens, nv, gate_up, down, units)
        whole = None
    _check(out, ref, n_valid)
    assert not np.any(np.asarray(out)[0])  # u = 0
    if whole is not None:  # the masks change the partially kept routes
        assert not np.allclose(np.asarray(ref)[1:3], np.asarray(whole)[1:3])
        np.testing.assert_allclose(np.asarray(out)[3], np.asarray(whole)[3], rtol=0,
                                   atol=1e-2 * np.abs(np.asarray(whole)[3]).max())


def test_device_count_one_compile(mgpu_interpret):
    """n_valid is a traced device scalar: one compiled function serves every count."""
    x, slots, tokens, gate_up, down = _inputs(2, T=4, H=64, I=32, S=4, R=5, dup=True)
    fn = jax.jit(functools.partial(decode_experts, interpret=True))
    for n_valid in (0, 3, 5):
        nv = jnp.int32(n_valid)
        out = fn(x, slots, tokens, nv, gate_up, down)
        _check(out, reference_decode_experts(x, slots, tokens, nv, gate_up, down), n_valid)
    assert fn._cache_size() == 1


@pytest.mark.parametrize("int4", [False, True], ids=["bf16", "int4"])
def test_interpret_pipeline_is_race_free(int4, mgpu_interpret):
    """One SMEM stage per ring, so every step refills the stage just consumed: the interpret-mode
    race detector checks the TMA writes against the wgmma and register reads of that stage."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
    except ImportError as e:
        pytest.skip(f"no Mosaic GPU interpret race detector here: {e!r}")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    H, I = (512, 256) if int4 else (128, 64)
    x, slots, tokens, gate_up, down = _inputs(4, T=2, H=H, I=I, S=3, R=2)
    nv = jnp.int32(2)
    kw = dict(block_k=256 if int4 else 64, block_h=256 if int4 else 64, num_stages=1,
              interpret=plgpu.InterpretGPUParams(detect_races=True))
    if int4:
        banks = _quantize(gate_up, down)
        out = decode_experts_int4(x, slots, tokens, nv, *banks, **kw)
        ref = reference_decode_experts_int4(x, slots, tokens, nv, *banks)
    else:
        out = decode_experts(x, slots, tokens, nv, gate_up, down, **kw)
        ref = reference_decode_experts(x, slots, tokens, nv, gate_up, down)
    _check(out, ref, 2)
    assert not get_races().races_found


# --------------------------------------------------------------------------------------------
# validation

def _sds(*shapes_dtypes):
    return [jax.ShapeDtypeStruct(s, d) for s, d in shapes_dtypes]


def _bf16_args(T, H, I, S, R, bank_dtype=jnp.bfloat16):
    return _sds(((T, H), jnp.bfloat16), ((R,), jnp.int32), ((R,), jnp.int32), ((), jnp.int32),
                ((S, 2 * I, H), bank_dtype), ((S, H, I), bank_dtype))


def _int4_args(T, H, I, S, R):
    return _sds(((T, H), jnp.bfloat16), ((R,), jnp.int32), ((R,), jnp.int32), ((), jnp.int32),
                ((S, 2 * I, H // 2), jnp.uint8), ((S, 2 * I, H // 32), jnp.bfloat16),
                ((S, H, I // 2), jnp.uint8), ((S, H, I // 32), jnp.bfloat16))


@pytest.mark.parametrize(
    "fn, args, kw, match",
    [
        (decode_experts, _bf16_args(1, 100, 64, 2, 2), {}, "multiple of 64, got H=100"),
        (decode_experts, _bf16_args(1, 128, 48, 2, 2), {}, "multiple of 32, got I=48"),
        (decode_experts, _bf16_args(1, 128, 64, 2, 2, jnp.float32), {}, "gate_up must be bfloat16"),
        (decode_experts, _bf16_args(1, 128, 64, 2, 2), dict(block_i=16), "block_i must be 32"),
        (decode_experts, _bf16_args(1, 2048, 512, 2, 2), dict(num_stages=8), "bytes of SMEM"),
        (decode_experts_int4, _int4_args(1, 320, 256, 2, 2), {}, "multiple of 256, got H=320"),
        (decode_experts_int4, _int4_args(1, 512, 96, 2, 2), {}, "multiple of 256, got I=96"),
    ],
    ids=["bf16-H", "bf16-I", "bf16-dtype", "block_i", "smem", "int4-H", "int4-I"],
)
def test_invalid_sizes_raise(fn, args, kw, match):
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(functools.partial(fn, **kw), *args)


def test_units_need_one_entry_per_route():
    args = _bf16_args(1, 64, 32, 2, 3) + _sds(((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"one entry per route \(3\)"):
        jax.eval_shape(decode_experts, *args)


# --------------------------------------------------------------------------------------------
# lowering for CUDA (sm_90) on any machine: catches Mosaic GPU layout inference, TMA and SMEM
# budget failures without a GPU.

@pytest.mark.parametrize("int4", [False, True], ids=["bf16", "int4"])
@pytest.mark.parametrize("H, I, R", [(2048, 512, 8), (2048, 512, 64), (4096, 2048, 8)],
                         ids=["qwen-R8", "qwen-R64", "h4096-R8"])
@pytest.mark.parametrize("units", [False, True], ids=["whole", "units"])
def test_lowers_for_cuda(int4, H, I, R, units, mgpu):
    from jax import export

    fn, args = (decode_experts_int4, _int4_args(8, H, I, 2000, R)) if int4 else \
        (decode_experts, _bf16_args(8, H, I, 2000, R))
    if units:
        args = args + _sds(((R,), jnp.int32))
    exported = export.export(fn, platforms=["cuda"])(*args)
    assert "mosaic_gpu" in exported.mlir_module()


# --------------------------------------------------------------------------------------------
# compiled on a Hopper GPU (the lead runs these on the H200)

@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs JAX's GPU backend on a Hopper (sm_90) GPU")
@pytest.mark.parametrize("int4", [False, True], ids=["bf16", "int4"])
@pytest.mark.parametrize("H, I, T, R, n_valid", [(2048, 512, 1, 8, 8), (2048, 512, 8, 64, 61),
                                                 (4096, 2048, 2, 16, 13)],
                         ids=["qwen-R8", "qwen-R64", "h4096-R16"])
def test_compiled_matches_reference(int4, H, I, T, R, n_valid):
    x, slots, tokens, gate_up, down = _inputs(3, T=T, H=H, I=I, S=10, R=R, dup=True)
    nv = jnp.int32(n_valid)
    if int4:
        banks = _quantize(gate_up, down)
        out = decode_experts_int4(x, slots, tokens, nv, *banks)
        ref = reference_decode_experts_int4(x, slots, tokens, nv, *banks)
    else:
        out = decode_experts(x, slots, tokens, nv, gate_up, down)
        ref = reference_decode_experts(x, slots, tokens, nv, gate_up, down)
    _check(out, ref, n_valid)
    zero = decode_experts_int4(x, slots, tokens, jnp.int32(0), *banks) if int4 else \
        decode_experts(x, slots, tokens, jnp.int32(0), gate_up, down)
    assert not np.any(np.asarray(zero))
    # per-route units (the unit split): 0, a block boundary, inside a block (int4: group-aligned), all
    units = jnp.asarray(np.resize([0, 64, 96 if int4 else 72, I], R), jnp.int32)
    if int4:
        out = decode_experts_int4(x, slots, tokens, nv, *banks, units)
        ref = reference_decode_experts_int4(x, slots, tokens, nv, *banks, units)
    else:
        out = decode_experts(x, slots, tokens, nv, gate_up, down, units)
        ref = reference_decode_experts(x, slots, tokens, nv, gate_up, down, units)
    _check(out, ref, n_valid)
