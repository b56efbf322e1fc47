"""OffloadExperts equals ResidentExperts for every policy and cache size, batch 1 and 3 (CPU platform)."""
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.config import parse_hf_config
from ftjax.experts.cache import check_invariants
from ftjax.experts.decode import OffloadExperts
from ftjax.experts.offload_defaults import BACKGROUND_YIELD_MODES, DEFAULT_BACKGROUND_YIELD, default_unit_split
from ftjax.experts.policies import POLICIES
from ftjax.experts.resident import ResidentExperts
from ftjax.host import HostPool
from ftjax.models import get_family, make_step_fns
from ftjax.models.params import expert_bank_shapes, param_shapes, unflatten

CFG = {
    "model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 48, "num_experts": 8, "num_experts_per_tok": 3,
    "moe_intermediate_size": 16, "norm_topk_prob": True,
}
L, E = 2, 8
PROMPT, STEPS, MAX_LEN = 5, 6, 16
# cache sizes: smallest legal (1), one layer's worth (E), ~37% of the pool, all
SIZES = {"min": 1, "layer": E, "37%": round(0.37 * L * E), "all": L * E}
CASES = [(p, s) for p in ("lru-split", "lru-fill", "static") for s in SIZES] + [("cpu", None), ("resident", None)]
# Every case at batch 3; at batch 1 the ~37% size and the single-size policies, the rest marked slow
# (each case compiles a prefill and a decode executable: ~3 s on a CI core).
MATRIX = [(p, s, 3) for p, s in CASES] + [
    pytest.param(p, s, 1, marks=() if s in ("37%", None) else pytest.mark.slow) for p, s in CASES]


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def make_model():
    """``(cfg, params, banks, pool)``: the tiny model of these tests, random fp32 weights (also the GPU tests)."""
    cfg = parse_hf_config(CFG)
    rng = np.random.default_rng(0)
    params = unflatten({n: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32) for n, s in param_shapes(cfg).items()})
    banks = {b: (rng.standard_normal(s) * 0.3).astype(np.float32) for b, s in expert_bank_shapes(cfg).items()}
    return cfg, params, banks, HostPool.from_banks(banks)


@pytest.fixture(scope="module")
def model():
    return make_model()


def run(cfg, params, backend, expert_state, batch, check=None, freeze=None):
    fam = get_family(cfg)
    rng = np.random.default_rng(batch)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, PROMPT)), jnp.int32)
    n_new = jnp.asarray([PROMPT - (b % 2) for b in range(batch)], jnp.int32)
    prefill, decode = make_step_fns(cfg, backend, batch, PROMPT, MAX_LEN)
    logits, state, expert_state = prefill(params, expert_state, fam.init_state(cfg, batch, MAX_LEN), prompt, n_new)
    if freeze:
        expert_state = freeze(expert_state)
    outs = [logits]
    feed = rng.integers(0, cfg.vocab_size, (STEPS, batch))  # teacher-forced: no argmax near-ties
    for i in range(STEPS):
        live = jnp.asarray([1 if (b + i) % 4 else 0 for b in range(batch)] if batch > 1 else [1], jnp.int32)
        logits, state, expert_state = decode(params, expert_state, state, jnp.asarray(feed[i][:, None], jnp.int32), live)
        outs.append(logits)
        if check:
            check(expert_state)
    return np.stack([np.asarray(o) for o in outs]), expert_state


@pytest.fixture(scope="module")
def reference(model):
    cfg, params, banks, _ = model
    return {b: run(cfg, params, ResidentExperts(E), ResidentExperts.init_state(banks), b)[0] for b in (1, 3)}


