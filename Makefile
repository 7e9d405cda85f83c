# The two commands at the top of the README. Each creates or refreshes .venv itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench clean-venv

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints/cpu.txt -e ".[test,dev,megatron,wandb,agent,strands]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tools.demo

# Compiled modules are kept (__pycache__, ignored by git) even where the environment says not to write them: every
# test and every actor process would otherwise compile the project from source again.
test: $(STAMP)
	$(PY) -m ruff check .
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest

# The inner loop: unit tests only (no processes, sockets or model builds), in one process; under 90 s here.
test-fast: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -m unit -n 0 -q --durations=5

lint: $(STAMP)
	$(PY) -m ruff check .

clean-venv:
	rm -rf $(VENV)
