"""The engine with an offloaded policy: same greedy tokens as resident, device statistics, bad budgets."""
import dataclasses

import jax
import numpy as np
import pytest

from ftjax.demo import DemoSpec, ensure_demo_model
from ftjax.engine import Engine
from ftjax.engine.api import EngineConfig
from ftjax.engine.sampling import SamplingParams
from ftjax.experts.bandwidth import Bandwidth, OnlineSplitTuner, SplitController, from_profile
from ftjax.experts.runtime import OffloadConfig
from ftjax.ftw import load_store
from ftjax.tokenizer import Tokenizer


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    store = ensure_demo_model(tmp_path_factory.mktemp("offload-cache"), spec=DemoSpec.tiny(), progress=False)
    return load_store(store), Tokenizer.from_dir(store)


PROMPTS = ["the lighthouse", "a keeper of"]
GREEDY6 = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def resident_tokens(tiny):
    """The resident engine's greedy tokens for PROMPTS: the reference of every offloaded engine run below."""
    model, tok = tiny
    with Engine(model, tok, EngineConfig(max_slots=2, max_len=64, prefill_chunk=16)) as eng:
        return [r.token_ids for r in eng.generate(PROMPTS, GREEDY6)]


@pytest.mark.parametrize("background_fills,unit_split", [(None, None), (True, None), (True, True)])
def test_engine_lru_split_matches_resident(tiny, resident_tokens, background_fills, unit_split):
    model, tok = tiny
    cfg = model.config
    slot_gib = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4 / 2**30
    budget = slot_gib * max(2, int(0.37 * cfg.num_layers * cfg.num_experts))
    with Engine(model, tok, EngineConfig(max_slots=2, max_len=64, prefill_chunk=16, policy="lru-split",
                                         vram_gib=budget, background_fills=background_fills,
                                         unit_split=unit_split)) as eng:
        assert eng.accelerator.backend.background_fills == bool(background_fills)  # None: the GPU only
        assert eng.accelerator.backend.unit_split == bool(unit_split)  # None: the GPU only (jnp kernel)
        got = [r.token_ids for r in eng.generate(PROMPTS, GREEDY6)]
        eng.accelerator.expert_stats.after_step(eng.accelerator.expert_state, force=True)
        stats = eng.stats()
    assert got == resident_tokens
    ex = stats["experts"]
    assert ex["backend"] == "lru-split" and ex["num_slots"] >= 2
    assert ex["misses"] == ex["fills"] + ex["cpu_experts"] - ex["deferred"] and ex["hits"] + ex["misses"] > 0
    if not background_fills:
        assert ex["deferred"] == 0
    assert stats["bandwidth"]["b_pcie_gbps"] > 0


