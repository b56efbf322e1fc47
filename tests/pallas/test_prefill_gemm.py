"""Prefill grouped expert MLP (ftjax.pallas.prefill_gemm) and its routing helpers.

Kernels run against the jnp reference in Mosaic GPU interpret mode on the CPU, with tiny tiles
(64-row / 64-column tiles, the smallest WGMMA takes with two compute warpgroups); they skip where
this jax has no interpret mode. The CUDA lowering test runs Mosaic GPU layout inference and
lowering for sm_90 at a real shape without a GPU. The `gpu` test runs the compiled kernels."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.host import quant
from ftjax.pallas import prefill_gemm as pg
from ftjax.pallas import prefill_options
from ftjax.pallas import routing

SMALL = dict(tile_m=64, tile_n_gate_up=64, tile_n_down=64, tile_k=64, stages=2, num_sms=2,
             interpret=True)


# ---------------------------------------------------------------------------------------------
# Routing helpers against numpy


def _np_plan(expert_ids, token_valid, num_experts, tile):
    """Straightforward numpy version of routing.plan_routes."""
    num_tokens, top_k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    valid = np.repeat(token_valid, top_k)
    key = np.where(valid, flat, num_experts)
    order = np.argsort(key, kind="stable")
    sizes = np.bincount(flat[valid], minlength=num_experts)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    padded = -(-sizes // tile) * tile
    pstarts = np.concatenate([[0], np.cumsum(padded)[:-1]])
    in_padded = -(-sizes // routing.INPUT_ALIGN) * routing.INPUT_ALIGN
    in_starts = np.concatenate([[0], np.cumsum(in_padded)[:-1]])
    num_rows = routing.padded_rows_bound(flat.size, num_experts, tile)
    row_of_route = np.full(flat.size, num_rows)
    route_of_row = np.full(num_rows, flat.size)
    for g in range(num_experts):
        routes = order[starts[g]:starts[g] + sizes[g]]
        rows = pstarts[g] + np.arange(sizes[g])
        row_of_route[routes] = rows
        route_of_row[rows] = routes
    tile_group = np.full(num_rows // tile, num_experts - 1)
    tile_row0 = np.zeros(num_rows // tile, np.int64)
    tile_rows = np.zeros(num_rows // tile, np.int64)
    for g in range(num_experts):
        first, end = pstarts[g] // tile, (pstarts[g] + padded[g]) // tile
        tile_group[first:end] = g
        tile_row0[first:end] = in_starts[g] + tile * np.arange(end - first)
        tile_rows[first:end] = np.minimum(sizes[g] - tile * np.arange(end - first), tile)
    return dict(order=order, group_sizes=sizes, group_starts=starts, padded_starts=pstarts,
                row_of_route=row_of_route, route_of_row=route_of_row, tile_group=tile_group,
                tile_row0=tile_row0, tile_rows=tile_rows, n_tiles=padded.sum() // tile)


@pytest.mark.parametrize("case", [
    dict(T=13, k=3, E=7, tile=4, p_valid=0.7),
    dict(T=9, k=2, E=16, tile=8, p_valid=1.0),  # most groups empty, every token valid
    dict(T=5, k=2, E=4, tile=4, p_valid=0.0),  # no valid token: no tile in use
    dict(T=16, k=1, E=3, tile=1, p_valid=0.5),  # tile 1: no padding at all
])
def test_plan_routes_matches_numpy(case):
    rng = np.random.default_rng(case["T"])
    ids = rng.integers(0, case["E"], (case["T"], case["k"])).astype(np.int32)
    valid = rng.uniform(size=case["T"]) < case["p_valid"]
    plan = routing.plan_routes(jnp.asarray(ids), jnp.asarray(valid), case["E"], case["tile"])
    want = _np_plan(ids, valid, case["E"], case["tile"])
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(getattr(plan, name)), value, err_msg=name)
    np.testing.assert_array_equal(np.asarray(plan.rank)[np.asarray(plan.order)],
                                  np.arange(ids.size))
    assert np.all(want["padded_starts"] % case["tile"] == 0)
    assert want["n_tiles"] * case["tile"] <= plan.route_of_row.shape[0]


def test_padded_rows_bound_is_tight_and_validated():
    # 8 routes in 4 groups of sizes 5, 1, 1, 1 pad to 8 + 4 + 4 + 4 = 20 rows: the bound.
    assert routing.padded_rows_bound(num_routes=8, num_groups=4, tile=4) == 20
    ids = jnp.asarray([[0], [0], [0], [0], [0], [1], [2], [3]], jnp.int32)
    plan = routing.plan_routes(ids, jnp.ones(8, bool), num_experts=4, tile=4)
    assert int(plan.n_tiles) * 4 == 20 == plan.route_of_row.shape[0]
    assert routing.padded_rows_bound(num_routes=3, num_groups=100, tile=64) == 192
    assert routing.padded_rows_bound(num_routes=0, num_groups=4, tile=64) == 64
    ids = jnp.asarray(np.repeat(np.arange(4), 5)[:, None].astype(np.int32))  # 4 groups of 5
    plan = routing.plan_routes(ids, jnp.ones(20, bool), num_experts=4, tile=4)
    assert int(plan.n_tiles) * 4 == 32 == plan.route_of_row.shape[0]
    with pytest.raises(ValueError, match="tile >= 1"):
        routing.padded_rows_bound(8, 4, 0)


def test_gather_and_combine_rows_match_numpy():
    rng = np.random.default_rng(3)
    T, k, E, H, tile = 11, 3, 5, 6, 4
    ids = rng.integers(0, E, (T, k)).astype(np.int32)
    valid = rng.uniform(size=T) < 0.7
    x = rng.standard_normal((T, H)).astype(np.float32) + 0.1
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    plan = routing.plan_routes(jnp.asarray(ids), jnp.asarray(valid), E, tile)
    want_plan = _np_plan(ids, valid, E, tile)
    r_of_row = np.asarray(plan.route_of_row)
    is_route = r_of_row < T * k
    # The kernels' input rows: tile m's rows from tile_row0[m] on are its routes' tokens, in the
    # padded layout's order; groups start on INPUT_ALIGN rows; the spare rows keep every read inside.
    align = routing.INPUT_ALIGN
    for dtype in (np.float32, jnp.bfloat16):  # the plain take and the 32-bit-word take
        xs = jnp.asarray(x, dtype)
        got = np.asarray(routing.gather_input_rows(xs, plan)).astype(np.float32)
        xs = np.asarray(xs).astype(np.float32)
        assert got.shape == (routing.padded_rows_bound(T * k, E, align) + tile, H)
        row0, n_tiles = np.asarray(plan.tile_row0), int(plan.n_tiles)
        assert np.all(row0 % np.gcd(align, tile) == 0) and np.all(row0 + tile <= got.shape[0])
        for m in range(n_tiles):
            routes = r_of_row[tile * m:tile * (m + 1)]
            n = int((routes < T * k).sum())
            assert n > 0 and np.all(routes[:n] < T * k)
            np.testing.assert_array_equal(got[row0[m]:row0[m] + n], xs[routes[:n] // k])
        assert np.all(row0[n_tiles:] == 0)
        in_rows = {tuple(r) for r in got}
        assert in_rows <= {tuple(r) for r in xs}  # padding rows are copies of rows of x
    np.testing.assert_array_equal(np.asarray(plan.tile_row0), want_plan["tile_row0"])
    empty = routing.plan_routes(jnp.zeros((0, k), jnp.int32), jnp.zeros(0, bool), E, tile)
    assert routing.gather_input_rows(jnp.zeros((0, H)), empty).shape == (align + tile, H)
    # Pretend each padded row's result is its token's row, NaN in padding rows: combine skips them.
    rows_nan = np.where(is_route[:, None], x[np.minimum(r_of_row, T * k - 1) // k], np.nan)
    y = np.asarray(routing.combine_rows(jnp.asarray(rows_nan.astype(np.float32)), plan,
                                        jnp.asarray(w)))
    want = np.where(valid[:, None], x * w.sum(1, keepdims=True), 0.0)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("band", [1, 2, 3, 8])
@pytest.mark.parametrize("case", [
    dict(T=40, k=3, E=5, tile=4, p_valid=0.8),  # groups of several row tiles, some bands partial
    dict(T=9, k=2, E=16, tile=8, p_valid=1.0),  # one row tile per group
    dict(T=5, k=2, E=4, tile=4, p_valid=0.0),  # no tile in use: the identity order
])
def test_tile_walk_orders_expert_bands(case, band):
    """Per group, bands of ``band`` row tiles, row tiles fastest, then the column blocks; the
    active tiles first, each once; the rest in row-major order."""
    rng = np.random.default_rng(case["T"] + band)
    E, tile, n_blocks = case["E"], case["tile"], 3
    ids = rng.integers(0, E, (case["T"], case["k"])).astype(np.int32)
    valid = rng.uniform(size=case["T"]) < case["p_valid"]
    plan = routing.plan_routes(jnp.asarray(ids), jnp.asarray(valid), E, tile)
    walk = np.asarray(routing.tile_walk(plan, tile, n_blocks, band))
    num_tiles, n_tiles = plan.tile_group.shape[0], int(plan.n_tiles)
    want = []  # written out from the definition
    tiles_of = {}
    for m, g in enumerate(np.asarray(plan.tile_group)[:n_tiles]):
        tiles_of.setdefault(int(g), []).append(m)
    for g in sorted(tiles_of, key=lambda g: tiles_of[g][0]):
        ms = tiles_of[g]
        assert ms == list(range(ms[0], ms[0] + len(ms)))  # a group's row tiles are consecutive
        for b0 in range(0, len(ms), band):
            want += [m * n_blocks + n for n in range(n_blocks) for m in ms[b0:b0 + band]]
    want += list(range(n_tiles * n_blocks, num_tiles * n_blocks))
    np.testing.assert_array_equal(walk, np.asarray(want, np.int32))
    assert sorted(walk.tolist()) == list(range(num_tiles * n_blocks))
    with pytest.raises(ValueError, match="band and n_blocks must be >= 1"):
        routing.tile_walk(plan, tile, n_blocks, 0)


# ---------------------------------------------------------------------------------------------
# Kernels against the reference (interpret mode)


def _inputs(seed, *, T, k, H, I, E, S, p_valid=0.8, experts=None):
    rng = np.random.default_rng(seed)
    pool = np.arange(E) if experts is None else np.asarray(experts)
    ids = rng.choice(pool, (T, k)).astype(np.int32)
    x = (rng.standard_normal((T, H)) + 0.1).astype(np.float32)
    w = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    valid = rng.uniform(size=T) < p_valid
    slot_of_expert = rng.permutation(S)[:E].astype(np.int32)  # non-identity, S > E
    gate_up = rng.standard_normal((S, 2 * I, H)) / np.sqrt(H) + 0.01
    down = rng.standard_normal((S, H, I)) / np.sqrt(I) + 0.01
    routing_args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids), jnp.asarray(w),
                    jnp.asarray(valid))
    return routing_args, jnp.asarray(slot_of_expert), gate_up, down


def _check(out, ref, valid):
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.dtype == np.float32 and out.shape == ref.shape
    assert np.all(out[~valid] == 0.0)
    if valid.any():
        scale = np.max(np.abs(ref[valid]))
        assert scale > 0
        np.testing.assert_allclose(out[valid], ref[valid], rtol=0, atol=1e-2 * scale)
    else:
        assert np.all(out == 0.0)


BF16_CASES = {
    # T not a multiple of the tile; ~20% invalid tokens; slot map a permutation into S > E;
    # H = 256: two output blocks of the down kernel and a 4-step ring of 2 stages
    "random": dict(T=37, k=4, E=8, S=11, H=256),
    # 2 of 16 experts used: 14 empty groups, each costing no tile
    "empty-groups": dict(T=20, k=2, E=16, S=16, experts=[3, 12]),
    # every route to one expert: one group of several row tiles, every token valid (capacity)
    "one-group": dict(T=70, k=2, E=4, S=5, experts=[2], p_valid=1.0),
    # no valid token: zero rows, no kernel launched
    "count0": dict(T=9, k=2, E=4, S=4, p_valid=0.0),
}


@pytest.mark.parametrize("case", BF16_CASES.values(), ids=BF16_CASES.keys())
def test_prefill_bf16_matches_reference(case, mgpu_interpret):
    args, slots, gate_up, down = _inputs(1, **{"H": 128, "I": 128, **case})
    gu, dn = jnp.asarray(gate_up, jnp.bfloat16), jnp.asarray(down, jnp.bfloat16)
    out = pg.prefill_experts(*args, gu, dn, slots, **SMALL)
    ref = pg.reference_prefill_experts(*args, gu, dn, slots)
    _check(out, ref, np.asarray(args[3]))


@pytest.mark.parametrize("case, num_sms, int4", [
    ("empty-groups", 1, False),  # one CTA running both tiles: START then STOP
    ("empty-groups", 3, False),  # two CTAs of one tile each (START, no drain), one idle CTA
    ("random", 2, False),  # many tiles per CTA: START, STEADY.., STOP
    ("random", 5, True),  # int4: the dequant buffer across tiles too
])
def test_cross_tile_pipeline_matches_reference(case, num_sms, int4, mgpu_interpret):
    """A CTA's tiles as one pipeline of pipelines (``cross_tile``) for 0, 1, 2 and many tiles per
    CTA: the same result as the reference (and so as the per-tile pipeline)."""
    size = dict(H=256, I=256) if int4 else dict(H=128, I=128)
    args, slots, gate_up, down = _inputs(3, **{**size, **BF16_CASES[case]})
    tiles = {**SMALL, "num_sms": num_sms, "cross_tile": True}
    if int4:
        banks = _int4_banks(gate_up, down)
        out = pg.prefill_experts_int4(*args, *banks, slots, **tiles)
        ref = pg.reference_prefill_experts_int4(*args, *banks, slots)
    else:
        gu, dn = jnp.asarray(gate_up, jnp.bfloat16), jnp.asarray(down, jnp.bfloat16)
        out = pg.prefill_experts(*args, gu, dn, slots, **tiles)
        ref = pg.reference_prefill_experts(*args, gu, dn, slots)
    _check(out, ref, np.asarray(args[3]))


@pytest.mark.parametrize("stages, cross", [((2, 2), (False, True)), ((2, 2), (True, False)),
                                           ((3, 2), (False, None))])
def test_per_kernel_pipelines_agree(stages, cross, mgpu_interpret):
    """``stages`` / ``cross_tile`` as (gate_up, down) pairs: each kernel its own pipeline, the same
    tiles computed the same way, so the same bits as one setting for both."""
    args, slots, gate_up, down = _inputs(8, **{**BF16_CASES["random"], "H": 256, "I": 128})
    gu, dn = jnp.asarray(gate_up, jnp.bfloat16), jnp.asarray(down, jnp.bfloat16)
    tiles = {**SMALL, "num_sms": 3}
    mixed = pg.prefill_experts(*args, gu, dn, slots, **{**tiles, "stages": stages, "cross_tile": cross})
    plain = pg.prefill_experts(*args, gu, dn, slots, **{**tiles, "cross_tile": False})
    np.testing.assert_array_equal(np.asarray(mixed), np.asarray(plain))


def test_prefill_input_row_gathers_agree(mgpu_interpret):
    """Kernel 1's input rows by XLA's take (default) or TMA row copies: the same bits out."""
    args, slots, gate_up, down = _inputs(4, **{"H": 128, "I": 128, **BF16_CASES["random"]})
    gu, dn = jnp.asarray(gate_up, jnp.bfloat16), jnp.asarray(down, jnp.bfloat16)
    tma = pg.prefill_experts(*args, gu, dn, slots, **SMALL, gather="tma")
    xla = pg.prefill_experts(*args, gu, dn, slots, **SMALL)
    np.testing.assert_array_equal(np.asarray(tma), np.asarray(xla))
    _check(tma, pg.reference_prefill_experts(*args, gu, dn, slots), np.asarray(args[3]))


@pytest.mark.parametrize("case, band, num_sms", [
    ("random", 2, 3), ("one-group", 3, 2), ("empty-groups", 2, 1),
    ("count0", 2, 2), ("random", (2, None), 3), ("one-group", (None, 3), 2)])
def test_prefill_expert_walk_agrees(case, band, num_sms, mgpu_interpret):
    """The tiles walked per expert band (``walk_band``) compute the same tiles in the same way:
    the same bits as the default walk, for many tiles per CTA, one group and no tile in use."""
    # count0 at 128: at H 256 with few tiles in use the interpreter's barrier accounting rejects
    # the default walk too (a memory-warpgroup phase it calls unobserved; not seen compiled)
    size = 128 if case == "count0" else 256
    args, slots, gate_up, down = _inputs(6, **{"H": size, "I": size, **BF16_CASES[case]})
    gu, dn = jnp.asarray(gate_up, jnp.bfloat16), jnp.asarray(down, jnp.bfloat16)
    tiles = {**SMALL, "num_sms": num_sms}
    banded = pg.prefill_experts(*args, gu, dn, slots, **tiles, walk_band=band)
    default = pg.prefill_experts(*args, gu, dn, slots, **tiles)
    np.testing.assert_array_equal(np.asarray(banded), np.asarray(default))
    _check(banded, pg.reference_prefill_experts(*args, gu, dn, slots), np.asarray(args[3]))


def test_prefill_slabs_without_routes_skip_exactly(mgpu_interpret):
    """tile_m 128 = two 64-row slabs: a slab holding no route skips its WGMMAs. Groups of 130
    (a full tile + 2 rows), 100 (both slabs live) and 30 routes (the upper slab skipped)."""
    (x, _, w, _), slots, gate_up, down = _inputs(7, T=130, k=2, H=128, I=128, E=3, S=4)
    ids = np.zeros((130, 2), np.int32)
    ids[:100, 1], ids[100:, 1] = 1, 2
    valid = jnp.ones(130, bool)
    plan = routing.plan_routes(jnp.asarray(ids), valid, 3, 128)
    live = np.asarray(plan.tile_rows)[:int(plan.n_tiles)]
    assert sorted(live.tolist()) == [2, 30, 100, 128]
    gu, dn = jnp.asarray(gate_up, jnp.bfloat16), jnp.asarray(down, jnp.bfloat16)
    tiles = {**SMALL, "tile_m": 128}
    out = pg.prefill_experts(x, jnp.asarray(ids), w, valid, gu, dn, slots, **tiles)
    ref = pg.reference_prefill_experts(x, jnp.asarray(ids), w, valid, gu, dn, slots)
    _check(out, ref, np.ones(130, bool))


def test_prefill_per_route_validity(mgpu_interpret):
    """``token_valid [T, k]``: routes left out (e.g. their expert is not in the cache) add nothing."""
    (x, ids, w, _), slots, gate_up, down = _inputs(5, T=21, k=3, H=128, I=128, E=6, S=7)
    route_valid = jnp.asarray(np.random.default_rng(6).uniform(size=ids.shape) < 0.6)
    gu, dn = jnp.asarray(gate_up, jnp.bfloat16), jnp.asarray(down, jnp.bfloat16)
    out = pg.prefill_experts(x, ids, w, route_valid, gu, dn, slots, **SMALL)
    ref = pg.reference_prefill_experts(x, ids, w, route_valid, gu, dn, slots)
    # the reference with the left-out routes' weights zeroed agrees: nothing else changes
    w0 = jnp.where(route_valid, w, 0.0)
    ref0 = pg.reference_prefill_experts(x, ids, w0, route_valid.any(axis=1), gu, dn, slots)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(ref0), rtol=1e-6, atol=1e-6)
    _check(out, ref, np.asarray(route_valid.any(axis=1)))


def _int4_banks(gate_up, down):
    gp, gs = quant.quantize_int4(gate_up)
    dp, ds = quant.quantize_int4(down)
    return tuple(map(jnp.asarray, (gp, gs, dp, ds)))


INT4_CASES = {
    "random": dict(T=21, k=3, E=6, S=7),
    # one expert of 8 takes every route: a group of two row tiles, every token valid
    "one-group-capacity": dict(T=40, k=2, E=8, S=9, experts=[5], p_valid=1.0),
}


@pytest.mark.parametrize("case", INT4_CASES.values(), ids=INT4_CASES.keys())
def test_prefill_int4_matches_reference(case, mgpu_interpret):
    # I = 256: the down matmul's reduction covers one full 8-group scale block per copy.
    args, slots, gate_up, down = _inputs(2, H=256, I=256, **case)
    banks = _int4_banks(gate_up, down)
    out = pg.prefill_experts_int4(*args, *banks, slots, **SMALL)
    ref = pg.reference_prefill_experts_int4(*args, *banks, slots)
    _check(out, ref, np.asarray(args[3]))


def test_int4_reference_dequantizes_like_the_host_pool():
    rng = np.random.default_rng(4)
    packed, scales = quant.quantize_int4(rng.standard_normal((3, 5, 64)))
    np.testing.assert_array_equal(
        np.asarray(pg.dequantize_int4(jnp.asarray(packed), jnp.asarray(scales))),
        quant.dequantize_int4(packed, scales))


def test_device_count_one_compile(mgpu_interpret):
    """The number of valid tokens is data: one compiled function serves every count, 0 included."""
    args, slots, gate_up, down = _inputs(5, T=12, k=2, E=4, S=4, H=128, I=128)
    gu, dn = jnp.asarray(gate_up, jnp.bfloat16), jnp.asarray(down, jnp.bfloat16)
    fn = jax.jit(functools.partial(pg.prefill_experts, **SMALL))
    for n_valid in (0, 5, 12):
        valid = jnp.arange(12) < n_valid
        out = fn(*args[:3], valid, gu, dn, slots)
        ref = pg.reference_prefill_experts(*args[:3], valid, gu, dn, slots)
        _check(out, ref, np.asarray(valid))
    assert fn._cache_size() == 1


# ---------------------------------------------------------------------------------------------
# Size validation (no kernel runs)


def _shapes(T=8, k=2, H=128, I=128, E=4, S=4):
    sd = jax.ShapeDtypeStruct
    return [sd((T, H), jnp.bfloat16), sd((T, k), jnp.int32), sd((T, k), jnp.float32),
            sd((T,), jnp.bool_), sd((S, 2 * I, H), jnp.bfloat16), sd((S, H, I), jnp.bfloat16),
            sd((E,), jnp.int32)]


@pytest.mark.parametrize("sizes, kwargs, match", [
    (dict(H=96), {}, r"reduction dim 96 must be a multiple of tile_k = 64"),
    (dict(H=192), {}, r"down: the output dim 192 must be a multiple of 2 \* tile_n = 128"),
    (dict(I=192), {}, r"gate_up: the output dim 192 must be a multiple of 2 \* tile_n = 128"),
    (dict(H=384, I=160), dict(tile_n_gate_up=40), r"reduction dim 160 must be a multiple of"),
    ({}, dict(tile_m=100), r"tile_m must be a positive multiple of 64 \(WGMMA rows per "
                           r"warpgroup\), got 100"),
    ({}, dict(tile_k=48), r"tile_k must be one of 32, 64, 128, 256, got 48"),
    ({}, dict(stages=9, tile_m=256), r"needs \d+ bytes of SMEM"),
    ({}, dict(gather="take"), r"gather must be one of \('auto', 'tma', 'xla', 'fused'\), got 'take'"),
    ({}, dict(walk_band=0), r"walk_band must be \"auto\", None, a positive int or a \(gate_up, "
                            r"down\) pair of None / positive ints, got 0"),
    ({}, dict(walk_band=True), r"walk_band must be \"auto\", .*, got True"),
    ({}, dict(walk_band="4"), r"walk_band must be \"auto\", .*, got '4'"),
    ({}, dict(walk_band=(2, 0)), r"walk_band must be \"auto\", .*, got \(2, 0\)"),
    ({}, dict(walk_band=(2, 2, 2)), r"walk_band must be \"auto\", .*, got \(2, 2, 2\)"),
    ({}, dict(stages=3, cross_tile=True), r"gate_up: cross_tile needs the reduction's step count "
                                          r"\(H / tile_k = 2\) divisible by stages = 3"),
    ({}, dict(stages=(2, 3), cross_tile=(False, True)), r"down: cross_tile needs the reduction's step "
                                                        r"count \(I / tile_k = 2\) divisible by stages = 3"),
    ({}, dict(stages=(2, 2, 2)), r"stages as a tuple must be a \(gate_up, down\) pair, got \(2, 2, 2\)"),
    ({}, dict(cross_tile=(True,)), r"cross_tile as a tuple must be a \(gate_up, down\) pair"),
    ({}, dict(stages=(2, 2.0)), r"stages must be an int or a \(gate_up, down\) pair of ints"),
    ({}, dict(stages=(2, 1)), r"stages must be >= 2, got 1"),
])
def test_bad_sizes_raise_value_error(sizes, kwargs, match):
    fn = functools.partial(pg.prefill_experts, **{**SMALL, **kwargs})
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(fn, *_shapes(**sizes))


def _int4_shapes(T=8, k=2, H=128, I=128, S=4):
    sd = jax.ShapeDtypeStruct
    return [sd((T, H), jnp.bfloat16), sd((T, k), jnp.int32), sd((T, k), jnp.float32),
            sd((T,), jnp.bool_), sd((S, 2 * I, H // 2), jnp.uint8),
            sd((S, 2 * I, H // 32), jnp.bfloat16), sd((S, H, I // 2), jnp.uint8),
            sd((S, H, I // 32), jnp.bfloat16), sd((S,), jnp.int32)]


def test_auto_walk_band_by_output_blocks():
    """"auto": band 2 for a kernel of 16+ output blocks (the DeepSeek-like shape's two kernels),
    the default walk below (the Qwen3.6 shape's 4 and 8 blocks); explicit values pass through."""
    assert prefill_options.walk_bands("auto", (16, 16)) == (2, 2)
    assert prefill_options.walk_bands("auto", (4, 8)) == (None, None)
    assert prefill_options.walk_bands("auto", (15, 32)) == (None, 2)
    assert prefill_options.walk_bands("auto", (4, 8), fused=True) == (2, None)  # the fused kernel 1: band 2
    assert prefill_options.walk_bands(None, (16, 16), fused=True) == (None, None)
    assert prefill_options.walk_bands(None, (16, 16)) == (None, None)
    assert prefill_options.walk_bands(3) == (3, 3) and prefill_options.walk_bands((None, 4)) == (None, 4)


def test_int4_size_limits():
    fn = functools.partial(pg.prefill_experts_int4, **SMALL)
    with pytest.raises(ValueError, match=r"int4 needs the input dim divisible by 256 \(8 scale "
                                         r"groups per copy\), got 128"):
        jax.eval_shape(fn, *_int4_shapes(H=128, I=128))
    fn = functools.partial(pg.prefill_experts_int4, **{**SMALL, "tile_n_down": 256})
    with pytest.raises(ValueError, match=r"int4 needs 2 \* tile_n <= 256 .* got tile_n = 256"):
        jax.eval_shape(fn, *_int4_shapes(H=512, I=256))
    bad = _int4_shapes(H=256, I=256)
    bad[4] = jax.ShapeDtypeStruct(bad[4].shape, jnp.int8)
    with pytest.raises(ValueError, match="gate_up_packed must be uint8"):
        jax.eval_shape(fn, *bad)


def test_cost_model():
    assert pg.prefill_flops(8192, 8, 2048, 512) == 6 * 8192 * 8 * 2048 * 512
    bf16 = pg.prefill_bytes(1024, 8, 2048, 512, experts_hit=256)
    assert bf16 == 256 * 3 * 2048 * 512 * 2 + 1024 * 2048 * 6
    int4 = pg.prefill_bytes(1024, 8, 2048, 512, experts_hit=256, int4=True)
    assert int4 == int(256 * 3 * 2048 * 512 * (0.5 + 2 / 32)) + 1024 * 2048 * 6
    assert pg.prefill_bytes(1024, 8, 2048, 512, 256, num_experts=256,
                            with_intermediates=True) > bf16


# ---------------------------------------------------------------------------------------------
# Lowering for CUDA (sm_90) without a GPU, at a real shape


def _export(fn, *shapes):
    from jax import export

    exp = export.export(jax.jit(fn), platforms=["cuda"])(*shapes)
    return exp.mlir_module()


@pytest.mark.parametrize("pipeline", [dict(stages=3), dict(stages=4, cross_tile=True),
                                      dict(stages=3, walk_band=4)],
                         ids=["per-tile", "cross-tile", "walk-band4"])
@pytest.mark.parametrize("H, I", [(2048, 512), (4096, 2048)])
@pytest.mark.parametrize("int4", [False, True], ids=["bf16", "int4"])
def test_lowers_for_cuda_at_real_shape(int4, H, I, pipeline, mgpu):
    sd = jax.ShapeDtypeStruct
    T, k, E, S = 1024, 8, 256, 256
    common = [sd((T, H), jnp.bfloat16), sd((T, k), jnp.int32), sd((T, k), jnp.float32),
              sd((T,), jnp.bool_)]
    if int4:
        banks = [sd((S, 2 * I, H // 2), jnp.uint8), sd((S, 2 * I, H // 32), jnp.bfloat16),
                 sd((S, H, I // 2), jnp.uint8), sd((S, H, I // 32), jnp.bfloat16)]
        fn = functools.partial(pg.prefill_experts_int4, num_sms=132, **pipeline)
    else:
        banks = [sd((S, 2 * I, H), jnp.bfloat16), sd((S, H, I), jnp.bfloat16)]
        fn = functools.partial(pg.prefill_experts, num_sms=132, **pipeline)
    text = _export(fn, *common, *banks, sd((E,), jnp.int32))
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 2  # gate_up and down kernels


# ---------------------------------------------------------------------------------------------
# Compiled on a GPU


def _on_gpu():
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def _chunked_reference(ref_fn, args, banks, slots, chunk=32):
    """The per-route reference gathers whole weight matrices: run it a few tokens at a time."""
    x, ids, w, valid = args
    parts = [ref_fn(x[i:i + chunk], ids[i:i + chunk], w[i:i + chunk], valid[i:i + chunk],
                    *banks, slots) for i in range(0, x.shape[0], chunk)]
    return jnp.concatenate(parts)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu(), reason="needs JAX's GPU backend (Hopper)")
@pytest.mark.parametrize("tiles", [{}, dict(tile_m=64), dict(stages=4, cross_tile=True),
                                   dict(tile_k=128, stages=2, cross_tile=True), dict(walk_band=4)],
                         ids=["default", "tile_m64", "cross-tile", "cross-tile-k128", "walk-band4"])
@pytest.mark.parametrize("int4", [False, True], ids=["bf16", "int4"])
def test_compiled_matches_reference_on_gpu(int4, tiles):
    T, k, H, I, E, S = 1024, 8, 2048, 512, 64, 72
    args, slots, gate_up, down = _inputs(7, T=T, k=k, H=H, I=I, E=E, S=S, p_valid=0.9)
    if int4:
        banks = _int4_banks(gate_up, down)
        fn, ref_fn = pg.prefill_experts_int4, pg.reference_prefill_experts_int4
    else:
        banks = (jnp.asarray(gate_up, jnp.bfloat16), jnp.asarray(down, jnp.bfloat16))
        fn, ref_fn = pg.prefill_experts, pg.reference_prefill_experts
    out = fn(*args, *banks, slots, **tiles)
    ref = _chunked_reference(jax.jit(ref_fn), args, banks, slots)
    _check(out, ref, np.asarray(args[3]))
    # An empty batch (one tile of padding rows computed, read by no route) returns zeros.
    none = fn(*args[:3], jnp.zeros_like(args[3]), *banks, slots, **tiles)
    assert not np.any(np.asarray(none))
