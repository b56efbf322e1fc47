# Two commands do all set-up on a fresh clone:
#   make run   - create .venv, install ftjax (with its C++ extension), build the embedded demo
#                model if missing, generate text and print tokens/s
#   make test  - same set-up, plus the transformers reference (its own Python 3.11 venv), then tests
# Interpreters are found on PATH or under pyenv; override with PY=... / PYREF=...

PY    ?= $(shell tools/find_python.sh 3.12 || tools/find_python.sh 3.13 || tools/find_python.sh 3.11)
PYREF ?= $(shell tools/find_python.sh 3.11)
VENV    := .venv
VENVREF := .venv-ref
VENVMIN := .venv-jaxmin
JAX_MIN_VERSION ?= 0.10.2
REFDIR  := build/reference
JAX_VERSION ?= 0.11.2
TORCH_VERSION ?= 2.13.0
TRANSFORMERS_VERSION ?= 5.24.0
PYTEST_ARGS ?=
# Test processes (pytest-xdist): two cut the suite's wall time by a third on a 2-core box (session 21: 797 s -> 521 s);
# 0 runs it in one process.
TEST_WORKERS ?= 2
# JAX's persistent compilation cache for the test runs (tests/conftest.py; empty: off): repeated runs reuse the
# compiled steps (a 64-test subset: 199 s without, 161 s cold, 48 s warm); a clean clone's run gains ~3% (session 31).
TEST_JAX_CACHE ?= $(CURDIR)/build/jax-cache
# 1: `make test` compiles with jax_disable_most_optimizations (XLA's LLVM back end at -O0; tests/conftest.py); the
# suite is mostly compile time. `make test-jax-min` keeps XLA's defaults, so both settings run in CI.
TEST_FAST_COMPILE ?= 1

.PHONY: run test test-jax-min venv reference clean help

help:
	@echo "make run   - set up and generate text with the embedded demo model"
	@echo "make test  - set up and run the test suite (incl. fidelity against transformers)"
	@echo "make test-jax-min - the jax-facing tests again on the oldest supported jax ($(JAX_MIN_VERSION), Python 3.11)"

# $(call project_venv,DIR,PYTHON,JAX_VERSION[,PIP_ARGS]): a venv with ftjax (editable, C++ extension built) and jax
# pinned; PIP_ARGS go to ftjax's install (e.g. CMake settings).
define project_venv
	@test -n "$(2)" || { echo "error: no suitable Python found for $(1) (set PY=... / PYREF=...)"; exit 1; }
	test -x $(1)/bin/python || $(2) -m venv $(1)
	$(1)/bin/pip install -q --upgrade pip
	$(1)/bin/pip install -q scikit-build-core nanobind grpcio-tools "jax==$(3)" "jaxlib==$(3)"  # the build reads the XLA FFI headers from jax
	$(1)/bin/pip install -q --no-build-isolation $(4) -e ".[test]" "jax==$(3)" "jaxlib==$(3)"
	touch $(1)/.installed
endef

$(VENV)/.installed: pyproject.toml CMakeLists.txt $(wildcard cpp/*) $(wildcard protos/ftjax/v1/*.proto)
	$(call project_venv,$(VENV),$(PY),$(JAX_VERSION))

venv: $(VENV)/.installed

$(VENVREF)/.installed:
	@test -n "$(PYREF)" || { echo "error: no Python 3.11 found for the transformers reference (set PYREF=...)"; exit 1; }
	test -x $(VENVREF)/bin/python || $(PYREF) -m venv $(VENVREF)
	$(VENVREF)/bin/pip install -q --upgrade pip
	$(VENVREF)/bin/pip install -q "torch==$(TORCH_VERSION)" "transformers==$(TRANSFORMERS_VERSION)" safetensors numpy
	touch $@

$(REFDIR)/.done: $(VENVREF)/.installed tools/make_reference.py
	rm -rf $(REFDIR)
	HF_HUB_OFFLINE=1 $(VENVREF)/bin/python tools/make_reference.py $(REFDIR)
	touch $@

reference: $(REFDIR)/.done

run: venv
	$(VENV)/bin/ftjax demo

test: venv reference
	FTJAX_REF_DIR=$(CURDIR)/$(REFDIR) FTJAX_TEST_JAX_CACHE=$(TEST_JAX_CACHE) FTJAX_TEST_FAST_COMPILE=$(TEST_FAST_COMPILE) \
	  $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The oldest jax we support, on Python 3.11 (where it installs); CI runs it after `make test`. It runs the layers
# that call jax themselves (models, the expert plans and backends, the host runtime's FFI, Pallas, the FTW store,
# the generation loop, sampling); the application layers above them (the engine's server loop, gRPC serving, batch
# runs, the CLI, the engine-level offload runs of tests/experts/test_runtime.py) run on the pinned jax only: the
# whole suite twice took ~35 min on a 2-core box without AVX-512 (session 31), past CI's 30.
JAX_MIN_TESTS ?= tests/models tests/ftw tests/host tests/pallas tests/experts/test_offload.py \
  tests/experts/test_plan.py tests/experts/test_plan_fused.py tests/experts/test_host_cpu.py tests/experts/test_stats.py \
  tests/experts/test_traces.py tests/engine/test_generate.py tests/engine/test_sampling.py \
  tests/engine/test_scheduler.py tests/test_config.py tests/test_xla_flags.py tests/test_tokenizer.py
# Its build leaves the CUDA handlers out (FTJAX_CUDA=OFF): their tests need a GPU (the GPU machine runs jax 0.11.2),
# and on a box with nvcc they are half the build (.venv builds and so compile-checks them).
$(VENVMIN)/.installed: pyproject.toml CMakeLists.txt $(wildcard cpp/*) $(wildcard protos/ftjax/v1/*.proto)
	$(call project_venv,$(VENVMIN),$(PYREF),$(JAX_MIN_VERSION),--config-settings=cmake.define.FTJAX_CUDA=OFF)

test-jax-min: $(VENVMIN)/.installed reference
	FTJAX_REF_DIR=$(CURDIR)/$(REFDIR) FTJAX_TEST_JAX_CACHE=$(TEST_JAX_CACHE) \
	  $(VENVMIN)/bin/python -m pytest -q -n $(TEST_WORKERS) --one-case-per-test $(JAX_MIN_TESTS) $(PYTEST_ARGS)

clean:
	rm -rf build $(VENV) $(VENVREF) $(VENVMIN)