@pytest.mark.parametrize("policy,size,batch", MATRIX)
def test_offload_equals_resident(model, reference, policy, size, batch):
    cfg, params, banks, pool = model
    S = {"cpu": 0, "resident": L * E}.get(policy, SIZES.get(size))
    backend = OffloadExperts(pool, L, E, S, policy)
    got, st = run(cfg, params, backend, backend.init_state(fill_fraction=0.4), batch,
                  check=check_invariants, freeze=backend.freeze_hot_set)
    want = reference[batch]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    stats = {k: np.asarray(v) for k, v in st["stats"].items()}
    assert np.all(stats["calls"] == 1 + STEPS)
    assert np.array_equal(stats["misses"], stats["fills"] + stats["cpu_experts"])  # the CPU platform: no deferral
    assert stats["deferred"].sum() == 0
    if policy == "resident" or (size == "all" and policy != "static"):
        assert stats["cpu_experts"][:].sum() == 0 or policy != "resident"
    if policy == "cpu":
        assert stats["fills"].sum() == 0 and stats["hits"].sum() == 0
    if policy == "lru-fill" and S >= L * E:
        assert stats["cpu_experts"].sum() == 0
    if policy == "lru-split" and size != "all" and batch > 1:
        # decode steps of any batch split their misses (prefill chunks fill them all)
        assert stats["cpu_experts"].sum() > 0


@pytest.mark.parametrize("policy,plan_impl,victims_by", [("lru-split", "dense", "topk"), ("lru-fill", "mixed", "topk"),
                                                         ("lru-split", "mixed", "topk"), ("lru-split", "scatter", "rank"),
                                                         ("lru-fill", "mixed", "rank")])
def test_plan_impls_equal_resident(model, reference, policy, plan_impl, victims_by):
    """The other plan update forms and victim rankings (the matrix above runs the defaults, scatter and
    top-k) give the resident logits too."""
    cfg, params, banks, pool = model
    backend = OffloadExperts(pool, L, E, SIZES["37%"], policy, plan_impl=plan_impl, victims_by=victims_by)
    got, _ = run(cfg, params, backend, backend.init_state(fill_fraction=0.4), 3, check=check_invariants)
    want = reference[3]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


@pytest.mark.parametrize("size,batch", [("min", 3), ("layer", 3), ("37%", 3), ("all", 3), ("37%", 1), ("min", 1),
                                        pytest.param("layer", 1, marks=pytest.mark.slow)])
def test_deferred_fills_equal_resident(model, reference, size, batch):
    """lru-split with deferred fills (``defer_fills``: a call whose misses the CPU serves faster than the
    split computes them all on the CPU; its fills land by the layer's next call): the resident logits, the
    invariants, and the statistics' accounting."""
    cfg, params, banks, pool = model
    backend = OffloadExperts(pool, L, E, SIZES[size], "lru-split", defer_fills=True)
    assert backend.background_fills
    got, st = run(cfg, params, backend, backend.init_state(fill_fraction=0.4), batch, check=check_invariants)
    want = reference[batch]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    stats = {k: np.asarray(v) for k, v in st["stats"].items()}
    assert np.array_equal(stats["misses"], stats["fills"] + stats["cpu_experts"] - stats["deferred"])
    if size == "37%" and batch == 1:  # f = 0.4 < 1/2: a decode call with one miss defers its fill
        assert stats["deferred"].sum() > 0


@pytest.mark.parametrize("size,batch", [("min", 3), ("37%", 3), ("all", 3), ("37%", 1), ("layer", 1)])
def test_unit_split_equals_resident(model, reference, size, batch):
    """lru-split with unit split (a call's filled experts computed in two parts: units [0, u) from the slot,
    [u, I) on the CPU): the resident logits, the invariants, and the statistics' accounting."""
    cfg, params, banks, pool = model
    backend = OffloadExperts(pool, L, E, SIZES[size], "lru-split", defer_fills=True, unit_split=True)
    got, st = run(cfg, params, backend, backend.init_state(fill_fraction=0.4), batch, check=check_invariants)
    want = reference[batch]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    stats = {k: np.asarray(v) for k, v in st["stats"].items()}
    assert np.array_equal(stats["misses"], stats["fills"] + stats["cpu_experts"] - stats["deferred"])
    if size == "37%" and batch == 1:  # f = 0.4, I = 16 in steps of 8: a lone miss splits at u = 8
        assert stats["deferred"].sum() > 0



