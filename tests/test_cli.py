"""The ``ftjax`` command line, run as a subprocess like a user would."""
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftjax.demo import HF_NAME, DemoSpec, ensure_demo_model

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("convert", "generate", "demo", "info")


def ftjax(*args, env=None, timeout=300):
    full_env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ftjax", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def assert_user_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("ftjax: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[-1], lines[-1]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("cli-cache"), spec=DemoSpec.tiny(), progress=False)


def test_help_lists_every_command():
    proc = ftjax("--help")
    assert proc.returncode == 0
    for cmd in COMMANDS:
        assert cmd in proc.stdout


@pytest.mark.parametrize("cmd, options", [
    ("convert", ["HF_DIR", "OUT_DIR", "--dtype", "--overwrite"]),
    ("generate", ["--model", "--chat", "--max-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--stream",
                  "--policy", "--vram-gib", "--no-background-fills", "--no-unit-split"]),
    ("demo", ["--prompt", "--max-tokens", "--rebuild"]),
    ("info", ["--model"]),
])
def test_subcommand_help(cmd, options):
    proc = ftjax(cmd, "--help")
    assert proc.returncode == 0
    for opt in options:
        assert opt in proc.stdout


def test_missing_command_is_usage_error():
    proc = ftjax()
    assert proc.returncode == 2 and "COMMAND" in proc.stderr


def test_info(store):
    proc = ftjax("info", "--model", str(store))
    assert proc.returncode == 0, proc.stderr
    assert "expert pool" in proc.stdout and "32 experts (4 x 8)" in proc.stdout


def test_generate_greedy(store):
    proc = ftjax("generate", "--model", str(store), "--temperature", "0", "--max-tokens", "5", "The lighthouse")
    assert proc.returncode == 0, proc.stderr
    stats = proc.stderr.strip().splitlines()[-1]
    assert re.search(r"prompt tokens: \d+ \| generated tokens: 5 ", stats), stats
    assert "TTFT" in stats and "tokens/s" in stats
    assert proc.stdout.strip()
    streamed = ftjax("generate", "--model", str(store), "--temperature", "0", "--max-tokens", "5", "--stream",
                     "--chat", "--no-think", "The lighthouse")
    assert streamed.returncode == 0, streamed.stderr


def test_generate_offloaded_prints_the_split(store):
    proc = ftjax("generate", "--model", str(store), "--temperature", "0", "--max-tokens", "6", "--policy", "lru-split",
                 "--vram-gib", "0.0001", "The lighthouse")
    assert proc.returncode == 0, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert re.search(r"\[experts lru-split: \d+ slots \| miss rate [\d.]+% \| fills \d+ \| CPU experts \d+ \| "
                     r"B_P [\d.]+ GB/s, B_H [\d.]+ GB/s \((online|profile|default)\), fill fraction [\d.]+\]", line), line


@pytest.mark.parametrize("args, needles", [
    (["info", "--model", "/nonexistent/store"], ["/nonexistent/store", "does not exist"]),
    (["generate", "--model", "/nonexistent/store", "hi"], ["does not exist"]),
    (["convert", "/nonexistent/hf", "/tmp/ftjax-never-written"], ["does not exist"]),
])
def test_missing_paths(args, needles):
    assert_user_error(ftjax(*args), *needles)
    assert not Path("/tmp/ftjax-never-written").exists()


def test_not_a_store(tmp_path):
    assert_user_error(ftjax("info", "--model", str(tmp_path)), "manifest")


@pytest.mark.parametrize("option, value, needle", [
    ("--temperature", "-1", "temperature"),
    ("--top-p", "0", "top_p"),
    ("--top-k", "-5", "top_k"),
    ("--max-tokens", "0", "max_tokens"),
])
def test_bad_sampling_values(store, option, value, needle):
    assert_user_error(ftjax("generate", "--model", str(store), option, value, "hi"), needle)


def test_prompt_longer_than_context(store):
    proc = ftjax("generate", "--model", str(store), "--max-len", "4", "one two three four five six seven")
    assert_user_error(proc, "context of 4 tokens")


def test_convert_roundtrip_and_refusals(store, tmp_path):
    hf = store.parent / HF_NAME
    out = tmp_path / "store"
    proc = ftjax("convert", str(hf), str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "ftw.json").read_text())["config"]["num_experts"] == 8
    assert_user_error(ftjax("convert", str(hf), str(out)), "--overwrite")
    assert ftjax("convert", str(hf), str(out), "--overwrite", "--quiet", "--dtype", "fp32").returncode == 0


def test_convert_unknown_model_type(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    out = tmp_path / "out"
    assert_user_error(ftjax("convert", str(hf), str(out)), "unknown model_type 'llama'")
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["hf"]
