"""Every host test leaves the CPU kernel tier as it found it (the best one: "auto")."""
import pytest

from ftjax.host import set_tier


@pytest.fixture(autouse=True)
def _restore_tier():
    yield
    set_tier("auto")
