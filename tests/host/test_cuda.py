"""CUDA FFI targets: zero-copy expert fill and the CPU-branch handshake inside jax.jit (GPU only)."""
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ftjax import _host
from ftjax.host import HostPool, cuda
from ftjax.host.reference import experts_reference

pytestmark = pytest.mark.gpu
if not cuda.available():
    pytest.skip("needs a CUDA build, a GPU and JAX's GPU backend", allow_module_level=True)

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def pool():
    rng = np.random.default_rng(0)
    banks = {"gate_up": (rng.standard_normal((32, 256, 128)) * 0.2).astype(BF16),
             "down": (rng.standard_normal((32, 128, 128)) * 0.2).astype(BF16)}
    p = HostPool.from_banks(banks)
    assert p.pin_if_cuda() and p.pinned
    return p


@pytest.mark.parametrize("blocks", [0, 1, 5])  # 0: occupy the GPU; 1 and 5: fewer blocks than entries
def test_fill_copies_valid_entries_only(pool, blocks):
    S = 16
    fill = jax.jit(lambda i, s, n, g, d: cuda.expert_fill(i, s, n, g, d, pool, blocks=blocks), donate_argnums=(3, 4))
    g = jnp.full((S, 256, 128), -3.0, jnp.bfloat16)
    d = jnp.full((S, 128, 128), -3.0, jnp.bfloat16)
    ids = np.array([5, 31, 0, -1, 7, 9, 2, 3], np.int32)  # -1: masked entry
    slots = np.array([3, 0, 15, 4, 6, 1, 2, 5], np.int32)
    for n_valid in (5, 0, 8):  # the count is device data: one executable, replayed
        g, d = fill(ids, slots, jnp.int32(n_valid), g, d)
        gh, dh = np.asarray(g.astype(jnp.float32)), np.asarray(d.astype(jnp.float32))
        for q in range(n_valid):
            if ids[q] >= 0:
                np.testing.assert_array_equal(gh[slots[q]], pool.bank("gate_up")[ids[q]].astype(np.float32))
                np.testing.assert_array_equal(dh[slots[q]], pool.bank("down")[ids[q]].astype(np.float32))
    untouched = sorted(set(range(S)) - set(slots[ids >= 0].tolist()))
    assert np.all(gh[untouched] == -3.0) and np.all(dh[untouched] == -3.0)


def test_fill_units_copies_the_units_only(pool):
    """The unit split's partial fill: gate rows [0, u), up rows [I, I + u) and down columns [0, u) of each
    valid entry's expert; every other element of the slot (and every other slot) keeps its value."""
    S, I = 16, 128
    fill = jax.jit(lambda i, s, n, u, g, d: cuda.expert_fill_units(i, s, n, u, g, d, pool), donate_argnums=(4, 5))
    ids = np.array([5, 31, -1, 7, 9], np.int32)  # -1: masked entry
    slots = np.array([3, 0, 4, 6, 1], np.int32)
    gu_src, dn_src = (pool.bank(b).astype(np.float32) for b in ("gate_up", "down"))
    for n_valid, u in ((4, 40), (5, 0), (2, 128), (5, 8)):  # count and units are device data: one executable
        g = jnp.full((S, 2 * I, 128), -3.0, jnp.bfloat16)
        d = jnp.full((S, 128, I), -3.0, jnp.bfloat16)
        g, d = fill(ids, slots, jnp.int32(n_valid), jnp.int32(u), g, d)
        gh, dh = np.asarray(g.astype(jnp.float32)), np.asarray(d.astype(jnp.float32))
        want_g, want_d = np.full(gh.shape, -3.0, np.float32), np.full(dh.shape, -3.0, np.float32)
        for q in range(n_valid):
            if ids[q] >= 0:
                s, e = slots[q], ids[q]
                want_g[s, :u], want_g[s, I:I + u] = gu_src[e, :u], gu_src[e, I:I + u]
                want_d[s, :, :u] = dn_src[e, :, :u]
        np.testing.assert_array_equal(gh, want_g)
        np.testing.assert_array_equal(dh, want_d)


