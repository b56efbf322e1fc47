"""CPU expert kernels (every ISA tier on this machine) against the float64 numpy reference."""
import zlib

import numpy as np
import pytest
from kernel_helpers import BF16, TIERS, make_pool, rel_err

from ftjax import _host
from ftjax.host import (expert_call_time_totals, expert_call_totals, kernel_knobs, knob_variants, parse_knobs, quant,
                        set_kernel_knobs, set_tier)
from ftjax.host.reference import experts_reference


def run(pool, x, tok, eid, w, n_valid):
    bf16 = x.dtype == BF16
    return _host.run_experts(pool._h, x.view(np.uint16) if bf16 else x, tok, eid, w, n_valid, x_bf16=bf16)


def tasks(rng, T, n_tasks, n_experts, k=None):
    tok = rng.integers(0, T, n_tasks).astype(np.int32)
    eid = rng.integers(0, n_experts, n_tasks).astype(np.int32)
    eid[: n_tasks // 3] = eid[0]  # duplicate experts: several tokens on one expert
    return tok, eid, rng.random(n_tasks).astype(np.float32)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt,act", [("f32", "f32"), ("bf16", "f32"), ("bf16", "bf16"), ("int4", "f32"),
                                     ("int4", "bf16")])
# (192, 128): both int4 matrices take the AVX-512 tier's two-groups-at-a-time path (cols % 64 == 0)
@pytest.mark.parametrize("hidden,inter", [(64, 32), (96, 160), (192, 128)])
def test_kernel_matches_reference(tier, fmt, act, hidden, inter):
    set_tier(tier)
    rng = np.random.default_rng(zlib.crc32(f"{tier}{fmt}{act}{hidden}".encode()))
    pool, ref = make_pool(rng, fmt, 7, hidden, inter)
    T, cap = 9, 24
    x = rng.standard_normal((T, hidden)).astype(np.float32)
    if act == "bf16":
        x = x.astype(BF16)
    tok, eid, w = tasks(rng, T, cap, 7)
    for n_valid in (cap, 13, 1):
        y = run(pool, x, tok, eid, w, n_valid)
        want = experts_reference(x.astype(np.float32), tok, eid, w, n_valid, ref["gate_up"], ref["down"],
                                 bf16_act=act == "bf16")
        # f32 activations: float32 summation; bf16: the intermediate's bf16 rounding may flip.
        tol = 2e-5 if act == "f32" else 2e-2
        assert rel_err(y, want) < tol, (n_valid, rel_err(y, want))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_odd_sizes(tier, fmt):
    set_tier(tier)
    rng = np.random.default_rng(3)
    pool, ref = make_pool(rng, fmt, 5, 37, 23)  # neither a multiple of 8 nor 16: every tail path
    x = rng.standard_normal((5, 37)).astype(np.float32)
    tok, eid, w = tasks(rng, 5, 11, 5)
    y = run(pool, x, tok, eid, w, 11)
    assert rel_err(y, experts_reference(x, tok, eid, w, 11, ref["gate_up"], ref["down"])) < 2e-5


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("hidden,inter", [(80, 48), (45, 50)])
def test_odd_sizes_bf16_activations(tier, hidden, inter):
    """Widths that are not a multiple of 32 (the AMX tier's k-step; 45: an odd last pair) and row
    counts that are not a multiple of 16 (45 rows of down, 50 of gate)."""
    set_tier(tier)
    rng = np.random.default_rng(hidden)
    pool, ref = make_pool(rng, "bf16", 5, hidden, inter)
    x = rng.standard_normal((5, hidden)).astype(BF16)
    tok, eid, w = tasks(rng, 5, 11, 5)
    y = run(pool, x, tok, eid, w, 11)
    want = experts_reference(x.astype(np.float32), tok, eid, w, 11, ref["gate_up"], ref["down"], bf16_act=True)
    assert rel_err(y, want) < 2e-2


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt,hidden,inter", [("bf16", 64, 32), ("bf16", 80, 48), ("int4", 64, 32),
                                              ("int4", 96, 160), ("int4", 320, 288)])
