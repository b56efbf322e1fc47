"""ExpertStats: int64 host totals from wrapping int32 device counters, resets, non-blocking reads."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.experts.cache import STAT_KEYS
from ftjax.experts.stats import ExpertStats


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _state(calls, hits, misses):
    s = {k: jnp.zeros((2,), jnp.int32) for k in STAT_KEYS}
    s["calls"] = jnp.asarray(np.asarray(calls, np.int64).astype(np.int32))
    s["hits"] = jnp.asarray(np.asarray(hits, np.int64).astype(np.int32))  # wraps like the device counter
    s["misses"] = jnp.asarray(np.asarray(misses, np.int64).astype(np.int32))
    s["hist"] = jnp.zeros((4,), jnp.int32)
    return {"stats": s}


def _push(st, state):
    version = st.version
    st.after_step(state)
    for _ in range(2000):  # the host copy lands asynchronously; read() never waits for it
        if st.read() is not None and st.version > version:
            break
        time.sleep(0.001)
    assert st.version == version + 1
    return st.read()


def test_totals_survive_int32_wrap_and_resets():
    st = ExpertStats(every=1)
    assert st.read() is None and st.misses() == (None, 0)
    top = 2**31 - 5
    got = _push(st, _state([1, 1], [top, 7], [3, 0]))
    assert list(got["hits"]) == [top, 7]
    got = _push(st, _state([2, 2], [top + 10, 9], [4, 1]))  # layer 0's counter wrapped negative
    assert list(got["hits"]) == [top + 10, 9] and got["hits"].dtype == np.int64
    assert st.misses()[0] == 5
    got = _push(st, _state([1, 1], [6, 1], [2, 0]))  # state re-initialised: counts restart and add on
    assert list(got["hits"]) == [top + 16, 10] and list(got["calls"]) == [3, 3]
    s = st.summary()
    assert s["hits"] == top + 26 and s["misses"] == 7 and 0 < s["miss_rate"] < 1e-8


def _settle(st, version):
    for _ in range(2000):
        if st.read() is not None and st.version >= version:
            return
        time.sleep(0.001)


def test_copies_every_nth_step_and_on_force():
    with pytest.raises(ValueError, match="every"):
        ExpertStats(every=0)
    st = ExpertStats(every=3)
    for i in range(7):  # copies after steps 0, 3 and 6
        st.after_step(_state([i + 1, i + 1], [i, i], [2 * i, 0]))
        _settle(st, {0: 1, 3: 2, 6: 3}.get(i, 0))
    assert st.version == 3 and st.misses()[0] == 12
    st.after_step(_state([8, 8], [7, 7], [14, 0]), force=True)  # step 7: not due, forced
    _settle(st, 4)
    assert st.version == 4 and st.misses()[0] == 14
    st.after_step(_state([9, 9], [8, 8], [16, 0]))  # step 8: not due
    time.sleep(0.05)
    assert st.version == 4 and st.misses()[0] == 14