def test_fill_fork_join_equals_fill(pool):
    """The experimental side-stream fill (bench/overlap.py), read through its join, fills what expert_fill
    fills, with GPU work issued between the fork and the join."""
    S = 16

    @jax.jit
    def step(i, s, n, g, d, m):
        g, d = cuda.expert_fill_fork(i, s, n, g, d, pool, lane=3, blocks=2)
        for _ in range(4):
            m = jnp.tanh(m @ m)
        g, d = cuda.join_banks(g, d, lane=3)
        return g, d, m

    ids = np.array([5, 31, 0, 7, 9, 2], np.int32)
    slots = np.array([3, 0, 15, 6, 1, 2], np.int32)
    m = jnp.full((512, 512), 0.001, jnp.float32)
    g = jnp.full((S, 256, 128), -3.0, jnp.bfloat16)
    d = jnp.full((S, 128, 128), -3.0, jnp.bfloat16)
    g, d, m = step(ids, slots, jnp.int32(5), g, d, m)
    gh, dh = np.asarray(g.astype(jnp.float32)), np.asarray(d.astype(jnp.float32))
    for q in range(5):
        np.testing.assert_array_equal(gh[slots[q]], pool.bank("gate_up")[ids[q]].astype(np.float32))
        np.testing.assert_array_equal(dh[slots[q]], pool.bank("down")[ids[q]].astype(np.float32))
    assert np.all(gh[slots[5]] == -3.0) and np.all(dh[slots[5]] == -3.0)


def test_background_fork_and_wait_fill_every_layer(pool):
    """Two layers' fill lists forked in one call (as after a decode step's last layer), GPU work, then
    each layer's wait: the banks read after the waits hold the rows; a second fork reuses the lists."""
    S, L, F = 16, 2, 3
    bg = cuda.create_background(L, F)

    @jax.jit
    def step(ids, slots, n, g, d, m):
        g, d = cuda.background_fork(ids, slots, n, g, d, pool, bg, blocks=2)
        for _ in range(4):
            m = jnp.tanh(m @ m)
        for layer in range(L):
            g, d = cuda.background_wait(g, d, bg, layer)
        return g, d, m

    g = jnp.full((S, 256, 128), -3.0, jnp.bfloat16)
    d = jnp.full((S, 128, 128), -3.0, jnp.bfloat16)
    m = jnp.full((512, 512), 0.001, jnp.float32)
    for ids, slots, n in (([[5, 31, 0], [7, 9, 2]], [[3, 0, 15], [6, 1, 2]], [2, 3]),
                          ([[11, 12, 13], [14, 15, 16]], [[4, 5, 7], [8, 9, 10]], [0, 1])):
        ids, slots = np.asarray(ids, np.int32), np.asarray(slots, np.int32)
        g, d, m = step(ids, slots, np.asarray(n, np.int32), g, d, m)
        gh, dh = np.asarray(g.astype(jnp.float32)), np.asarray(d.astype(jnp.float32))
        for layer in range(L):
            for q in range(n[layer]):
                np.testing.assert_array_equal(gh[slots[layer, q]], pool.bank("gate_up")[ids[layer, q]].astype(np.float32))
                np.testing.assert_array_equal(dh[slots[layer, q]], pool.bank("down")[ids[layer, q]].astype(np.float32))
    assert np.all(gh[[11, 12, 13, 14, 15]] == -3.0)  # never named by a valid entry
    assert not cuda.background_error(bg)


