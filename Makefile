# Two commands set everything up and check it: `make install` then `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned so pip takes the CPU build instead of several GB of CUDA packages.
CONSTRAINTS := -c constraints.txt
DISTRIBUTIONS := -e '.[test]' -e 'plugins/nexrl_grpo[test]' -e 'examples/nexrl-example-plugin[test]'

.PHONY: install test demo clean

install:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(CONSTRAINTS) torch==2.13.0
	$(BIN)/pip install --quiet $(CONSTRAINTS) hatchling $(DISTRIBUTIONS)

test:
	$(BIN)/python -m pytest

demo:
	$(BIN)/nexrl plugins

clean:
	rm -rf $(VENV) build dist
