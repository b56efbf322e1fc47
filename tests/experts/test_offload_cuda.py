"""The product path on the GPU: OffloadExperts(platform="cuda") - zero-copy FFI fill from the pinned pool,
the CPU branch through the submit/collect handshake - equals the resident model (GPU only).

The CPU-platform twin (every policy and cache size, CI) is test_offload.py; this runs a subset of its
matrix where the GPU path differs: the fill kernel, the handshake, and the three plan update forms. fp32 at
"highest" matmul precision (tests/conftest.py).
"""
import numpy as np
import pytest
from test_offload import SIZES, E, L, bank_copies, decode_hlo, make_model, run  # tests/experts is on sys.path

from ftjax.experts.cache import check_invariants
from ftjax.experts.decode import OffloadExperts
from ftjax.experts.resident import ResidentExperts
from ftjax.host import cuda

pytestmark = pytest.mark.gpu
if not cuda.available():
    pytest.skip("needs a CUDA build, a GPU and JAX's GPU backend", allow_module_level=True)


@pytest.fixture(scope="module")
def setup():
    cfg, params, banks, pool = make_model()
    assert pool.pin_if_cuda() and pool.pinned
    ref = {b: run(cfg, params, ResidentExperts(E), ResidentExperts.init_state(banks), b)[0] for b in (1, 3)}
    return cfg, params, pool, ref


@pytest.mark.parametrize("policy,size,batch,plan_impl,victims_by,defer", [
    ("lru-split", "37%", 1, "mixed", "topk", True), ("lru-split", "min", 3, "mixed", "rank", True),
    ("lru-split", "37%", 3, "dense", "topk", True), ("lru-fill", "layer", 3, "scatter", "rank", True),
    ("lru-fill", "37%", 1, "dense", "topk", True), ("lru-split", "37%", 1, "scatter", "rank", True),
    ("lru-split", "37%", 1, "scatter", "rank", False), ("lru-split", "min", 1, "scatter", "rank", True),
    ("lru-split", "layer", 1, "scatter", "topk", True),
    ("static", "37%", 3, "mixed", "topk", True), ("cpu", None, 3, "mixed", "topk", True),
    # the fused plan (the default: one kernel per layer call)
    ("lru-split", "37%", 1, "fused", None, True), ("lru-split", "min", 3, "fused", None, True),
    ("lru-fill", "layer", 3, "fused", None, True), ("static", "37%", 3, "fused", None, True),
    ("cpu", None, 3, "fused", None, True), ("lru-split", "37%", 3, "fused", None, False)])
def test_cuda_offload_equals_resident(setup, policy, size, batch, plan_impl, victims_by, defer):
    """``defer``: lru-split decode calls may fill in the background (``defer_fills``; a forked fill on
    the side stream, joined at the layer's next call)."""
    cfg, params, pool, ref = setup
    S = 0 if policy == "cpu" else SIZES[size]
    backend = OffloadExperts(pool, L, E, S, policy, platform="cuda", plan_impl=plan_impl, victims_by=victims_by,
                             defer_fills=defer)
    got, st = run(cfg, params, backend, backend.init_state(fill_fraction=0.4), batch, check=check_invariants,
                  freeze=backend.freeze_hot_set)
    want = ref[batch]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    stats = {k: np.asarray(v) for k, v in st["stats"].items()}
    assert np.array_equal(stats["misses"], stats["fills"] + stats["cpu_experts"] - stats["deferred"])
    if policy == "lru-split" and size == "37%" and batch == 1:  # f = 0.4: a lone miss is deferred
        assert (stats["deferred"].sum() > 0) == defer
    backend.drain()  # every slot holds its owner's rows, background fills included
    owner = np.asarray(st["owner_of"])
    for s in np.flatnonzero(owner >= 0):
        for b in ("gate_up", "down"):
            np.testing.assert_array_equal(np.asarray(st[b][s]), pool.bank(b)[owner[s]].astype(np.float32))
    if policy in ("cpu", "static") or (policy == "lru-split" and batch > 1):  # the handshake carried work
        assert stats["cpu_experts"].sum() > 0
    jobs, seconds = backend.cpu_served()  # a layer call with CPU work is one job of its channel
    assert (jobs > 0) == (seconds > 0)
    if stats["cpu_experts"].sum() > 0:
        assert jobs > 0
    if policy in ("lru-split", "lru-fill"):  # and the fill kernel
        assert stats["fills"].sum() > 0



