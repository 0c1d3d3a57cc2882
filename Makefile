# fsdp2 developer tasks. Every target that runs Python first makes sure .venv exists.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Pinned and installed before the package: this CPU wheel lies on the machine's disk, while a
# loose `torch` requirement with no torch installed would pull a multi-GB CUDA build.
TORCH_SPEC := torch==2.13.0
LINT_PATHS := fsdp2 tests benchmarks examples docs/site

PYTEST_ARGS ?=
TRAIN_ARGS ?=

# Other torch releases fsdp2 supports (fsdp2/_core/support/compat.py), each in a venv of its own under
# COMPAT_VENVS (outside the clone, so a later clone on the same machine reuses it; the
# registry's CUDA builds, ~5 GB, about a minute to install; they run on the CPU) holding torch
# and the test extras, not fsdp2: the compatibility subset `make compat` runs on each imports
# this checkout's fsdp2 (PYTHONPATH). The stamp names pyproject.toml's hash: new
# requirements, new install.
COMPAT_TORCH ?= 2.11.0 2.14.1
COMPAT_VENVS ?= $(HOME)/.cache/fsdp2-compat
COMPAT_STAMP := .installed-$(shell sha1sum pyproject.toml | cut -c1-12)
COMPAT_REQS = $(shell $(PYTHON) -c "import tomllib; p = tomllib.load(open('pyproject.toml', \
	'rb'))['project']; print(' '.join(repr(r) for r in p['dependencies'] + \
	p['optional-dependencies']['test']))")
# The compatibility subset, chosen by what differs between the releases (tests/compat_subset.py;
# `make print-compat-tests`).
COMPAT_TESTS ?= $(shell $(PYTHON) tests/compat_subset.py)

# `make gpu-check`: on a GPU machine with its own torch (no venv there: python3), or on the
# CPU with DEVICE=cpu (CI); results in $(OUT)/gpu-check.md (benchmarks/gpu_check.py).
GPU_CHECK_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
DEVICE ?= cuda
OUT ?= runs/gpu-check
GPU_CHECK_ARGS ?=

# `make test-isa`: the suite with torch's, oneDNN's and MKL's instruction sets capped, as on a
# CPU without AVX-512 (ISA=avx2, the default) or with none of the vector units torch uses
# (ISA=default): kernels then sum in other orders, so a comparison that holds only on this
# CPU's rounding fails here first (docs/testing.md).
ISA ?= avx2
# Inductor's cache keys miss the capped instruction set: a kernel cached by a capped run and
# loaded by a normal one crashed test_compile (SIGSEGV), so capped runs cache elsewhere.
ISA_ENV = TORCHINDUCTOR_CACHE_DIR=$(or $(TMPDIR),/tmp)/fsdp2-inductor-isa-$(ISA) \
	ATEN_CPU_CAPABILITY=$(ISA) \
	ONEDNN_MAX_CPU_ISA=$(if $(filter default,$(ISA)),SSE41,AVX2) \
	MKL_ENABLE_INSTRUCTIONS=$(if $(filter default,$(ISA)),SSE4_2,AVX2)

.PHONY: venv test test-long test-isa coverage suite-report train lint clean distclean compat \
	gpu-check print-compat-tests wheel-check docs docs-serve

# `make venv`: torch and fsdp2 (editable), nothing else; `make train` adds the `train` extra,
# `make test` the test extras (.installed-test), `make lint` the tools (.installed-dev).
venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(TORCH_SPEC)
	$(BIN)/python -m pip install -e .
	touch $(STAMP)

# torchtitan (for Python 3.11+) without its requirements: what it imports is pyproject's
# `torchtitan` extra (~18 MB); its own requirements would add datasets and tensorboard
# (~340 MB) and wandb, which tests/integrations/torchtitan_cpu.py does without.
$(VENV)/.installed-test: $(STAMP)
	$(BIN)/python -m pip install -e '.[test,torchtitan]'
	if $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
		$(BIN)/python -m pip install --no-deps torchtitan==0.3.0; fi
	touch $@

# `make test`: the main suite (CI's); `make test-long`: what runs outside it, before an issue
# is resolved (docs/testing.md, "Outside the main suite"): the tests marked `long` and the
# property suites' long profiles.
test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-long: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m long $(PYTEST_ARGS)
	HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest -q tests/property $(PYTEST_ARGS)