def test_more_tokens_than_a_tile_bf16_activations(tier, fmt, hidden, inter):
    """20 tokens on one expert: more than one 16-token group of the AMX tier, then 3 on another.
    (320, 288): int4 widths past the AMX tier's 256-column dequant chunk, with a partial last chunk."""
    set_tier(tier)
    rng = np.random.default_rng(8)
    pool, ref = make_pool(rng, fmt, 3, hidden, inter)
    x = rng.standard_normal((20, hidden)).astype(BF16)
    tok = np.concatenate([np.arange(20), [4, 9, 9]]).astype(np.int32)
    eid = np.array([1] * 20 + [2] * 3, np.int32)
    w = rng.random(23).astype(np.float32)
    y = run(pool, x, tok, eid, w, 23)
    want = experts_reference(x.astype(np.float32), tok, eid, w, 23, ref["gate_up"], ref["down"], bf16_act=True)
    assert rel_err(y, want) < 2e-2


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("hidden,inter", [(32, 96), (64, 160), (96, 64), (160, 32)])
def test_int4_bf16_activations_tokens_per_expert(tier, hidden, inter):
    """int4 weights, bf16 activations, 1 to 17 tokens per expert: the AMX tier's tile path from 3
    tokens on (blocks of 16 rows, the rest on AVX-512; groups of 32 columns four at a time, here 1, 2,
    3 and 5 groups; 17 tokens: two blocks of tile columns), fewer tokens on AVX-512."""
    set_tier(tier)
    rng = np.random.default_rng(zlib.crc32(f"i4tok{tier}{hidden}".encode()))
    counts = [1, 2, 3, 4, 5, 16, 17]
    pool, ref = make_pool(rng, "int4", len(counts), hidden, inter)
    T = max(counts)
    x = rng.standard_normal((T, hidden)).astype(BF16)
    tok = np.concatenate([rng.choice(T, c, replace=False) for c in counts]).astype(np.int32)
    eid = np.repeat(np.arange(len(counts)), counts).astype(np.int32)
    perm = rng.permutation(tok.size)  # tasks in any order: the kernel groups them by expert
    tok, eid = tok[perm], eid[perm]
    w = rng.random(tok.size).astype(np.float32)
    y = run(pool, x, tok, eid, w, tok.size)
    want = experts_reference(x.astype(np.float32), tok, eid, w, tok.size, ref["gate_up"], ref["down"], bf16_act=True)
    assert rel_err(y, want) < 2e-2


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt,act", [("f32", "f32"), ("bf16", "f32"), ("bf16", "bf16"), ("int4", "f32"),
                                     ("int4", "bf16")])
