"""The prefill's gate+up kernel with the row gather fused in (ftjax.pallas.gate_up_cuda, CUDA, sm_90a).

On the CPU: the options that cannot run it raise ValueError naming why, and its jnp reference computes
what the Mosaic GPU kernel 1 computes from the gathered rows (interpret mode). The `gpu` tests run the
CUDA kernel against that reference and the whole prefill with ``gather="fused"`` against the prefill's."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.pallas import gate_up_cuda
from ftjax.pallas import prefill_gemm as pg
from ftjax.pallas import route_tables
from ftjax.pallas import routing


def _problem(seed, *, T, k, H, I, E, S, p_valid=0.9, experts=None):
    rng = np.random.default_rng(seed)
    pool = np.arange(E) if experts is None else np.asarray(experts)
    ids = jnp.asarray(rng.choice(pool, (T, k)).astype(np.int32))
    x = jnp.asarray(rng.standard_normal((T, H)) + 0.1, jnp.bfloat16)
    gw = jnp.asarray(rng.uniform(0.1, 1.0, (T, k)), jnp.float32)
    valid = jnp.asarray(rng.uniform(size=T) < p_valid)
    slots = jnp.asarray(rng.permutation(S)[:E].astype(np.int32))
    gate_up = jnp.asarray(rng.standard_normal((S, 2 * I, H)) / np.sqrt(H) + 0.01, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((S, H, I)) / np.sqrt(I) + 0.01, jnp.bfloat16)
    return x, ids, gw, valid, slots, gate_up, down


def _live_rows(tables, tile):
    rows = np.asarray(tables.tile_rows)
    n = int(np.asarray(tables.n_launch)[0])
    live = np.zeros(rows.shape[0] * tile, bool)
    for m in range(min(n, rows.shape[0])):
        live[m * tile:m * tile + rows[m]] = True
    return live


def _check_act(act, ref, live):
    act, ref = np.asarray(act, np.float32), np.asarray(ref)
    assert act.shape == ref.shape
    if not live.any():
        return
    scale = np.max(np.abs(ref[live]))
    assert scale > 0
    np.testing.assert_allclose(act[live], ref[live], rtol=0, atol=1e-2 * scale)


@pytest.mark.parametrize("kwargs, match", [
    (dict(interpret=True), r"gather='fused': .*no interpret mode"),
    (dict(tile_m=64, interpret=True), r"it needs tile_m=128, got 64"),
    (dict(tile_n_gate_up=32, interpret=True), r"tile_n_gate_up must be 64, got 32"),
])
def test_fused_gather_options_raise(kwargs, match):
    fn = functools.partial(pg.prefill_experts, gather="fused", num_sms=2, **kwargs)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(fn, *_prefill_shapes())


def _prefill_shapes(T=8, k=2, H=256, I=256, S=4):
    """`prefill_experts`'s arguments as shapes (bf16 banks)."""
    sd = jax.ShapeDtypeStruct
    return [sd((T, H), jnp.bfloat16), sd((T, k), jnp.int32), sd((T, k), jnp.float32), sd((T,), jnp.bool_),
            sd((S, 2 * I, H), jnp.bfloat16), sd((S, H, I), jnp.bfloat16), sd((S,), jnp.int32)]


@pytest.mark.parametrize("options, match", [
    ((("bogus", 1),), r"unknown fused kernel option\(s\) \['bogus'\]"), ((("silu", "erf"),), r"silu must be one of"),
])
def test_prefill_fused_options_raise(options, match):
    """`prefill_experts(fused_options=)` is checked wherever kernel 1 runs (here XLA's take: no sm_90 GPU)."""
    fn = functools.partial(pg.prefill_experts, num_sms=2, interpret=True, fused_options=options)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(fn, *_prefill_shapes())
    assert gate_up_cuda.kernel_options((("epilogue", "direct"), ("silu", "tanh"))) == dict(epilogue="direct",
                                                                                          silu="tanh")


