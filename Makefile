# fsdp2 developer tasks. Every target that runs Python first makes sure .venv exists.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Pinned and installed before the package: this CPU wheel lies on the machine's disk, while a
# loose `torch` requirement with no torch installed would pull a multi-GB CUDA build.
TORCH_SPEC := torch==2.13.0
LINT_PATHS := fsdp2 tests benchmarks examples

PYTEST_ARGS ?=
TRAIN_ARGS ?=

.PHONY: venv test train lint clean distclean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(TORCH_SPEC)
	$(BIN)/python -m pip install -e '.[test]'
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

train: $(VENV)/.installed-train
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node 2 examples/train.py $(TRAIN_ARGS)

$(VENV)/.installed-train: $(STAMP)
	$(BIN)/python -m pip install -e '.[test,train]'
	touch $@

$(VENV)/.installed-dev: $(STAMP)
	$(BIN)/python -m pip install -e '.[test,dev]'
	touch $@

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy

clean:
	rm -rf build *.egg-info .pytest_cache .ruff_cache .mypy_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