def test_unit_start_computes_only_those_units(tier, fmt, act):
    """unit_start u: a task adds only its expert's intermediate units [u, I) (gate/up rows and down
    columns from u). u = 0 (all), u = I (nothing), int4 starts on and off a 64-column span, one
    expert at two starts in one call; the units below u are what the other side adds."""
    set_tier(tier)
    hidden, inter = 192, 128
    rng = np.random.default_rng(zlib.crc32(f"units{tier}{fmt}{act}".encode()))
    pool, ref = make_pool(rng, fmt, 5, hidden, inter)
    T, cap = 6, 14
    x = rng.standard_normal((T, hidden)).astype(np.float32)
    if act == "bf16":
        x = x.astype(BF16)
    tok, eid, w = tasks(rng, T, cap, 5)
    starts = [0, 32, 64, 96, 128] if fmt == "int4" else [0, 5, 37, 64, 127, 128]
    unit = rng.choice(starts, cap).astype(np.int32)
    unit[:2] = (starts[1], starts[-2])  # tasks 0 and 1 share an expert (tasks()): two starts, one expert
    y = _host.run_experts(pool._h, x.view(np.uint16) if act == "bf16" else x, tok, eid, w, cap,
                          x_bf16=act == "bf16", unit_start=unit)
    xf = x.astype(np.float32)
    want = experts_reference(xf, tok, eid, w, cap, ref["gate_up"], ref["down"], bf16_act=act == "bf16",
                             unit_start=unit)
    tol = 2e-5 if act == "f32" else 2e-2
    assert rel_err(y, want) < tol
    # the two shares add up to the whole
    below = (experts_reference(xf, tok, eid, w, cap, ref["gate_up"], ref["down"], bf16_act=act == "bf16")
             - want)
    whole = run(pool, x, tok, eid, w, cap)
    assert rel_err(y + below, whole) < tol


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_window_and_tile_prefetch_change_speed_only(tier, fmt):
    """A column window's prefetch stopping at the window's end (`window_prefetch`, on by default) and long
    rows warming the next tile (`tile_prefetch`) change no result bit, on every tier: short rows (a tile
    ahead, the first tile's window lines) and in-row prefetch (short_row_bytes 0; distances 64 B and 512 B,
    inside and past short windows), 1 and 4 tokens per expert (AMX groups from 3), and the results equal
    the reference."""
    set_tier(tier)
    hidden, inter = 128, 256
    rng = np.random.default_rng(zlib.crc32(f"wpf{tier}{fmt}".encode()))
    pool, ref = make_pool(rng, fmt, 4, hidden, inter)
    x = rng.standard_normal((4, hidden)).astype(BF16)
    tok = np.array([0, 1, 2, 3, 0, 1], np.int32)
    eid = np.array([2, 2, 2, 2, 1, 3], np.int32)  # 4 tokens on expert 2, one on 1 and on 3
    w = rng.random(6).astype(np.float32)
    unit = np.array([64, 64, 64, 64, 224, 32], np.int32)
    want = experts_reference(x.astype(np.float32), tok, eid, w, 6, ref["gate_up"], ref["down"], bf16_act=True,
                             unit_start=unit)
    default = kernel_knobs()
    try:
        for vnni, dsum in ((64, False), (0, False), (64, True)):  # each loop (int4: q15 / bf16; down summed per token
            # or not) bit for bit under the prefetch knobs
            outs = []
            for pf, short in ((default["prefetch_bytes"], default["short_row_bytes"]), (64, 0), (512, 0)):
                for window, tile in ((True, False), (False, False), (True, True), (False, True)):
                    set_kernel_knobs(prefetch_bytes=pf, short_row_bytes=short, window_prefetch=window,
                                     tile_prefetch=tile, int4_vnni_tokens=vnni, down_sum=dsum)
                    assert (_host.window_prefetch(), _host.tile_prefetch()) == (window, tile)
                    outs.append(_host.run_experts(pool._h, x.view(np.uint16), tok, eid, w, 6, x_bf16=True,
                                                  unit_start=unit))
            for o in outs[1:]:
                np.testing.assert_array_equal(o, outs[0])
            assert rel_err(outs[0], want) < 2e-2
    finally:
        set_kernel_knobs(**default)


def test_kernel_knobs_set_parse_and_refuse():
    """`kernel_knobs` / `set_kernel_knobs` / `parse_knobs` / `knob_variants`: a round trip; a bad name, value or type raises
    ValueError and leaves every knob as it was (also those set before it in the same call)."""
    default = kernel_knobs()
    assert set(default) == {"gate_up_rows", "down_rows", "prefetch_bytes", "short_row_bytes", "window_prefetch",
                            "tile_prefetch", "int4_vnni_tokens", "int4_act_bits", "int4_q8_tokens",
                            "down_sum"}
    try:
        set_kernel_knobs(down_rows=64, tile_prefetch=True)
        assert kernel_knobs() == dict(default, down_rows=64, tile_prefetch=True)
        for bad in (dict(down_rows=128, gate_up_rows=12), dict(down_rows=128, window_prefetch="off"),
                    dict(down_rows=128, prefetch_bytes=1.5), dict(down_rows=128, nonsense=1)):
            with pytest.raises(ValueError):
                set_kernel_knobs(**bad)
            assert kernel_knobs() == dict(default, down_rows=64, tile_prefetch=True)
    finally:
        set_kernel_knobs(**default)
    assert kernel_knobs() == default
    assert parse_knobs("down_rows=32,window_prefetch=off,tile_prefetch=on") == {
        "down_rows": 32, "window_prefetch": False, "tile_prefetch": True}
    for bad, msg in (("rows=4", "not KNOB=VALUE"), ("down_rows", "not KNOB=VALUE"), ("tile_prefetch=1", "on or off"),
                     ("down_rows=x", "integer")):
        with pytest.raises(ValueError, match=msg):
            parse_knobs(bad)
    # knob_variants: whole knob dicts per spec, checked by setting them, the knobs back as they were
    assert knob_variants(["down_rows=64", "tile_prefetch=on,gate_up_rows=8"]) == {
        "down_rows=64": dict(default, down_rows=64), "tile_prefetch=on,gate_up_rows=8": dict(
            default, tile_prefetch=True, gate_up_rows=8)}
    with pytest.raises(ValueError, match="down_rows=12: .*power of two"):
        knob_variants(["down_rows=64", "down_rows=12"])
    assert kernel_knobs() == default


