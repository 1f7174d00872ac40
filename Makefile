# voxtriton: `make serve` and `make test` work on a fresh machine (they install into .venv first).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed

# Pinned here, not in pyproject.toml:
# - torch, from PyPI (a CUDA build, several GB) unless TORCH_INDEX names another index, e.g.
#   `make serve TORCH_INDEX=https://download.pytorch.org/whl/cpu` on a host without a GPU;
# - nvidia-pytriton: only its bundled tritonserver binary, libraries and Python-backend stubs are used;
# - qwen-tts-hf (the official implementation, for parity tests) would pull gradio; torchaudio is only
#   imported by it, and PyPI's build is for CUDA, so its compiled extension is removed (torchaudio then
#   loads as pure Python, which is all the reference needs for the 12 Hz model).
TORCH := torch==2.13.0
# Triton's language package, the version CUDA builds of torch 2.11 bring (the GPU image's); here the
# kernel tests run its interpreter.
TRITON_LANG := triton==3.6.0
TRITON := nvidia-pytriton==0.7.0
REFERENCE := qwen-tts-hf==0.1.1.post1 torchaudio==2.11.0

.PHONY: install serve test test-fast lint clean

TORCH_INDEX ?=

# numpy 1.26.4, which the bundled Triton's Python backend needs, has wheels up to Python 3.12 only.
export CHECK_PYTHON := import sys; v = sys.version_info[:2]; sys.exit(None if (3, 11) <= v <= (3, 12) else \
	f"voxtriton needs Python 3.11 or 3.12, and $(PYTHON) is {v[0]}.{v[1]}: make PYTHON=python3.12 ...")

# What serving needs: voxtriton, the gateway, torch and Triton.
$(SERVE_STAMP): pyproject.toml Makefile
	test -x $(PY) || { $(PYTHON) -c "$$CHECK_PYTHON" && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || \
		$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH)
	$(PY) -m pip install -q -e ".[gateway]"
	$(PY) -m pip install -q --no-deps $(TRITON)
	touch $(SERVE_STAMP)

# And what the tests need: their tools, the kernels' interpreter and the reference implementation.
$(STAMP): $(SERVE_STAMP)
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q $(TRITON_LANG)
	$(PY) -m pip install -q -e ".[test,parity,gateway]"
	$(PY) -m pip install -q --no-deps $(REFERENCE)
	rm -f $(VENV)/lib/python3*/site-packages/torchaudio/lib/*.so
	touch $(STAMP)

install: $(STAMP)

serve: $(SERVE_STAMP)
	$(BIN)/voxtriton serve $(ARGS)

# ruff (lint and format, configured in pyproject.toml) with zero findings.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The whole suite: lint, unit tests, parity with the reference, and a real tritonserver over gRPC.
test: lint
	VOXTRITON_REQUIRE_PARITY=1 $(PY) -m pytest -q $(ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not server" $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