# Line coverage of fsdp2/ over the main suite, the worker processes included (coverage.py's
# subprocess patch; pyproject.toml's [tool.coverage]); the figure is docs/testing.md's.
coverage: $(VENV)/.installed-dev
	rm -f .coverage .coverage.*
	$(BIN)/python -m coverage run -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
	$(BIN)/python -m coverage combine -q
	$(BIN)/python -m coverage report --skip-covered --sort=cover | tail -25

# Per file and the slowest tests of a run written with PYTEST_ARGS=--junitxml=runs/junit.xml
# (CI writes one), and the stage times .ci/run wrote.
suite-report: venv
	$(BIN)/python benchmarks/suite.py runs/junit.xml \
		$(if $(wildcard runs/ci-stages.txt),--stages runs/ci-stages.txt)

test-isa: $(VENV)/.installed-test
	$(ISA_ENV) $(BIN)/python -m pytest -q $(PYTEST_ARGS)

train: $(VENV)/.installed-train
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node 2 examples/train.py $(TRAIN_ARGS)

$(VENV)/.installed-train: $(STAMP)
	$(BIN)/python -m pip install -e '.[train]'
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed-test
	$(BIN)/python -m pip install -e '.[test,dev]'
	touch $@

compat: $(foreach v,$(COMPAT_TORCH),compat-$(v))

print-compat-tests:
	@echo $(COMPAT_TESTS)

compat-install-%: $(COMPAT_VENVS)/torch-%/$(COMPAT_STAMP)
	@true

compat-%: compat-install-%
	PYTHONPATH=$(CURDIR) $(COMPAT_VENVS)/torch-$*/bin/python -m pytest -q -p no:cacheprovider \
		$(COMPAT_TESTS)
	$(COMPAT_VENVS)/torch-$*/bin/python benchmarks/gpu_check.py --device cpu --skip-bench \
		--out runs/gpu-check-torch$*

.PRECIOUS: $(COMPAT_VENVS)/torch-%/$(COMPAT_STAMP)
$(COMPAT_VENVS)/torch-%/$(COMPAT_STAMP):
	test -x $(COMPAT_VENVS)/torch-$*/bin/python || $(PYTHON) -m venv $(COMPAT_VENVS)/torch-$*
	$(COMPAT_VENVS)/torch-$*/bin/python -m pip install -q torch==$* $(COMPAT_REQS)
	rm -f $(COMPAT_VENVS)/torch-$*/.installed-*
	touch $@

gpu-check:
	$(GPU_CHECK_PYTHON) benchmarks/gpu_check.py --device $(DEVICE) --out $(OUT) $(GPU_CHECK_ARGS)

# The package as users install it: an sdist and a wheel (`python -m build`, `twine check`), the
# wheel installed (not editable, with the `train` extra: the example's checkpoints need numpy)
# beside the CPU torch in a fresh venv outside the checkout, a smoke test and
# examples/train.py run from there (CI's `wheel` stage).
WHEEL_VENV := build/wheel-venv
wheel-check: $(VENV)/.installed-dev
	rm -rf dist $(WHEEL_VENV)
	$(BIN)/python -m build -o dist .
	$(BIN)/twine check --strict dist/*
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	$(WHEEL_VENV)/bin/python -m pip install -q "$$(ls dist/fsdp2-*.whl)[train]"
	cd $(WHEEL_VENV) && bin/python -c "import fsdp2, pathlib; \
		assert 'site-packages' in fsdp2.__file__, fsdp2.__file__; \
		assert (pathlib.Path(fsdp2.__file__).parent / 'py.typed').exists(); print(fsdp2.__file__)"
	cd $(WHEEL_VENV) && bin/fsdp2 --version
	cd $(WHEEL_VENV) && OMP_NUM_THREADS=1 bin/torchrun --standalone --nproc_per_node 2 \
		$(CURDIR)/examples/train.py --steps 4 --eval-every 0 --save-every 0 --plot none \
		--out-dir out

# The documentation site (mkdocs.yml): docs/ and an API reference from the docstrings, built
# strictly (a broken link or anchor, a docstring naming a parameter that does not exist, fail)
# into build/site; docs-serve serves it at http://127.0.0.1:8000 while you edit.
docs: $(VENV)/.installed-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(VENV)/.installed-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy

clean:
	rm -rf build *.egg-info .pytest_cache .ruff_cache .mypy_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(COMPAT_VENVS)
