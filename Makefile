# The two quick-start commands: `make demo` (train short, test long on CPU) and `make test` (`make test-fast`: the
# tests not marked slow).
# Both build .venv on first use. TORCH picks the torch wheel: the default is the CPU build that lies on
# this project's machines; elsewhere pass e.g. `make TORCH=torch test` for your platform's build.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
# The recipe's configs live in the package (hf_alibi/experiments/configs/; `--config NAME` finds them by name too).
CONFIG ?= hf_alibi/experiments/configs/cpu_demo.yaml
SMOKE_CONFIG ?= hf_alibi/experiments/configs/smoke.yaml

.PHONY: install demo smoke test test-fast lint format bench
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml .ci/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]" -c .ci/constraints.txt  # the development pin
	touch $@

demo: install  # run again after an interruption: it resumes (finished models kept, the rest from checkpoints)
	HF_HUB_OFFLINE=1 $(PY) -m recipes.train_short_test_long --config $(CONFIG)

smoke: install  # a new output folder each time: finished runs are never overwritten
	HF_HUB_OFFLINE=1 $(PY) -m recipes.train_short_test_long --config $(SMOKE_CONFIG) \
		--output_dir runs/smoke/$$(date +%Y%m%d-%H%M%S)

test: install  # the whole suite: what .ci/run runs
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

test-fast: install  # everything but what is marked slow (recipe runs, subprocesses, torchrun, wheels, compile, export)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow"

lint: install  # what CI checks before the tests: ruff's lint rules and formatting (settings in pyproject.toml)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install  # fix what lint reports that ruff can fix safely, then format
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

bench: install
	$(PY) -m benchmarks.bench_alibi