def test_background_fork_units_from_copies_the_rest(pool):
    """``units_from``: a layer with u > 0 copies only units [u, I) of its experts (gate rows, up rows, down
    columns: what a unit-split call's partial fill left), a layer with 0 whole experts."""
    S, L, F, I = 8, 2, 2, 128
    bg = cuda.create_background(L, F)

    @jax.jit
    def step(ids, slots, n, frm, g, d):
        g, d = cuda.background_fork(ids, slots, n, g, d, pool, bg, units_from=frm, blocks=3)
        for layer in range(L):
            g, d = cuda.background_wait(g, d, bg, layer)
        return g, d

    ids, slots = np.array([[5, 31], [7, 9]], np.int32), np.array([[3, 0], [6, 1]], np.int32)
    gu_src, dn_src = (pool.bank(b).astype(np.float32) for b in ("gate_up", "down"))
    for u in (40, 120):
        g, d = step(ids, slots, np.array([2, 1], np.int32), np.array([u, 0], np.int32),
                    jnp.full((S, 2 * I, 128), -3.0, jnp.bfloat16), jnp.full((S, 128, I), -3.0, jnp.bfloat16))
        gh, dh = np.asarray(g.astype(jnp.float32)), np.asarray(d.astype(jnp.float32))
        want_g, want_d = np.full(gh.shape, -3.0, np.float32), np.full(dh.shape, -3.0, np.float32)
        for s_, e in zip(slots[0], ids[0]):  # layer 0: units [u, I)
            want_g[s_, u:I], want_g[s_, I + u:] = gu_src[e, u:I], gu_src[e, I + u:]
            want_d[s_, :, u:] = dn_src[e, :, u:]
        want_g[slots[1, 0]], want_d[slots[1, 0]] = gu_src[ids[1, 0]], dn_src[ids[1, 0]]  # layer 1: whole
        np.testing.assert_array_equal(gh, want_g)
        np.testing.assert_array_equal(dh, want_d)
    assert not cuda.background_error(bg)
    cuda.destroy_background(bg)


def test_background_wait_timeout_sets_the_error_flag(pool):
    """A wait that gives up (here: timeout 0 ms against a 32-expert fill) sets `background_error`, never a
    hang; `clear_background_error` resets it (a fresh cache state)."""
    S, L, F = 32, 2, 16
    bg = cuda.create_background(L, F)

    @jax.jit
    def step(ids, slots, n, g, d):
        g, d = cuda.background_fork(ids, slots, n, g, d, pool, bg, blocks=1)
        return cuda.background_wait(g, d, bg, L - 1, timeout_ms=0)

    ids = np.arange(L * F, dtype=np.int32).reshape(L, F) % pool.n_experts
    slots = np.arange(L * F, dtype=np.int32).reshape(L, F) % S
    g, d = step(ids, slots, np.full(L, F, np.int32), jnp.zeros((S, 256, 128), jnp.bfloat16),
                jnp.zeros((S, 128, 128), jnp.bfloat16))
    jax.block_until_ready((g, d))
    cuda.sync_fills()
    assert cuda.background_error(bg)
    cuda.clear_background_error(bg)
    assert not cuda.background_error(bg)
    cuda.destroy_background(bg)
    with pytest.raises(ValueError, match="no background"):
        cuda.background_error(bg)


def test_transfer_words_return_to_zero(pool):
    """The words the background yields to (in-step fill blocks running, CPU branches in flight) are back at
    0 after in-step fills (whole, units, empty) and after submit/collect pairs (skipped, real, failed)."""
    channel = 130
    cuda.create_channel(channel, pool, max_tokens=2, max_tasks=4)  # (makes the words)
    assert cuda.transfer_words() == (0, 0)
    S = 8
    g, d = jnp.zeros((S, 256, 128), jnp.bfloat16), jnp.zeros((S, 128, 128), jnp.bfloat16)
    ids, slots = np.array([3, 4, 5], np.int32), np.array([0, 1, 2], np.int32)
    for n in (3, 0):
        g, d = cuda.expert_fill(ids, slots, n, g, d, pool)
        g, d = cuda.expert_fill(ids, slots, n, g, d, pool, blocks=2)
        g, d = cuda.expert_fill_units(ids, slots, n, 64, g, d, pool)
        jax.block_until_ready((g, d))
        assert cuda.transfer_words() == (0, 0)
    x = jnp.ones((2, 128), jnp.float32)
    for fused in (False, True):
        for eid, n in ((np.zeros(4, np.int32), 0), (np.array([0, 1, 2, 3], np.int32), 4),
                       (np.array([0, 1, 99, 0], np.int32), 4)):  # skipped, served, failed (expert 99)
            tok = cuda.cpu_experts_submit(x, np.zeros(4, np.int32), eid, np.ones(4, np.float32), n, channel,
                                          fused=fused)
            jax.block_until_ready(cuda.cpu_experts_collect(tok, 2, 128, channel, fused=fused))
            assert cuda.transfer_words() == (0, 0)
    cuda.destroy_channel(channel)