@pytest.mark.parametrize("kwargs, match", [
    (dict(x_keep=1.5), r"x_keep must be in \[0, 1\]"), (dict(stages=2), r"stages must be 3 or 4"),
    (dict(w_promotion="512"), r"w_promotion must be one of"), (dict(epilogue="tma"), r"epilogue must be one of"),
    (dict(silu="erf"), r"silu must be one of"),
])
def test_kernel_options_raise(kwargs, match):
    x, ids, _, valid, slots, gate_up, _ = _problem(3, T=16, k=2, H=128, I=128, E=4, S=4)
    tables = route_tables.route_tables(ids, valid, slots, n_slots=gate_up.shape[0], tile=128, impl="jnp")
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(functools.partial(gate_up_cuda.gate_up, num_sms=2, **kwargs), x, tables, gate_up)


def test_auto_gather_takes_the_fused_kernel_only_where_it_can_run(monkeypatch):
    """``gather="auto"``: fused where `gate_up_cuda.why_not` finds nothing, else XLA's take; the fused kernel
    1's tiles walked in expert bands of 2 by ``walk_band="auto"``, the Mosaic kernel's (4 blocks) by rows."""
    from ftjax.pallas import prefill_options

    def resolved(available, **kw):
        monkeypatch.setattr(gate_up_cuda, "available", lambda: available)
        opts = dict(int4=False, tile_m=128, tile_n_gate_up=64, tile_n_down=128, tile_k=64, stages=3, num_sms=132,
                    interpret=False, cross_tile=False, gather="auto", walk_band="auto")
        return prefill_options.resolve_tiles(2048, 512, **{**opts, **kw})

    def gather(available, **kw):
        return resolved(available, **kw)[8]

    assert resolved(True)[9] == (2, None) and resolved(False)[9] == (None, None)
    assert resolved(True, walk_band=None)[9] == (None, None)

    assert gather(True) == "fused"
    assert gather(False) == "xla"  # no sm_90 GPU / CUDA part
    assert gather(True, int4=True) == "xla"
    assert gather(True, tile_m=64) == "xla"
    assert gather(True, interpret=True) == "xla"
    assert gather(True, gather="xla") == "xla"


def test_default_x_keep():
    assert gate_up_cuda.default_x_keep((8192, 2048)) == 0.75  # 32 MiB of bf16 rows, 24 MiB kept
    assert gate_up_cuda.default_x_keep((100, 2048)) == 1.0


def test_fused_gather_refuses_int4():
    with pytest.raises(ValueError, match=r"it takes bf16 weights only"):
        gate_up_cuda.check(hidden=256, inter=256, tile_m=128, tile_n_gate_up=64, int4=True, interpret=True)
    with pytest.raises(ValueError, match=r"H % 64 == 0 and I % 128 == 0, got H 96, I 192"):
        gate_up_cuda.check(hidden=96, inter=192, tile_m=128, tile_n_gate_up=64, int4=False, interpret=True)


def test_reference_is_kernel_1_of_the_gathered_rows(mgpu_interpret):
    """The reference reads x through the tables as the Mosaic kernel reads the gathered x_rows."""
    tile = 64
    x, ids, _, valid, slots, gate_up, _ = _problem(2, T=37, k=3, H=128, I=128, E=6, S=7)
    tables = route_tables.route_tables(ids, valid, slots, n_slots=gate_up.shape[0], tile=tile, impl="jnp")
    x_rows = routing.gather_input_rows(x, tables)
    act = pg._grouped_matmul(x_rows, tables.tile_slot, tables.tile_row0, tables.tile_rows, tables.n_launch,
                             (gate_up,), n_out=128, swiglu=True, tile_m=tile, tile_n=64, tile_k=64, stages=2,
                             num_sms=2, interpret=True, cross_tile=False)
    ref = gate_up_cuda.reference_gate_up(x, tables.token_of_input_row, tables.tile_slot, tables.tile_row0,
                                         tables.tile_rows, gate_up, tile=tile)
    live = _live_rows(tables, tile)
    assert live.sum() == int(np.asarray(valid).sum()) * 3
    _check_act(act, ref, live)


