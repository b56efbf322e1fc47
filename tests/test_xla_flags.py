import pytest

from ftjax.xla_flags import FLAG, apply_update_mode


def test_adds_default_mode_on_new_jaxlib():
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert apply_update_mode(env, "0.11.2") == "SKIP_TEMP"
    assert env["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {FLAG}=SKIP_TEMP"
    env = {}
    assert apply_update_mode(env, "0.12.0") == "SKIP_TEMP"
    assert env["XLA_FLAGS"] == f"{FLAG}=SKIP_TEMP"


@pytest.mark.parametrize("version", ["0.10.2", "0.11.1", "0.11.0.dev20260101"])
def test_old_jaxlib_left_alone(version):
    env = {"XLA_FLAGS": "--a=1"}
    assert apply_update_mode(env, version) is None
    assert env == {"XLA_FLAGS": "--a=1"}


def test_user_flag_wins_and_is_reported():
    env = {"XLA_FLAGS": f"--a=1 {FLAG}=ALWAYS_UPDATE", "FTJAX_XLA_UPDATE_MODE": "SKIP_PROFILED"}
    assert apply_update_mode(env, "0.11.2") == "ALWAYS_UPDATE"
    assert env["XLA_FLAGS"] == f"--a=1 {FLAG}=ALWAYS_UPDATE"


def test_env_choice_and_opt_out():
    env = {"FTJAX_XLA_UPDATE_MODE": "SKIP_PROFILED"}
    assert apply_update_mode(env, "0.11.2") == "SKIP_PROFILED"
    assert env["XLA_FLAGS"].endswith("=SKIP_PROFILED")
    env = {"FTJAX_XLA_UPDATE_MODE": "off"}
    assert apply_update_mode(env, "0.11.2") is None
    assert "XLA_FLAGS" not in env


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="FTJAX_XLA_UPDATE_MODE"):
        apply_update_mode({"FTJAX_XLA_UPDATE_MODE": "sometimes"}, "0.11.2")


def test_this_process_flags_match_the_installed_jaxlib():
    import os

    import ftjax
    from ftjax.xla_flags import MIN_JAXLIB, _version_tuple, installed_jaxlib

    new = _version_tuple(installed_jaxlib() or "0") >= MIN_JAXLIB
    if ftjax.XLA_UPDATE_MODE is not None:
        assert f"{FLAG}={ftjax.XLA_UPDATE_MODE}" in os.environ["XLA_FLAGS"]
    elif new and os.environ.get("FTJAX_XLA_UPDATE_MODE", "").lower() != "off":
        pytest.fail("jaxlib >= 0.11.2 without the update mode in XLA_FLAGS")


def test_scheduling_mode_off_by_default_and_chosen_by_env():
    from ftjax.xla_flags import SCHEDULING_FLAG, apply_scheduling_mode

    env = {"XLA_FLAGS": "--a=1"}
    assert apply_scheduling_mode(env, "0.11.2") is None
    assert env == {"XLA_FLAGS": "--a=1"}
    env = {"FTJAX_XLA_CB_SCHEDULING": "CONCURRENT"}
    assert apply_scheduling_mode(env, "0.11.2") == "CONCURRENT"
    assert env["XLA_FLAGS"] == f"{SCHEDULING_FLAG}=CONCURRENT"
    assert apply_scheduling_mode({"FTJAX_XLA_CB_SCHEDULING": "CONCURRENT"}, "0.10.2") is None
    env = {"XLA_FLAGS": f"{SCHEDULING_FLAG}=SERIALIZE", "FTJAX_XLA_CB_SCHEDULING": "CONCURRENT"}
    assert apply_scheduling_mode(env, "0.11.2") == "SERIALIZE"  # the user's flag wins
    with pytest.raises(ValueError, match="FTJAX_XLA_CB_SCHEDULING"):
        apply_scheduling_mode({"FTJAX_XLA_CB_SCHEDULING": "parallel"}, "0.11.2")