@pytest.mark.parametrize("policy,size,batch,split", [("lru-split", "37%", 1, True), ("lru-split", "min", 3, True),
                                                     ("lru-split", "37%", 3, False), ("cpu", None, 1, False),
                                                     ("lru-fill", "layer", 3, False)])
def test_ih_pool_equals_resident(model, reference, policy, size, batch, split):
    """A pool whose down bank is stored transposed (``down_layout="ih"``): the CPU calls read its rows, the
    CPU platform's fills gather from its strided views: the resident logits for every policy."""
    cfg, params, banks, _ = model
    pool = HostPool.from_banks(banks, down_layout="ih")
    S = 0 if policy == "cpu" else SIZES[size]
    backend = OffloadExperts(pool, L, E, S, policy, **(dict(defer_fills=True, unit_split=True) if split else {}))
    got, _ = run(cfg, params, backend, backend.init_state(fill_fraction=0.4), batch, check=check_invariants)
    want = reference[batch]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5

def test_unit_split_is_checked(model):
    *_, pool = model
    with pytest.raises(ValueError, match="needs defer_fills"):
        OffloadExperts(pool, L, E, 4, "lru-split", defer_fills=False, unit_split=True)
    with pytest.raises(ValueError, match="needs defer_fills"):
        OffloadExperts(pool, L, E, 4, "lru-fill", defer_fills=True, unit_split=True)
    with pytest.raises(ValueError, match="unit_split must be"):
        OffloadExperts(pool, L, E, 4, "lru-split", defer_fills=True, unit_split="yes")


def test_fill_beside_is_checked(model):
    """fill_beside is the CUDA unit split's (its GPU test: test_offload_cuda.py); elsewhere a clear error, and
    off unless asked for."""
    *_, pool = model
    assert not OffloadExperts(pool, L, E, 4, "lru-split", defer_fills=True, unit_split=True).fill_beside
    with pytest.raises(ValueError, match="needs platform='cuda' and unit_split"):
        OffloadExperts(pool, L, E, 4, "lru-split", defer_fills=True, unit_split=True, fill_beside=True)
    with pytest.raises(ValueError, match="fill_beside must be"):
        OffloadExperts(pool, L, E, 4, "lru-split", fill_beside="on")
    with pytest.raises(ValueError, match="fill_beside_blocks must be"):
        OffloadExperts(pool, L, E, 4, "lru-split", fill_beside_blocks=-1)
    with pytest.raises(ValueError, match="True only with fill_beside"):
        OffloadExperts(pool, L, E, 4, "lru-split", fill_beside_gemv=True)
    with pytest.raises(ValueError, match="fill_beside_gemv must be"):
        OffloadExperts(pool, L, E, 4, "lru-split", fill_beside_gemv=1)


def test_unit_split_default(model):
    """None: on where it runs and measured faster (CUDA, background fills, the jnp kernel, bf16/f32 pools)."""
    *_, pool = model
    assert default_unit_split("cuda", True, pool, "jnp")
    assert not default_unit_split("cuda", True, pool, "pallas")  # slower with the Pallas GEMV on the H200
    assert not default_unit_split("cuda", False, pool, "jnp")    # nothing deferred: nothing to split
    assert not default_unit_split("cpu", True, pool, "jnp")      # the CPU platform fills at once anyway
    int4 = types.SimpleNamespace(format="int4", inter=pool.inter)
    assert not default_unit_split("cuda", True, int4, "jnp")     # the partial int4 fill is not built
    # the CPU platform: off unless asked for
    assert not OffloadExperts(pool, L, E, 4, "lru-split", defer_fills=True).unit_split
    assert OffloadExperts(pool, L, E, 4, "lru-split", defer_fills=True, unit_split=True).unit_split