@pytest.mark.parametrize("size,batch,background_yield", [("37%", 1, "fills+cpu"), ("min", 3, "fills"),
                                                       ("layer", 1, "off"), ("37%", 3, "cpu")])
def test_cuda_unit_split_equals_resident(setup, size, batch, background_yield):
    """The unit split on the GPU: a split call's partial fill (units [0, u)), the CPU branch's unit starts
    ([u, I)), the background fill that completes the split slots (pausing for the in-step transfers under
    ``background_yield``): the resident logits, and after a drain every slot holds its owner's whole rows
    and the transfer words are back at 0."""
    cfg, params, pool, ref = setup
    backend = OffloadExperts(pool, L, E, SIZES[size], "lru-split", platform="cuda", defer_fills=True,
                             unit_split=True, background_yield=background_yield)
    assert cuda.background_yield(backend.background_id) == background_yield
    got, st = run(cfg, params, backend, backend.init_state(fill_fraction=0.4), batch, check=check_invariants)
    want = ref[batch]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    stats = {k: np.asarray(v) for k, v in st["stats"].items()}
    assert np.array_equal(stats["misses"], stats["fills"] + stats["cpu_experts"] - stats["deferred"])
    if size == "37%":  # f = 0.4, I = 16 in steps of 8: a lone miss splits at u = 8
        assert stats["deferred"].sum() > 0
    backend.drain()
    assert cuda.transfer_words() == (0, 0)
    owner = np.asarray(st["owner_of"])
    for s in np.flatnonzero(owner >= 0):
        for b in ("gate_up", "down"):
            np.testing.assert_array_equal(np.asarray(st[b][s]), pool.bank(b)[owner[s]].astype(np.float32))



@pytest.mark.parametrize("size,batch,blocks,gemv", [("37%", 1, 32, False), ("min", 3, 0, False), ("layer", 1, 1, False),
                                                     ("37%", 3, 32, False), ("37%", 1, 32, True), ("min", 3, 0, True),
                                                     ("37%", 3, 32, True)])
def test_cuda_fill_beside_equals_resident(setup, size, batch, blocks, gemv):
    """The unit split's fill and its routes in one call beside the GEMV (``fill_beside``): the resident logits;
    the call filled (its slots hold their owners' rows after a drain, so the hidden writes landed) and computed
    the filled routes (a route both left out of the GEMV and of the beside call would change the logits). With
    ``fill_beside_gemv`` the call computes the hit routes too, beside its fill on its own side stream."""
    cfg, params, pool, ref = setup
    backend = OffloadExperts(pool, L, E, SIZES[size], "lru-split", platform="cuda", defer_fills=True,
                             unit_split=True, fill_beside=True, fill_beside_blocks=blocks, fill_beside_gemv=gemv)
    got, st = run(cfg, params, backend, backend.init_state(fill_fraction=0.4), batch, check=check_invariants)
    want = ref[batch]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    stats = {k: np.asarray(v) for k, v in st["stats"].items()}
    assert stats["fills"].sum() > 0
    backend.drain()
    owner = np.asarray(st["owner_of"])
    for s in np.flatnonzero(owner >= 0):
        for b in ("gate_up", "down"):
            np.testing.assert_array_equal(np.asarray(st[b][s]), pool.bank(b)[owner[s]].astype(np.float32))


@pytest.mark.parametrize("policy,size,batch,unit_split", [("lru-split", "37%", 1, True), ("lru-split", "min", 3, True),
                                                          ("lru-fill", "layer", 3, False), ("cpu", None, 3, False),
                                                          ("lru-split", "37%", 3, False)])
