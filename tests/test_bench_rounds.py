"""bench/decode_rounds.py's check that a round robin's backends fit the GPU at once, before any timing, and the
command line (bench/decode_args.py) it reads."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import decode_args  # noqa: E402
import decode_rounds  # noqa: E402

GIB = 2**30


class Device:
    def __init__(self, stats, kind="NVIDIA H100 80GB HBM3"):
        self.stats, self.device_kind = stats, kind

    def memory_stats(self):
        return self.stats


def flags(**kw):
    base = dict(granule_ablation=[], host_plan_ablation=False, plan_publish_ablation=False, fill_beside_ablation=None)
    return SimpleNamespace(**dict(base, **kw))


def test_backends_per_round_robin():
    assert decode_rounds.round_robin_backends(flags()) == {}
    assert decode_rounds.round_robin_backends(flags(fill_beside_ablation=[32, 16, 0], host_plan_ablation=True,
                                                    granule_ablation=[4])) == {
        "--granule-ablation": 2, "--host-plan-ablation": 2, "--fill-beside-ablation": 4}


def test_round_robin_that_cannot_fit_stops_with_the_count_that_does():
    # session 43: five 22.2 GiB caches (37% of the 60 GiB pool) on an H100's 76 GiB allocator ran out of memory
    h100 = Device({"bytes_limit": 76 * GIB, "bytes_in_use": 3 * GIB})
    counts = decode_rounds.round_robin_backends(flags(fill_beside_ablation=[32, 16, 0]))
    with pytest.raises(SystemExit, match=r"--fill-beside-ablation: .* 4 backends .*\(2 backends\): pass at most 1"):
        decode_rounds.check_round_robins_fit(counts, int(22.2 * GIB), h100)
    decode_rounds.check_round_robins_fit({"--fill-beside-ablation": 2}, int(22.2 * GIB), h100)  # fits: no error
    h200 = Device({"bytes_limit": 137 * GIB, "bytes_in_use": 3 * GIB}, "NVIDIA H200")
    decode_rounds.check_round_robins_fit(counts, int(22.2 * GIB), h200)


def test_devices_without_memory_figures_are_not_checked():
    decode_rounds.check_round_robins_fit({"--host-plan-ablation": 2}, 10**15, Device(None, "cpu"))
    decode_rounds.check_round_robins_fit({"--host-plan-ablation": 2}, 10**15, Device({}, "cpu"))


@pytest.mark.parametrize("gemv", [False, True])
def test_fill_beside_variants_override_the_runs_own(gemv):
    # session 44: the fill-after backend kept the run's fill_beside_gemv=True with fill_beside False, which
    # OffloadExperts refuses: the round robin died after the main run
    run_kw = dict(fill_beside=True, fill_beside_blocks=32, fill_beside_gemv=gemv)
    variants = decode_rounds.fill_beside_variants([32, 0], gemv)
    assert list(variants) == ["split fill after", "split beside 32", "split beside 0"]
    after = dict(run_kw, **variants["split fill after"])
    assert after["fill_beside"] is False and after["fill_beside_gemv"] is False
    for n in (32, 0):
        beside = dict(run_kw, **variants[f"split beside {n}"])
        assert beside == dict(fill_beside=True, fill_beside_blocks=n, fill_beside_gemv=gemv)


def test_the_command_lines_flags_count_the_backends():
    ap = decode_args.parser("decode", Path("/tmp/decode.json"))
    # gpu_session.sh decode-beside's flags (session 44's call)
    args = ap.parse_args(["--layers", "40", "--routing", "trace", "--fractions", "0.37", "--policies", "lru-split",
                          "--no-sweep", "--fill-beside", "32", "--fill-beside-ablation", "32", "--fill-beside-gemv",
                          "--no-resident"])
    assert (args.fill_beside, args.fill_beside_gemv, args.no_resident) == (32, True, True)
    assert decode_rounds.round_robin_backends(args) == {"--fill-beside-ablation": 2}
    args = ap.parse_args(["--granule-ablation", "4", "16", "--plan-publish-ablation"])
    assert decode_rounds.round_robin_backends(args) == {"--granule-ablation": 3, "--plan-publish-ablation": 2}
    assert args.policies == list(decode_args.POLICIES) and args.out == "/tmp/decode.json"
    with pytest.raises(SystemExit):
        ap.parse_args(["--policies", "lru-lfu"])