def test_cuda_int4_pool_fills_are_refused_up_front():
    """The CUDA fill copies bf16/f32 rows: a policy that fills the cache from an int4 pool is refused when the
    backend is made (naming the policies that run), not at its first fill inside a jitted step."""
    int4 = HostPool(L * E, 32, 32, "int4")  # (this model's I = 16 is below an int4 group)
    for policy, slots in (("lru-split", 4), ("lru-fill", 4)):
        with pytest.raises(NotImplementedError, match="'cpu', 'static' or 'resident'"):
            OffloadExperts(int4, L, E, slots, policy, platform="cuda")
    # the same pool on the CPU platform fills through the host (dequantized rows)
    assert OffloadExperts(int4, L, E, 4, "lru-split").pool.format == "int4"


def test_background_yield_is_checked(model):
    """``background_yield``: one of the modes (the CUDA wrapper's names), default DEFAULT_BACKGROUND_YIELD;
    `set_background_yield` checks the mode too (on the CPU platform there is no background to tell)."""
    from ftjax.host import cuda

    *_, pool = model
    assert set(BACKGROUND_YIELD_MODES) == set(cuda.YIELD_MODES)
    backend = OffloadExperts(pool, L, E, 4, "lru-split", defer_fills=True)
    assert backend.background_yield == DEFAULT_BACKGROUND_YIELD
    backend.set_background_yield("fills+cpu")
    assert backend.background_yield == "fills+cpu"
    for bad in ("always", 1, ""):
        with pytest.raises(ValueError, match="background_yield must be"):
            OffloadExperts(pool, L, E, 4, "lru-split", defer_fills=True, background_yield=bad)
        with pytest.raises(ValueError, match="background_yield must be"):
            backend.set_background_yield(bad)
    assert backend.background_yield == "fills+cpu"


def decode_hlo(cfg, params, backend, expert_state, batch: int) -> str:
    """The compiled decode step's text (also the GPU tests)."""
    _, decode = make_step_fns(cfg, backend, batch, PROMPT, MAX_LEN)
    return decode.lower(params, expert_state, get_family(cfg).init_state(cfg, batch, MAX_LEN),
                        jnp.zeros((batch, 1), jnp.int32), jnp.ones((batch,), jnp.int32)).compile().as_text()


def bank_copies(hlo: str, state: dict) -> list[str]:
    """Copies of a slot bank in a compiled module's text (e.g. ``f32[6,32,32]{...} copy(``)."""
    shapes = {"[" + ",".join(map(str, state[b].shape)) + "]" for b in ("gate_up", "down")}
    out = []
    for ln in hlo.splitlines():
        m = re.search(r"= (.*?) copy(-start)?\(", ln)  # the result's shape, before the opcode
        if m and any(sh in m.group(1) for sh in shapes):
            out.append(ln.strip()[:160])
    return out


def test_bank_copies_finds_a_copy():
    state = {"gate_up": np.zeros((6, 32, 32)), "down": np.zeros((6, 32, 16))}
    assert bank_copies("  %copy.3 = f32[6,32,16]{2,1,0} copy(f32[6,32,16]{2,1,0} %p.1)", state)
    assert not bank_copies("  %copy.3 = f32[7,32,16]{2,1,0} copy(f32[7,32,16]{2,1,0} %p.1)", state)
    assert bank_copies("  %cs = (f32[6,32,32]{2,1,0}, f32[6,32,32]{2,1,0}, u32[]) copy-start(f32[6,32,32] %p)", state)