@pytest.mark.parametrize("word, mode, pauses", [(1, "fills+cpu", True), (1, "cpu", True), (1, "fills", False),
                                                (0, "fills", True), (0, "off", False)])
def test_background_yield_pauses_for_a_held_word_and_is_bounded(pool, word, mode, pauses):
    """A background fill under a yield mode pauses while a word it yields to is held (here by hand: a CPU
    branch or an in-step fill that never ends), and only for a bounded time (200 us a pause, 2 ms per
    thread): it still lands, correct, and the wait on it never times out."""
    S, L, F = 16, 1, 8
    bg = cuda.create_background(L, F)
    assert cuda.background_yield(bg) == "off"
    with pytest.raises(ValueError, match="background yield"):
        cuda.set_background_yield(bg, "always")
    cuda.set_background_yield(bg, mode)
    assert cuda.background_yield(bg) == mode

    @jax.jit
    def step(ids, slots, n, g, d):
        g, d = cuda.background_fork(ids, slots, n, g, d, pool, bg, blocks=1)
        return cuda.background_wait(g, d, bg, 0)

    ids = np.arange(F, dtype=np.int32).reshape(L, F) + 3
    slots = np.arange(F, dtype=np.int32).reshape(L, F)

    def timed():
        times = []
        for _ in range(3):
            g, d = jnp.zeros((S, 256, 128), jnp.bfloat16), jnp.zeros((S, 128, 128), jnp.bfloat16)
            jax.block_until_ready((g, d))
            t0 = time.perf_counter()
            g, d = jax.block_until_ready(step(ids, slots, np.full(L, F, np.int32), g, d))
            times.append(time.perf_counter() - t0)
        for q in range(F):
            np.testing.assert_array_equal(np.asarray(g[q].astype(jnp.float32)),
                                          pool.bank("gate_up")[ids[0, q]].astype(np.float32))
            np.testing.assert_array_equal(np.asarray(d[q].astype(jnp.float32)),
                                          pool.bank("down")[ids[0, q]].astype(np.float32))
        return sorted(times)[1]

    free = timed()
    cuda.add_transfer_word(word, 1)
    try:
        held = timed()
    finally:
        cuda.add_transfer_word(word, -1)
    assert cuda.transfer_words() == (0, 0)
    assert not cuda.background_error(bg)
    # 8 experts of 96 KiB by one block: ~48 copy iterations a thread; held, each pauses until its 2 ms run out
    assert (held - free > 1.5e-3) == pauses, (held, free)
    cuda.destroy_background(bg)


def test_fill_rejects_negative_blocks(pool):
    with pytest.raises(ValueError, match="blocks must be >= 0"):
        cuda.expert_fill(np.zeros(2, np.int32), np.zeros(2, np.int32), 1, jnp.zeros((4, 256, 128), jnp.bfloat16),
                         jnp.zeros((4, 128, 128), jnp.bfloat16), pool, blocks=-1)


def test_fill_rejects_wrong_cache_size(pool):
    with pytest.raises(Exception, match="cache sizes do not match"):
        cuda.expert_fill(np.zeros(2, np.int32), np.zeros(2, np.int32), 1, jnp.zeros((4, 256, 64), jnp.bfloat16),
                         jnp.zeros((4, 128, 128), jnp.bfloat16), pool)[0].block_until_ready()


