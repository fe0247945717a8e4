# The two quick-start commands: `make demo` (train short, test long on CPU) and `make test` (`make test-fast`: the
# tests not marked slow).
# Both build .venv on first use. TORCH picks the torch wheel: the default is the CPU build that lies on
# this project's machines; elsewhere pass e.g. `make TORCH=torch test` for your platform's build.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
# The transformers range (pyproject: >=5.0,<6). `make compat` runs tests/models on the lowest release, tests/models,
# tests/serving and tests/distributed on the newest, and loads a saved checkpoint's code without hf_alibi on 4.57, the
# lowest and the newest; each release in its own venv under .venv-compat/ (kept: a second run installs nothing).
# `compat-previous` runs serving and tensor parallelism on the release before the newest (their oldest supported).
COMPAT_LOWEST ?= 5.0.0
COMPAT_NEWEST ?= 5.25.0
COMPAT_PREVIOUS ?= 5.24.0
COMPAT_CHECKPOINT_ONLY ?= 4.57.6
COMPAT := .venv-compat
# Every release a saved checkpoint's code is checked on by `make compat-every-release` (one venv, slow: not in CI)
COMPAT_EVERY ?= 4.57.6 5.0.0 5.1.0 5.2.0 5.3.0 5.4.0 5.5.4 5.6.2 5.7.0 5.8.1 5.9.0 5.10.4 5.11.0 5.12.1 5.13.1 \
	5.14.1 5.15.1 5.16.1 5.17.0 5.18.0 5.19.0 5.20.2 5.21.1 5.22.2 5.23.0 5.24.0 5.25.0
# The recipe's configs live in the package (hf_alibi/experiments/configs/; `--config NAME` finds them by name too).
CONFIG ?= hf_alibi/experiments/configs/cpu_demo.yaml
SMOKE_CONFIG ?= hf_alibi/experiments/configs/smoke.yaml

.PHONY: install demo smoke test test-fast lint format bench compat compat-lowest compat-newest compat-previous \
	compat-remote-code compat-every-release
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

compat: compat-lowest compat-newest compat-remote-code  # the transformers range; .ci/run runs what the main suite does not

compat-lowest: $(COMPAT)/$(COMPAT_LOWEST)/.installed
	HF_HUB_OFFLINE=1 $(COMPAT)/$(COMPAT_LOWEST)/bin/python -m pytest -q tests/models tests/test_transformers_surface.py tests/surface

compat-newest: $(COMPAT)/$(COMPAT_NEWEST)/.installed
	HF_HUB_OFFLINE=1 $(COMPAT)/$(COMPAT_NEWEST)/bin/python -m pytest -q tests/models tests/serving tests/distributed

compat-previous: $(COMPAT)/$(COMPAT_PREVIOUS)/.installed
	HF_HUB_OFFLINE=1 $(COMPAT)/$(COMPAT_PREVIOUS)/bin/python -m pytest -q tests/serving tests/distributed tests/surface

# Each release's interpreter loads checkpoints the development venv saves (tests/models/alibi/test_remote_code_versions.py)
compat-remote-code: install $(COMPAT)/$(COMPAT_CHECKPOINT_ONLY)/.checkpoint-only $(COMPAT)/$(COMPAT_LOWEST)/.installed \
		$(COMPAT)/$(COMPAT_NEWEST)/.installed
	HF_HUB_OFFLINE=1 HF_ALIBI_REMOTE_CODE_PYTHONS="$(foreach v,$(COMPAT_CHECKPOINT_ONLY) $(COMPAT_LOWEST) \
		$(COMPAT_NEWEST),$(abspath $(COMPAT))/$(v)/bin/python)" $(PY) -m pytest -q tests/models/alibi/test_remote_code_versions.py

# A release with hf_alibi installed (editable) and what its tests import; the serve extra needs transformers 5.24+
COMPAT_EXTRAS = experiments,embeddings,gguf,test
$(COMPAT)/$(COMPAT_NEWEST)/.installed $(COMPAT)/$(COMPAT_PREVIOUS)/.installed: COMPAT_EXTRAS = experiments,embeddings,gguf,serve,test
$(COMPAT)/%/.installed: pyproject.toml
	rm -rf $(COMPAT)/$*
	$(PYTHON) -m venv $(COMPAT)/$*
	$(COMPAT)/$*/bin/python -m pip install --quiet "$(TORCH)"
	$(COMPAT)/$*/bin/python -m pip install --quiet -e ".[$(COMPAT_EXTRAS)]" "transformers==$*"
	touch $@

# A release without hf_alibi (which needs 5.0): only what a saved checkpoint's code needs ("every": any release)
$(COMPAT)/%/.checkpoint-only:
	rm -rf $(COMPAT)/$*
	$(PYTHON) -m venv $(COMPAT)/$*
	$(COMPAT)/$*/bin/python -m pip install --quiet "$(TORCH)"
	$(COMPAT)/$*/bin/python -m pip install --quiet $(if $(filter every,$*),transformers,"transformers==$*") safetensors
	touch $@

# A saved checkpoint's code on every release of COMPAT_EVERY: one venv, whose transformers (and the hub client and
# tokenizers it pins) is reinstalled for each; a release's test ids name it (test_remote_code_versions.py)
compat-every-release: install $(COMPAT)/every/.checkpoint-only
	for version in $(COMPAT_EVERY); do \
		$(COMPAT)/every/bin/python -m pip uninstall --quiet --yes transformers huggingface_hub tokenizers kernels; \
		$(COMPAT)/every/bin/python -m pip install --quiet "transformers==$$version" || exit 1; \
		HF_HUB_OFFLINE=1 HF_ALIBI_REMOTE_CODE_PYTHONS="$(abspath $(COMPAT))/every/bin/python" $(PY) -m pytest -q \
			tests/models/alibi/test_remote_code_versions.py -k "transformers-$$version" || exit 1; \
	done
