"""The native module builds, imports and reports the CPU's SIMD features consistently with the OS."""
from pathlib import Path

import pytest

from ftjax import host


def _cpuinfo_flags() -> set[str]:
    p = Path("/proc/cpuinfo")
    if not p.exists():
        pytest.skip("no /proc/cpuinfo on this platform")
    for line in p.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    pytest.skip("no flags line in /proc/cpuinfo")


def test_cpu_features_match_proc_cpuinfo():
    feats = host.cpu_features()
    assert set(feats) == {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512bf16", "avx512vnni", "amx_bf16",
                          "amx_tile"}
    flags = _cpuinfo_flags()
    # The kernel only lists a flag when the OS supports its state, as our XCR0 check does.
    assert feats["avx2"] == ("avx2" in flags)
    assert feats["fma"] == ("fma" in flags)
    assert feats["avx512f"] == ("avx512f" in flags)
    assert feats["avx512bf16"] == ("avx512_bf16" in flags)
    assert feats["avx512vnni"] == ("avx512_vnni" in flags)
    assert feats["avx512bw"] == ("avx512bw" in flags)
    assert feats["avx512vl"] == ("avx512vl" in flags)
    assert feats["amx_bf16"] == ("amx_bf16" in flags)
    assert feats["amx_tile"] == ("amx_tile" in flags)


def test_cpu_brand_is_text():
    brand = host.cpu_brand()
    assert isinstance(brand, str) and brand and "\x00" not in brand