@pytest.mark.parametrize("cmd_buffer, fused", [(True, False), (False, False), (True, True)])
def test_submit_collect_overlaps_gpu_work_and_matches(pool, cmd_buffer, fused):
    channel = 100 + int(cmd_buffer) + 2 * int(fused)
    cuda.create_channel(channel, pool, max_tokens=8, max_tasks=32)

    @jax.jit
    def step(x, tok, eid, w, n, m):
        token = cuda.cpu_experts_submit(x, tok, eid, w, n, channel, cmd_buffer=cmd_buffer, fused=fused)
        for _ in range(4):  # GPU work that runs while the CPU computes
            m = jnp.tanh(m @ m)
        y, status, m = cuda.cpu_experts_collect(token, x.shape[0], 128, channel, after=m, cmd_buffer=cmd_buffer,
                                                fused=fused)
        return y, status, m

    rng = np.random.default_rng(1)
    ref_banks = {b: pool.bank(b).astype(np.float32) for b in ("gate_up", "down")}
    m = jnp.asarray(rng.standard_normal((512, 512)) * 0.01, jnp.float32)
    # Fresh inputs each step (a replay must not reuse stale staging); n = 0 is skipped on the GPU:
    # zeros, and the CPU never sees a request.
    for n in (0, 32, 13, 0, 1, 27):
        x = rng.standard_normal((6, 128)).astype(np.float32)
        tok = rng.integers(0, 6, 32).astype(np.int32)
        eid = rng.integers(0, 32, 32).astype(np.int32)
        w = rng.random(32).astype(np.float32)
        jobs, served = cuda.channel_served(channel)
        y, status, m = step(x, tok, eid, w, jnp.int32(n), m)
        assert int(status) == 0, cuda.channel_error(channel)
        jobs_after, served_after = cuda.channel_served(channel)
        assert jobs_after == _host.channel_jobs(channel) == jobs + (n > 0)
        assert (served_after > served) == (n > 0)  # only a served job adds coordinator time
        want = experts_reference(x, tok, eid, w, n, ref_banks["gate_up"], ref_banks["down"])
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)


def test_fused_handshake_stamps_each_call(pool):
    """The fused submit and collect stamp every call in the channel's ring, in order: a published call's seqs
    agree and its times run start <= published <= collect start <= done seen <= end; the coordinator stamps
    each request it served with the same seq, and its own span fits inside the GPU's (the GPU published
    before the CPU saw the request and saw done after the CPU published it; 2 us for the timer's grain)."""
    channel = 105
    cuda.create_channel(channel, pool, max_tokens=8, max_tasks=32)
    assert cuda.channel_stamps(channel)["gpu"].shape == (0, len(cuda.STAMP_COLUMNS))
    step = jax.jit(lambda x, tok, eid, w, n, m: cuda.cpu_experts_collect(
        cuda.cpu_experts_submit(x, tok, eid, w, n, channel), 6, 128, channel, after=jnp.tanh(m @ m)))
    rng = np.random.default_rng(2)
    m = jnp.asarray(rng.standard_normal((256, 256)) * 0.01, jnp.float32)
    ns = (0, 32, 13, 0, 1, 27)
    for n in ns:
        x = rng.standard_normal((6, 128)).astype(np.float32)
        tok, eid = rng.integers(0, 6, 32).astype(np.int32), rng.integers(0, 32, 32).astype(np.int32)
        _, status, m = step(x, tok, eid, rng.random(32).astype(np.float32), jnp.int32(n), m)
        assert int(status) == 0, cuda.channel_error(channel)
    jax.block_until_ready(m)
    st = cuda.channel_stamps(channel)
    gpu, host = st["gpu"], st["host"]
    assert st["submits"] == st["collects"] == len(ns) and gpu.shape == (len(ns), len(cuda.STAMP_COLUMNS))
    c = {name: gpu[:, i] for i, name in enumerate(cuda.STAMP_COLUMNS)}
    np.testing.assert_array_equal(c["submit_seq"], c["collect_seq"])
    np.testing.assert_array_equal(c["submit_seq"] > 0, np.asarray(ns) > 0)  # skipped calls publish nothing
    for a, b in (("submit_start", "published"), ("published", "collect_start"), ("collect_start", "done_seen"),
                 ("done_seen", "collect_end")):
        assert (c[a] <= c[b]).all(), (a, b)
    assert (np.diff(c["submit_start"]) > 0).all()  # call order
    h = {name: host[:, i] for i, name in enumerate(cuda.HOST_STAMP_COLUMNS)}
    assert st["served"] == host.shape[0] == sum(n > 0 for n in ns)
    np.testing.assert_array_equal(h["seq"], c["submit_seq"][c["submit_seq"] > 0])
    assert (h["job"] == 1).all() and (h["done"] >= h["seen"]).all()
    published = c["submit_seq"] > 0
    gpu_span = (c["done_seen"] - c["published"])[published]
    assert (h["done"] - h["seen"] <= gpu_span + 2000).all(), (h["done"] - h["seen"], gpu_span)
    cuda.destroy_channel(channel)