def test_cuda_ih_pool_equals_resident(setup, policy, size, batch, unit_split):
    """A pool whose down bank is stored transposed (``down_layout="ih"``): the fills transpose into the slots
    (whole, units [0, u), the background's rest), the CPU branch reads the rows: the resident logits, and after a
    drain every slot holds its owner's [H, I]."""
    from ftjax.host import HostPool

    cfg, params, hi_pool, ref = setup
    pool = HostPool.from_banks({b: hi_pool.bank(b) for b in ("gate_up", "down")}, down_layout="ih")
    assert pool.pin_if_cuda()
    S = 0 if policy == "cpu" else SIZES[size]
    backend = OffloadExperts(pool, L, E, S, policy, platform="cuda", defer_fills=True, unit_split=unit_split)
    got, st = run(cfg, params, backend, backend.init_state(fill_fraction=0.4), batch, check=check_invariants)
    want = ref[batch]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    backend.drain()
    owner = np.asarray(st["owner_of"])
    for s in np.flatnonzero(owner >= 0):
        for b in ("gate_up", "down"):
            np.testing.assert_array_equal(np.asarray(st[b][s]), pool.bank(b)[owner[s]].astype(np.float32))

@pytest.mark.parametrize("batch", [1, 3])
def test_decode_step_never_copies_a_bank(setup, batch):
    """A copy of a bank made while a background fill writes it would hold stale rows: the compiled decode
    step (background fills on) must update the banks in place only."""
    cfg, params, pool, ref = setup
    backend = OffloadExperts(pool, L, E, SIZES["37%"], "lru-split", platform="cuda", defer_fills=True)
    state = backend.init_state(fill_fraction=0.4)
    hlo = decode_hlo(cfg, params, backend, state, batch)
    assert "ftjax_bg_wait" in hlo and "ftjax_bg_fork" in hlo
    assert not bank_copies(hlo, state), bank_copies(hlo, state)


def test_dropped_backend_frees_its_staging(setup):
    """A CUDA backend's CPU-branch channels (pinned staging, ~4 MiB per layer at 256 tokens) and its
    background-fill state are freed once the backend is unreachable, after its steps ran (fills in flight)."""
    import gc

    cfg, params, pool, ref = setup
    gc.collect()
    channels, backgrounds = cuda.live_channels(), cuda.live_backgrounds()
    backend = OffloadExperts(pool, L, E, SIZES["37%"], "lru-split", platform="cuda")  # background fills: default
    assert backend.background_fills
    assert (cuda.live_channels(), cuda.live_backgrounds()) == (channels + L, backgrounds + 1)
    got, st = run(cfg, params, backend, backend.init_state(fill_fraction=0.4), 1)
    assert np.abs(got - ref[1]).max() / np.abs(ref[1]).max() < 1e-4
    assert int(np.asarray(st["stats"]["deferred"]).sum()) > 0  # a background fill ran (f = 0.4)
    del backend, st
    gc.collect()
    assert (cuda.live_channels(), cuda.live_backgrounds()) == (channels, backgrounds)
    # a new backend still works after the old one's staging is gone
    backend = OffloadExperts(pool, L, E, SIZES["37%"], "lru-split", platform="cuda")
    got, _ = run(cfg, params, backend, backend.init_state(fill_fraction=0.4), 1)
    assert np.abs(got - ref[1]).max() / np.abs(ref[1]).max() < 1e-4


@pytest.mark.parametrize("mode", ["host_plan", "plan_publish"])
@pytest.mark.parametrize("policy,size,batch,defer,unit_split", [
    ("lru-split", "37%", 1, True, True), ("lru-split", "min", 3, True, True), ("lru-split", "37%", 3, True, False),
    ("lru-split", "layer", 1, False, False), ("lru-fill", "layer", 3, True, False), ("static", "37%", 3, True, False),
    ("cpu", None, 3, True, False)])