# ---------------------------------------------------------------------------------------------
# On an H100 / H200


def _fused_here():
    try:
        return gate_up_cuda.available()
    except RuntimeError:
        return False


gpu = pytest.mark.skipif(not _fused_here(), reason="needs the sm_90a CUDA part and an sm_90 GPU")

CASES = {
    # the Qwen3.6 expert shape, 1K tokens over 64 experts: ~2 row tiles per group
    "qwen": dict(T=1024, k=8, H=2048, I=512, E=64, S=72),
    # odd sizes: T, H (3 reduction steps of 64) and I (one output block) not powers of two; 30% invalid
    "odd": dict(T=37, k=3, H=192, I=128, E=7, S=9, p_valid=0.7),
    # one group of many row tiles (every route to one expert), every token valid
    "one-group": dict(T=700, k=1, H=256, I=256, E=4, S=5, experts=[2], p_valid=1.0),
    # 2 of 64 experts: 62 empty groups
    "empty-groups": dict(T=90, k=2, H=256, I=384, E=64, S=64, experts=[5, 60]),
}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("band, x_keep, stages, epilogue, silu", [
    (None, None, 4, "direct", "exp"), (2, 0.0, 4, "direct", "exp"), (None, 1.0, 4, "direct", "exp"),
    (None, None, 3, "direct", "exp"), (None, None, 4, "smem", "exp"), (2, None, 3, "smem", "exp"),
    (None, None, 4, "direct", "tanh"), (2, None, 4, "smem", "tanh")],
    ids=["rows", "band2-nohint", "keep1", "s3", "smem", "band2-s3-smem", "tanh", "band2-smem-tanh"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_reference_on_gpu(case, band, x_keep, stages, epilogue, silu):
    x, ids, _, valid, slots, gate_up, _ = _problem(5, **case)
    inter = case["I"]
    tables = route_tables.route_tables(ids, valid, slots, n_slots=gate_up.shape[0], tile=128,
                                       walks=((inter // 128, band), (1, None)),
                                       impl=route_tables.resolve_impl("auto", case["E"]))
    act = jax.jit(functools.partial(gate_up_cuda.gate_up, num_sms=132, x_keep=x_keep, stages=stages,
                                          epilogue=epilogue, silu=silu))(x, tables, gate_up)
    ref = jax.jit(gate_up_cuda.reference_gate_up)(x, tables.token_of_input_row, tables.tile_slot,
                                                  tables.tile_row0, tables.tile_rows, gate_up)
    _check_act(act, ref, _live_rows(tables, 128))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_sms", [132, 5])
def test_prefill_with_fused_gather_on_gpu(num_sms):
    """The whole prefill with kernel 1 fused: equal to the reference (and close to the Mosaic path's)."""
    x, ids, gw, valid, slots, gate_up, down = _problem(6, **CASES["qwen"])
    args = (x, ids, gw, valid)
    fused = pg.prefill_experts(*args, gate_up, down, slots, gather="fused", num_sms=num_sms)
    plain = pg.prefill_experts(*args, gate_up, down, slots, num_sms=num_sms)
    ref = jnp.concatenate([jax.jit(pg.reference_prefill_experts)(x[i:i + 64], ids[i:i + 64], gw[i:i + 64],
                                                                 valid[i:i + 64], gate_up, down, slots)
                           for i in range(0, x.shape[0], 64)])
    valid = np.asarray(valid)
    fused, plain, ref = np.asarray(fused), np.asarray(plain), np.asarray(ref)
    assert np.all(fused[~valid] == 0.0)
    scale = np.max(np.abs(ref[valid]))
    np.testing.assert_allclose(fused[valid], ref[valid], rtol=0, atol=1e-2 * scale)
    np.testing.assert_allclose(fused, plain, rtol=0, atol=5e-3 * scale)
    none = pg.prefill_experts(x, ids, gw, jnp.zeros_like(args[3]), gate_up, down, slots, gather="fused",
                              num_sms=num_sms)
    assert not np.any(np.asarray(none))