@pytest.mark.parametrize("fused", [False, True])
def test_submit_carries_unit_starts(pool, fused):
    """Per-task unit starts reach the CPU branch: a task adds only its expert's units [u, I)."""
    channel = 110 + int(fused)
    cuda.create_channel(channel, pool, max_tokens=4, max_tasks=16)
    step = jax.jit(lambda x, tok, eid, w, n, u: cuda.cpu_experts_collect(
        cuda.cpu_experts_submit(x, tok, eid, w, n, channel, unit_start=u, fused=fused), 4, 128, channel,
        fused=fused))
    rng = np.random.default_rng(3)
    ref_banks = {b: pool.bank(b).astype(np.float32) for b in ("gate_up", "down")}
    x = rng.standard_normal((4, 128)).astype(np.float32)
    tok = rng.integers(0, 4, 16).astype(np.int32)
    eid = rng.integers(0, 32, 16).astype(np.int32)
    w = rng.random(16).astype(np.float32)
    units = rng.choice([0, 8, 64, 120, 128], 16).astype(np.int32)
    y, status = step(x, tok, eid, w, jnp.int32(16), units)
    assert int(status) == 0, cuda.channel_error(channel)
    want = experts_reference(x, tok, eid, w, 16, ref_banks["gate_up"], ref_banks["down"], unit_start=units)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)
    whole = experts_reference(x, tok, eid, w, 16, ref_banks["gate_up"], ref_banks["down"])
    assert np.abs(whole - want).max() > 1e-2  # the unit starts changed the result
    cuda.destroy_channel(channel)


@pytest.mark.parametrize("fused", [False, True])
def test_cpu_failure_and_watchdog_become_status_not_hang(pool, fused):
    channel = 200 + int(fused)
    cuda.create_channel(channel, pool, max_tokens=2, max_tasks=4)
    x = jnp.ones((2, 128), jnp.float32)
    bad = np.array([0, 1, 99, 0], np.int32)  # expert 99 is outside the pool
    tok = cuda.cpu_experts_submit(x, np.zeros(4, np.int32), bad, np.ones(4, np.float32), 4, channel, fused=fused)
    y, status = cuda.cpu_experts_collect(tok, 2, 128, channel, fused=fused)
    assert int(status) == 2 and np.isnan(np.asarray(y)).all()
    assert "expert id 99" in cuda.channel_error(channel)
    assert cuda.transfer_words() == (0, 0)
    # A sequence number the CPU never serves: the GPU wait gives up after timeout_ms.
    y, status = cuda.cpu_experts_collect(jnp.asarray([10**6], jnp.int32), 2, 128, channel, timeout_ms=50, fused=fused)
    assert int(status) == 1 and np.isnan(np.asarray(y)).all()
    # That collect left the CPU word as every collect does, for a branch no submit entered: give it back, or
    # the later tests (the background yield, the unit split's "words back at 0") see -1 per run of this test
    assert cuda.transfer_words() == (0, -1)
    cuda.add_transfer_word(1, 1)
    assert cuda.transfer_words() == (0, 0)