def test_unit_start_is_validated():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    tok, eid, w = np.zeros(2, np.int32), np.zeros(2, np.int32), np.ones(2, np.float32)
    pool, _ = make_pool(rng, "bf16", 2, 64, 64)
    with pytest.raises(ValueError, match="unit start 65 is outside"):
        _host.run_experts(pool._h, x, tok, eid, w, 2, unit_start=np.array([0, 65], np.int32))
    with pytest.raises(ValueError, match="unit_start must have"):
        _host.run_experts(pool._h, x, tok, eid, w, 2, unit_start=np.zeros(3, np.int32))
    pool4, _ = make_pool(rng, "int4", 2, 64, 64)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        _host.run_experts(pool4._h, x, tok, eid, w, 2, unit_start=np.array([16, 0], np.int32))


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int4"])
def test_expert_call_counts_the_weight_bytes_it_reads(fmt):
    """Each (expert, unit start) group's units [u, I) once, however many tokens route to it: the
    figure effective-rate benchmarks divide (`last_expert_call`, `expert_call_totals`); a call
    without tasks is not counted."""
    hidden, inter = 64, 128
    rng = np.random.default_rng(zlib.crc32(f"bytes{fmt}".encode()))
    pool, _ = make_pool(rng, fmt, 6, hidden, inter)
    x = rng.standard_normal((4, hidden)).astype(np.float32)
    eid = np.array([1, 1, 3, 3, 5, 0], np.int32)  # expert 1 twice at one start, expert 3 at two starts
    unit = np.array([32, 32, 0, 64, 128, 96], np.int32)
    tok = np.array([0, 1, 2, 3, 0, 1], np.int32)
    w = np.ones(6, np.float32)
    if fmt == "int4":
        whole = quant.matrix_bytes(2 * inter, hidden) + quant.matrix_bytes(hidden, inter)
    else:
        whole = 3 * hidden * inter * (4 if fmt == "f32" else 2)
    want = sum((inter - u) * whole // inter for u in (32, 0, 64, 128, 96))  # expert 5 at u = I: nothing
    calls0, bytes0 = expert_call_totals()
    _host.run_experts(pool._h, x, tok, eid, w, 6, unit_start=unit)
    assert _host.last_expert_call()["weight_bytes"] == want
    _host.run_experts(pool._h, x, tok, eid, w, 0)  # no tasks
    assert expert_call_totals() == (calls0 + 1, bytes0 + want)


def test_expert_call_time_totals_sum_the_calls_profiles():
    """`expert_call_time_totals` adds each call's `last_expert_call` times (what the decode benchmark's
    per-call breakdown divides); a call without tasks adds nothing."""
    rng = np.random.default_rng(7)
    pool, _ = make_pool(rng, "bf16", 4, 64, 96)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    tok, eid, w = np.array([0, 1, 1], np.int32), np.array([2, 0, 2], np.int32), np.ones(3, np.float32)
    keys = ("total_us", "setup_us", "layouts_us", "layouts_wait_us", "phase1_us", "phase1_wait_us", "phase2_us",
            "phase2_wait_us")
    for _ in range(2):
        t0 = expert_call_time_totals()
        _host.run_experts(pool._h, x, tok, eid, w, 3)
        last = _host.last_expert_call()
        _host.run_experts(pool._h, x, tok, eid, w, 0)
        t1 = expert_call_time_totals()
        assert t1["calls"] == t0["calls"] + 1
        assert last["total_us"] > 0 and last["phase1_us"] > 0 and last["phase2_us"] > 0
        for k in keys:
            assert t1[k] - t0[k] == pytest.approx(last[k], rel=1e-9, abs=1e-6), k


@pytest.mark.parametrize("tier", TIERS)
def test_many_tokens_one_expert_and_repeated_task(tier):
    set_tier(tier)
    rng = np.random.default_rng(4)
    pool, ref = make_pool(rng, "bf16", 3, 64, 32)
    T = 13  # more than any micro-tile's activation count
    x = rng.standard_normal((T, 64)).astype(np.float32)
    tok = np.concatenate([np.arange(T), [2, 2]]).astype(np.int32)  # token 2 twice on expert 1
    eid = np.ones(T + 2, np.int32)
    w = rng.random(T + 2).astype(np.float32)
    y = run(pool, x, tok, eid, w, T + 2)
    assert rel_err(y, experts_reference(x, tok, eid, w, T + 2, ref["gate_up"], ref["down"])) < 2e-5


def test_empty_task_list_gives_zeros():
    rng = np.random.default_rng(5)
    pool, _ = make_pool(rng, "bf16", 2, 32, 32)
    x = rng.standard_normal((3, 32)).astype(np.float32)
    z = np.zeros(0, np.int32)
    np.testing.assert_array_equal(run(pool, x, z, z, np.zeros(0, np.float32), 0), 0.0)
    tok, eid, w = tasks(rng, 3, 4, 2)
    np.testing.assert_array_equal(run(pool, x, tok, eid, w, 0), 0.0)


def test_bad_tasks_raise_with_the_value():
    rng = np.random.default_rng(6)
    pool, _ = make_pool(rng, "f32", 4, 32, 32)
    x = rng.standard_normal((2, 32)).astype(np.float32)
    w = np.ones(2, np.float32)
    with pytest.raises(ValueError, match="expert id 9 is outside"):
        run(pool, x, np.array([0, 1], np.int32), np.array([0, 9], np.int32), w, 2)
    with pytest.raises(ValueError, match="token index 5 is outside"):
        run(pool, x, np.array([5, 1], np.int32), np.array([0, 1], np.int32), w, 2)
    with pytest.raises(ValueError, match="n_valid 3 outside"):
        run(pool, x, np.array([0, 1], np.int32), np.array([0, 1], np.int32), w, 3)
    with pytest.raises(ValueError, match="x must be"):
        run(pool, np.zeros((2, 31), np.float32), np.array([0], np.int32), np.array([0], np.int32), w[:1], 1)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt,act", [("bf16", "f32"), ("bf16", "bf16"), ("int4", "f32"), ("int4", "bf16")])
def test_prefetch_distance_changes_no_bits(tier, fmt, act):
    """Software prefetch (AVX-512 tier) only moves lines early: every distance gives the same bits."""
    set_tier(tier)
    rng = np.random.default_rng(zlib.crc32(f"pf{tier}{fmt}{act}".encode()))
    pool, _ = make_pool(rng, fmt, 5, 256, 96)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    if act == "bf16":
        x = x.astype(BF16)
    tok, eid, w = tasks(rng, 4, 12, 5)
    default = _host.prefetch_bytes()
    try:
        outs = []
        for pf in (0, 64, default, 4096):
            _host.set_prefetch_bytes(pf)
            outs.append(run(pool, x, tok, eid, w, 12))
    finally:
        _host.set_prefetch_bytes(default)
    for y in outs[1:]:
        np.testing.assert_array_equal(y, outs[0])


def test_set_prefetch_bytes_rejects_out_of_range():
    for bad in (-1, (1 << 20) + 1):
        with pytest.raises(ValueError, match="prefetch distance"):
            _host.set_prefetch_bytes(bad)


def test_set_tier_rejects_unknown():
    with pytest.raises(ValueError, match="valid: auto"):
        set_tier("avx9000")
    assert TIERS[0] == "scalar"


def test_worker_pool_sizes_agree(monkeypatch):
    """Results do not depend on the number of worker threads (work split by output rows; with 15
    workers the items shrink to 4-8 rows for balance, and claims come in chunks)."""
    import ftjax.host
    from ftjax.host import configure_workers, worker_info

    monkeypatch.setattr(ftjax.host, "_configured_by_user", False)  # restored after the test
    rng = np.random.default_rng(7)
    pool, _ = make_pool(rng, "bf16", 6, 64, 64)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    tok, eid, w = tasks(rng, 4, 16, 6)
    base = run(pool, x, tok, eid, w, 16)
    try:
        for n in (0, 3, 15):
            configure_workers(n_workers=n, spin_us=20)
            assert worker_info()["n_threads"] == n + 1
            np.testing.assert_allclose(run(pool, x, tok, eid, w, 16), base, rtol=1e-6, atol=1e-6)
    finally:
        configure_workers()


@pytest.mark.parametrize("n_workers, spin_us", [(0, 100), (1, 100), (3, 20), (5, 0)])
def test_worker_pool_runs_each_item_once(n_workers, spin_us):
    """Random rounds (more workers than cores in the last two: workers get descheduled mid-round),
    a round larger than one ticket, an item that throws, and a clean round after it."""
    from ftjax import _host

    try:
        _host.configure_workers(n_workers, spin_us, True)
        assert _host.worker_self_test(200, 257, seed=n_workers, big=n_workers == 3) == 0
    finally:
        _host.configure_workers(-1, 100, True)


def test_gpu_workers_leave_cpus_to_the_runtime():
    from ftjax.host import GPU_SPARE_CPUS, gpu_workers

    assert gpu_workers(16) == 16 - GPU_SPARE_CPUS and gpu_workers(64) == 64 - GPU_SPARE_CPUS
    assert gpu_workers(12) == 12 - GPU_SPARE_CPUS
    assert [gpu_workers(n) for n in (1, 2, 4, 11)] == [0, 0, 2, 9]  # small hosts: the CPU-only default


def test_gpu_spin_only_for_a_pool_the_user_left_alone(monkeypatch):
    import ftjax.host as host

    monkeypatch.setattr(host, "_configured_by_user", False)
    try:
        host._host.configure_workers(-1, 100, True)  # the defaults, as at start-up
        host.tune_workers_for_gpu()
        info = host.worker_info()
        assert info["spin_us"] == host.GPU_SPIN_US
        assert info["n_workers"] == host.gpu_workers(info["physical_cores"])
        host.configure_workers(n_workers=1, spin_us=50)
        host.tune_workers_for_gpu()
        assert host.worker_info()["spin_us"] == 50 and host.worker_info()["n_workers"] == 1
    finally:
        host._host.configure_workers(-1, 100, True)


@pytest.mark.skipif("amx" not in TIERS, reason="needs the AMX tier")
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
@pytest.mark.parametrize("workers", [0, 15])
def test_amx_tier_takes_its_calls(fmt, workers):
    """Which loops the AMX tier runs (its per-route call counters): an expert of 8 tokens goes to the
    tile path of its format (int4: only past int4_vnni_tokens; up to it, the VNNI loop of the AVX-512 tier),
    1-2 tokens per expert to the AVX-512 loops, with 1 thread and with 16 (work items never shrink below the
    16-row tile then; they once did on the 16-core GPU host, and a dispatch slip once sent every int4 call of
    3+ tokens to AVX-512, all results still right)."""
    info = _host.worker_info()
    _host.configure_workers(workers, info["spin_us"], False)
    default = kernel_knobs()
    try:
        rng = np.random.default_rng(zlib.crc32(f"route{fmt}".encode()))
        pool, ref = make_pool(rng, fmt, 2, 256, 128)
        x = rng.standard_normal((8, 256)).astype(BF16)
        set_tier("amx")
        cases = [(np.arange(8), np.zeros(8), fmt, 4), (np.array([0, 1, 2]), np.array([0, 1, 1]), "avx512", 4)]
        if fmt == "int4":
            cases.append((np.arange(8), np.zeros(8), "avx512", 8))
        for tok, eid, path, vnni_tokens in cases:
            set_kernel_knobs(int4_vnni_tokens=vnni_tokens)
            tok, eid = tok.astype(np.int32), eid.astype(np.int32)
            w = rng.random(tok.size).astype(np.float32)
            before = _host.amx_route_counts()
            y = run(pool, x, tok, eid, w, tok.size)
            ran = {k: v - before[k] for k, v in _host.amx_route_counts().items()}
            assert ran[path] > 0 and sum(ran.values()) == ran[path], (tok.size, ran)
            want = experts_reference(x.astype(np.float32), tok, eid, w, tok.size, ref["gate_up"], ref["down"],
                                     bf16_act=True)
            assert rel_err(y, want) < 2e-2
    finally:
        set_kernel_knobs(**default)
        _host.configure_workers(info["n_workers"], info["spin_us"], info["pin"])


def test_item_rows_change_speed_only():
    """`set_gate_up_item_rows` / `set_down_item_rows`: a round's rows per work item (a power of two in [4, 1024])
    leave every result bit as they are (each output row is one item's dot products, whatever its size); bad
    values are refused."""
    info, default = _host.worker_info(), (_host.gate_up_item_rows(), _host.down_item_rows())
    _host.configure_workers(3, 20, False)
    rng = np.random.default_rng(11)
    pool, _ = make_pool(rng, "bf16", 5, 192, 128)
    x = rng.standard_normal((3, 192)).astype(BF16)
    tok, eid = np.array([0, 1, 2, 2], np.int32), np.array([4, 4, 1, 0], np.int32)
    w, unit = rng.random(4).astype(np.float32), np.array([0, 0, 32, 96], np.int32)
    try:
        outs = []
        for rows1, rows2 in ((16, 4), (16, 16), (4, 64), (64, 1024), (1024, 32)):
            _host.set_gate_up_item_rows(rows1)
            _host.set_down_item_rows(rows2)
            assert (_host.gate_up_item_rows(), _host.down_item_rows()) == (rows1, rows2)
            outs.append(_host.run_experts(pool._h, x.view(np.uint16), tok, eid, w, 4, x_bf16=True, unit_start=unit))
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])
        for bad in (0, 2, 12, 2048):
            with pytest.raises(ValueError, match="down item rows must be a power of two"):
                _host.set_down_item_rows(bad)
            with pytest.raises(ValueError, match="gate/up item rows must be a power of two"):
                _host.set_gate_up_item_rows(bad)
    finally:
        _host.set_gate_up_item_rows(default[0])
        _host.set_down_item_rows(default[1])
        _host.configure_workers(info["n_workers"], info["spin_us"], info["pin"])


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt,act", [("f32", "f32"), ("bf16", "bf16"), ("bf16", "f32"), ("int4", "bf16"),
                                     ("int4", "f32")])
