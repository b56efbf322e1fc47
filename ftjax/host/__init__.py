"""Python face of the native host runtime (``ftjax._host``)."""
from __future__ import annotations

from ftjax import _host


def cpu_features() -> dict[str, bool]:
    """SIMD features of this CPU as detected by the native module."""
    return dict(_host.cpu_features())


def cpu_brand() -> str:
    return _host.cpu_brand()