def _fill_beside_reference(x, route_slot, route_units, slot_expert, filled, k, gate_up, down, bf16):
    """y [R, H] of `expert_fill_beside`: each computed route's expert (``slot_expert[slot]``, the fill's for a
    filled slot) over its units [0, route_units[r]), with the kernel's bf16 rounding of the gate / up outputs and
    of the activation for bf16 pools; rows of routes it does not compute are zero."""
    rnd = (lambda v: v.astype(np.float32).astype(BF16).astype(np.float64)) if bf16 else (lambda v: v)
    inter = down.shape[-1]
    y = np.zeros((len(route_slot), down.shape[1]))
    for r, (s, u) in enumerate(zip(route_slot, route_units)):
        if s < 0 or s not in slot_expert or (filled is not None and s not in filled):
            continue
        e, xt = slot_expert[s], np.asarray(x[r // k], np.float64)
        g = rnd(np.asarray(gate_up[e, :u], np.float64) @ xt)
        up = rnd(np.asarray(gate_up[e, inter:inter + u], np.float64) @ xt)
        y[r] = np.asarray(down[e][:, :u], np.float64) @ rnd(g / (1.0 + np.exp(-g)) * up)
    return y


@pytest.mark.parametrize("dtype,inter", [("bf16", 128), ("bf16", 40), ("f32", 24)])
@pytest.mark.parametrize("hits", [False, True])
def test_fill_beside_computes_the_filled_routes_and_the_hits(dtype, inter, hits):
    """The fill beside the GEMV as one op against numpy: units [0, u) of the valid fill entries land in their slots,
    and y holds the filled routes (with ``hits``, every route with a slot: a slot of an entry past n_valid is a
    hit), each over its own units: whole rows, and units that end inside a 16-byte vector of a down row (100 / 36 / 21:
    the element-wise tail); slots used by two tokens with different units."""
    rng = np.random.default_rng(inter + hits)
    H, N, S, T, k, u_fill = 64, 24, 8, 3, 3, 16
    np_dtype, jdtype = (BF16, jnp.bfloat16) if dtype == "bf16" else (np.float32, jnp.float32)
    banks = {"gate_up": (rng.standard_normal((N, 2 * inter, H)) * 0.2).astype(np_dtype),
             "down": (rng.standard_normal((N, H, inter)) * 0.2).astype(np_dtype)}
    p = HostPool.from_banks(banks)
    assert p.pin_if_cuda() and p.pinned
    gu_src, dn_src = (banks[b].astype(np.float32) for b in ("gate_up", "down"))
    resident = {0: 4, 1: 9, 2: 17, 3: 2, 6: 21}  # slot -> the expert it holds before the call
    ids = np.array([11, 23, -1], np.int32)  # fill entries: expert -> slot (the last masked)
    slots = np.array([5, 6, 7], np.int32)
    tail = {128: 100, 40: 36, 24: 21}[inter]
    route_slot = np.array([0, 5, -1, 1, 6, 2, 0, 5, 3], np.int32)  # token t's routes are 3t .. 3t + 2
    route_units = np.array([inter, u_fill, inter, tail, u_fill, inter, 8, u_fill, inter], np.int32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    call = jax.jit(lambda x, rs, ru, i, s, n, u, g, d: cuda.expert_fill_beside(x, rs, ru, i, s, n, u, g, d, p,
                                                                                blocks=4, hits=hits))
    for n_valid in (2, 1):  # n_valid 1: slot 6 is not filled but holds expert 21 (a hit)
        g, d = np.full((S, 2 * inter, H), -3.0, np.float32), np.full((S, H, inter), -3.0, np.float32)
        for s, e in resident.items():
            g[s], d[s] = gu_src[e], dn_src[e]
        g, d = jnp.asarray(g, jdtype), jnp.asarray(d, jdtype)
        y = np.asarray(call(jnp.asarray(x, jdtype), route_slot, route_units, ids, slots, jnp.int32(n_valid),
                            jnp.int32(u_fill), g, d))
        filled = {int(slots[q]): int(ids[q]) for q in range(n_valid) if ids[q] >= 0}
        want = _fill_beside_reference(np.asarray(jnp.asarray(x, jdtype).astype(jnp.float32)), route_slot,
                                      route_units, {**resident, **filled}, None if hits else set(filled), k,
                                      gu_src, dn_src, dtype == "bf16")
        assert np.abs(y - want).max() <= (2e-2 if dtype == "bf16" else 1e-4) * np.abs(want).max()
        assert np.all(y[route_slot < 0] == 0)
        if not hits:  # the hits' rows are left to the GEMV
            assert np.all(y[[r for r, s in enumerate(route_slot) if s >= 0 and s not in filled]] == 0)
        gh, dh = np.asarray(g.astype(jnp.float32)), np.asarray(d.astype(jnp.float32))  # written in place
        for s, e in filled.items():
            np.testing.assert_array_equal(gh[s, :u_fill], gu_src[e, :u_fill])
            np.testing.assert_array_equal(gh[s, inter:inter + u_fill], gu_src[e, inter:inter + u_fill])
            np.testing.assert_array_equal(dh[s][:, :u_fill], dn_src[e][:, :u_fill])
        assert np.all(gh[7] == -3.0)  # the masked entry's slot