@pytest.mark.parametrize("defer", [False, True])
def test_decode_step_never_copies_a_bank(model, defer):
    """The banks are only ever updated in place (a copy per layer would move the whole cache; with
    background fills on the GPU a copy made while a fill writes would hold stale rows)."""
    cfg, params, banks, pool = model
    backend = OffloadExperts(pool, L, E, SIZES["37%"], "lru-split", defer_fills=defer)
    state = backend.init_state(fill_fraction=0.4)
    assert not bank_copies(decode_hlo(cfg, params, backend, state, 3), state)


def test_defer_flag_defaults(model):
    cfg, params, banks, pool = model
    assert not OffloadExperts(pool, L, E, 4, "lru-split").background_fills  # default: on the GPU only
    assert OffloadExperts(pool, L, E, 4, "lru-split", defer_fills=True).background_fills
    assert not OffloadExperts(pool, L, E, 4, "lru-fill", defer_fills=True).background_fills  # fills everything
    assert not OffloadExperts(pool, L, E, 4, "static", defer_fills=True).background_fills


def test_bad_sizes(model):
    cfg, params, banks, pool = model
    with pytest.raises(ValueError, match="num_slots"):
        OffloadExperts(pool, L, E, 5, "resident")
    with pytest.raises(ValueError, match="num_slots"):
        OffloadExperts(pool, L, E, 0, "lru-split")
    with pytest.raises(ValueError, match="unknown"):
        OffloadExperts(pool, L, E, 3, "lfu")
    with pytest.raises(ValueError, match="layers x"):
        OffloadExperts(pool, 3, E, 3)
    with pytest.raises(ValueError, match="plan_impl"):
        OffloadExperts(pool, L, E, 3, plan_impl="sparse")
    with pytest.raises(ValueError, match="victims_by"):
        OffloadExperts(pool, L, E, 3, victims_by="sort")
    with pytest.raises(ValueError, match="defer_fills"):
        OffloadExperts(pool, L, E, 3, defer_fills="yes")


def test_default_victims_by(model):
    """The CPU backend ranks LRU victims by top-k, the GPU by counting up to RANK_MAX_SLOTS slots."""
    from ftjax.experts.offload_defaults import RANK_MAX_SLOTS, default_victims_by

    pool = model[3]
    assert OffloadExperts(pool, L, E, 3).victims_by == "topk"
    assert OffloadExperts(pool, L, E, 3, victims_by="rank").victims_by == "rank"
    assert default_victims_by("cuda", RANK_MAX_SLOTS) == "rank"
    assert default_victims_by("cuda", RANK_MAX_SLOTS + 1) == "topk"
    assert default_victims_by("cpu", 16) == "topk"


def test_unit_granule_default_and_checks(model):
    """The split's step: 8 units, an int4 group for int4 pools; an explicit ``unit_granule`` is checked
    (positive, a multiple of the int4 group for int4 pools, a divisor of I under the split)."""
    from ftjax.experts.offload_defaults import unit_granule

    *_, pool = model
    pool_of = lambda fmt, inter: types.SimpleNamespace(format=fmt, inter=inter)  # noqa: E731
    assert unit_granule(pool_of("bf16", 512)) == 8 and unit_granule(pool_of("f32", 512)) == 8
    assert unit_granule(pool_of("int4", 512)) == 32
    b = OffloadExperts(pool, L, E, 4, "lru-split", defer_fills=True, unit_split=True)
    assert b.unit_granule == unit_granule(pool) == 8
    assert OffloadExperts(pool, L, E, 4, "lru-split", defer_fills=True, unit_split=True,
                          unit_granule=16).unit_granule == 16
    for bad in (0, -8, 2.0, True):
        with pytest.raises(ValueError, match="unit_granule must be a positive int"):
            OffloadExperts(pool, L, E, 4, "lru-split", defer_fills=True, unit_split=True, unit_granule=bad)
    with pytest.raises(ValueError, match="multiple of unit_granule"):
        OffloadExperts(pool, L, E, 4, "lru-split", defer_fills=True, unit_split=True, unit_granule=12)