def test_down_sum_agrees_with_per_expert_calls(tier, fmt, act):
    """`down_sum` (a token's lone experts' down rows summed in one pass, the AVX-512 tiers) against one call per
    expert: equal within f32 rounding, both equal to the reference; tokens with 1-5 lone experts beside a group of
    several tokens, unit windows [u, I) (some empty), odd-width rows (f32 / bf16: 37 x 48) and whole int4 groups."""
    set_tier(tier)
    hidden, inter = (64, 96) if fmt == "int4" else (37, 48)
    rng = np.random.default_rng(zlib.crc32(f"dsum{tier}{fmt}{act}".encode()))
    pool, ref = make_pool(rng, fmt, 9, hidden, inter)
    x = rng.standard_normal((4, hidden)).astype(np.float32)
    if act == "bf16":
        x = x.astype(BF16)
    tok = np.array([0, 0, 0, 0, 0, 1, 1, 2, 3, 3, 3], np.int32)
    eid = np.array([1, 2, 3, 4, 5, 2, 6, 7, 8, 8, 8], np.int32)  # token 3 three times on expert 8: one group
    eid[8:] = 8
    tok[8:] = [1, 2, 3]
    unit = np.array([0, 1, 2, 3, 0, 0, 1, 3, 0, 0, 0], np.int32) * (inter // 3)  # 3: u = I, no unit (int4: 32s)
    w = rng.random(tok.size).astype(np.float32)
    want = experts_reference(x.astype(np.float32), tok, eid, w, tok.size, ref["gate_up"], ref["down"],
                             bf16_act=act == "bf16", unit_start=unit)
    default = kernel_knobs()
    try:
        outs = {}
        for on in (True, False):
            set_kernel_knobs(down_sum=on)
            outs[on] = _host.run_experts(pool._h, x.view(np.uint16) if act == "bf16" else x, tok, eid, w, tok.size,
                                         x_bf16=act == "bf16", unit_start=unit)
    finally:
        set_kernel_knobs(**default)
    assert rel_err(outs[True], outs[False]) < (1e-5 if act == "f32" else 1e-2)
    tol = 2e-5 if act == "f32" else 2e-2
    for o in outs.values():
        assert rel_err(o, want) < tol