def test_failed_background_fill_fails_the_requests_and_resets_the_cache(tiny, monkeypatch):
    """When the backend reports that a step read a slot whose background fill had not landed (on the GPU
    a wait timed out), the engine ends the requests of that step with an error, starts the expert cache
    over, and goes on serving."""
    from ftjax.experts.decode import OffloadExperts

    model, tok = tiny
    cfg = model.config
    budget = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4 / 2**30 * max(2, cfg.num_layers * cfg.num_experts // 3)
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    fault = {"on": False}
    monkeypatch.setattr(OffloadExperts, "background_failed", lambda self: fault["on"])
    with Engine(model, tok, EngineConfig(max_slots=1, max_len=64, prefill_chunk=16, policy="lru-split",
                                         vram_gib=budget)) as eng:
        want = eng.generate(["the lighthouse"], sp)[0]
        acc = eng.accelerator
        assert int(np.asarray(acc.expert_state["stats"]["calls"]).sum()) > 0
        fault["on"] = True
        got = eng.generate(["the lighthouse"], sp)[0]
        assert got.finish_reason == "error" and not got.token_ids  # the prefill's token was not published
        assert int(np.asarray(acc.expert_state["stats"]["calls"]).sum()) == 0  # a fresh expert cache
        assert int(np.asarray(acc.expert_state["owner_of"] >= 0).sum()) == 0
        fault["on"] = False
        assert eng.generate(["the lighthouse"], sp)[0].token_ids == want.token_ids


def test_budget_errors():
    with pytest.raises(ValueError, match="policy"):
        OffloadConfig(policy="lfu")
    with pytest.raises(ValueError, match="vram_gib"):
        EngineConfig(vram_gib=-1)
    with pytest.raises(ValueError, match="background_fills"):
        EngineConfig(background_fills="yes")


def test_bandwidth_from_profile_and_online_tuner():
    assert from_profile(None).source == "default"
    prof = {"b_pcie_gbps": 50.0, "b_host_gbps": 100.0, "concurrent": {"b_pcie_gbps": 30.0, "b_host_gbps": 60.0}}
    b = from_profile(prof)
    assert b.concurrent and abs(b.fill_fraction - 1 / 3) < 1e-9
    assert abs(from_profile({"b_pcie_gbps": 50.0, "b_host_gbps": 100.0}).fill_fraction - 0.5) < 1e-9
    # Steps get cheaper with more filling: the tuner moves f up.
    tuner = OnlineSplitTuner(Bandwidth(10.0, 100.0, False, "profile"), window=4)
    f0 = b0 = tuner.bandwidth.fill_fraction
    f = tuner.trial_fraction
    for _ in range(200):
        f = tuner.record(1.0 - 0.5 * f, 1, misses=4)
    assert tuner.bandwidth.fill_fraction > f0 and tuner.bandwidth.b_pcie_gbps > 10.0 * b0 / f0 - 1e-9
    assert tuner.moves == 200 // (2 * 4)  # one move per pair of 4-step windows


def test_online_tuner_minimises_step_time_not_time_per_miss():
    # CPU-served misses are not cached: a lower f means more misses per step AND slower steps, so
    # the time per miss falls as f falls. The tuner must follow the step time (f up).
    tuner = OnlineSplitTuner(Bandwidth(10.0, 10.0, True, "profile"), window=4)
    f0, f = tuner.bandwidth.fill_fraction, tuner.trial_fraction
    for _ in range(400):
        f = tuner.record(1.0 - 0.3 * f, 1, misses=round(10 - 8 * f))
    assert tuner.bandwidth.fill_fraction > f0 + 0.2
    # Windows without misses say nothing about f: it stays.
    idle = OnlineSplitTuner(Bandwidth(10.0, 10.0, True, "profile"), window=2)
    for _ in range(50):
        idle.record(0.01, 1, misses=0)
    assert idle.bandwidth.fill_fraction == pytest.approx(0.5) and idle.moves == 0


def test_split_controller_pairs_time_with_new_snapshots():
    clock = iter(np.arange(0.0, 100.0, 1.0))
    tuner = OnlineSplitTuner(Bandwidth(50.0, 50.0, True, "profile"), window=2)
    ctl = SplitController(tuner, clock=lambda: float(next(clock)))
    f0 = ctl.fraction
    assert ctl.after_decode(None, 0) is None  # no snapshot on the host yet
    assert ctl.after_decode(10, 1) is None  # first reading sets the baseline
    assert ctl.after_decode(10, 1) is None  # same snapshot: time accumulates, nothing recorded
    f = ctl.after_decode(13, 2)  # 2 steps, 3 new misses: window full, the tuner tries the other side
    assert ctl.updates == 1 and f is not None and f != f0 and f == tuner.trial_fraction
    ctl.on_prefill()  # the next interval is not a decode step
    assert ctl.after_decode(13, 2) is None and ctl.to_dict()["trial_fill_fraction"] == f


def test_engine_refines_the_split_online(tiny):
    model, tok = tiny
    cfg = model.config
    slot_gib = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4 / 2**30
    budget = slot_gib * max(2, int(0.11 * cfg.num_layers * cfg.num_experts))
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    config = EngineConfig(max_slots=2, max_len=64, prefill_chunk=16, policy="lru-split", vram_gib=budget)
    with Engine(model, tok, config) as eng:
        acc = eng.accelerator
        acc.split.tuner.window = 1  # every snapshot with misses completes a window
        f_start = float(acc.expert_state["fill_fraction"])
        eng.generate(["the lighthouse keeper", "a storm over"], sp)
        stats = eng.stats()
        f_end = float(acc.expert_state["fill_fraction"])
    assert acc.split.updates > 0 and f_end != f_start
    assert f_end == pytest.approx(acc.split.fraction)
    assert stats["bandwidth"]["online_updates"] == acc.split.updates
    assert 0 < stats["bandwidth"]["fill_fraction"] < 1
    with Engine(model, tok, dataclasses.replace(config, online_split=False)) as eng:
        assert eng.accelerator.split is None
        eng.generate(["the lighthouse keeper"], SamplingParams(temperature=0.0, max_tokens=4))
        assert "online_updates" not in eng.stats()["bandwidth"]