def test_cuda_early_cpu_branch_equals_resident(setup, policy, size, batch, defer, unit_split, mode):
    """The CPU branch submitted before the plan kernel ends, without the submit kernel: the host plan
    (``host_plan=True``: the tasks decided by the coordinator from what `cuda.cpu_experts_publish` stages before
    the plan kernel; the checked collect compares them with the device plan's, a mismatch would be NaN) or the
    publishing plan (``plan_publish=True``: the plan kernel stages the tasks and publishes the request before it
    chooses the victims): the resident logits, jobs for the calls with CPU work, the transfer words back at 0."""
    cfg, params, pool, ref = setup
    S = 0 if policy == "cpu" else SIZES[size]
    backend = OffloadExperts(pool, L, E, S, policy, platform="cuda", defer_fills=defer,
                             unit_split=unit_split if defer and policy == "lru-split" else False, **{mode: True})
    state = backend.init_state(fill_fraction=0.4)
    hlo = decode_hlo(cfg, params, backend, state, batch)
    if mode == "host_plan":
        assert "ftjax_cpu_experts_publish" in hlo and "ftjax_cpu_experts_collect_checked" in hlo
    else:
        assert "ftjax_cpu_experts_publish" not in hlo and "ftjax_cpu_experts_collect" in hlo
    assert "ftjax_cpu_experts_submit" not in hlo
    got, st = run(cfg, params, backend, state, batch, check=check_invariants, freeze=backend.freeze_hot_set)
    want = ref[batch]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    stats = {k: np.asarray(v) for k, v in st["stats"].items()}
    jobs, seconds = backend.cpu_served()
    assert (stats["cpu_experts"].sum() > 0) == (jobs > 0)
    if policy in ("cpu", "static") or (policy == "lru-split" and batch > 1):
        assert jobs > 0
    backend.drain()
    assert cuda.transfer_words() == (0, 0)


def test_cuda_host_plan_mismatch_fails_the_call(setup):
    """The checked collect compares the host plan's tasks with the device plan's: a publish whose plan
    parameters differ from the plan call's (here: no fills on the host, fills on the device) makes the call fail
    (status 3, y NaN); the same parameters pass (status 0)."""
    import jax
    import jax.numpy as jnp

    from ftjax.experts.cache import CacheGeometry, init_cache_state
    from ftjax.experts.plan_fused import plan_layer_fused, plan_statics

    cfg, params, pool, ref = setup
    channel = 987_000
    cuda.create_channel(channel, pool, 4, 4 * E)
    try:
        geom = CacheGeometry(L, E, SIZES["37%"], pool.hidden, pool.inter)
        kw = dict(rule="balance", fill_cap=None, update=True, defer_horizon=0, unit_split=None)

        def call(cache, x, ids, gw, valid, host_fill_cap):
            statics = plan_statics(0, ids.size, E, SIZES["37%"], **dict(kw, fill_cap=host_fill_cap))
            token, *kept = cuda.cpu_experts_publish(x, ids, gw, valid, cache["fill_fraction"], cache["slot_of"],
                                                    cache["recency"], cache["last_use"], cache["step"], channel,
                                                    statics)
            cache = dict(cache, **dict(zip(("slot_of", "recency", "last_use", "step"), kept)))
            plan, cache, tasks, _ = plan_layer_fused(cache, 0, ids, valid, gate_weights=gw, num_experts=E, **kw)
            y, status = cuda.cpu_experts_collect_checked(token, plan.n_cpu_routes, tasks, plan.cpu_units,
                                                         x.shape[0], x.shape[1], channel)
            return y, status, plan.n_fill

        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((2, pool.hidden)), jnp.float32)
        ids = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32)
        gw = jnp.asarray(rng.random((2, 3)), jnp.float32)
        valid = jnp.ones((2,), jnp.int32)
        for host_cap, want in ((None, 0), (1, 3)):
            cache = init_cache_state(geom, jnp.float32, fill_fraction=0.5)
            y, status, n_fill = jax.jit(call, static_argnums=5)(cache, x, ids, gw, valid, host_cap)
            assert int(n_fill) > 1  # six misses at f = 0.5: the device fills three, the host plans for one
            assert int(status) == want, cuda.STATUS.get(int(status))
            assert np.isnan(np.asarray(y)).all() == (want != 0)
    finally:
        cuda.destroy_channel(channel)
