# Two commands set everything up and check it: `make install` then `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned so pip takes the CPU build instead of several GB of CUDA packages.
PIP_INSTALL := $(BIN)/pip install --quiet --no-compile -c constraints.txt
DISTRIBUTIONS := -e '.[test,tensorboard,postgres,data]' -e 'plugins/nexrl_remote_api[test]' -e 'plugins/nexrl_grpo[test]' -e 'plugins/nexrl_engine[test]' -e 'nexrl_fsdp[test]' -e 'plugins/nexrl_service[test]' -e 'nexrl_tinker[server,test]' \
	-e 'nexrl_weaver[server,test]' -e 'plugins/nexrl_episodes[test]' -e 'plugins/nexrl_math[test]' -e 'plugins/nexrl_sinks[test]' -e 'plugins/nexrl_ray[test]' -e 'plugins/nexrl_testing[test,fuzz,postgres]' \
	-e 'examples/nexrl-example-plugin[test]'
# tinker-cookbook cannot be installed with its declared dependencies from PyPI (it wants
# tml-renderers>=0.4.1, which is not published there): install it without them, plus the
# runtime dependencies its RL trainer really uses. Only the cookbook compatibility test needs it.
COOKBOOK := tinker-cookbook==0.6.1
COOKBOOK_DEPS := chz datasets tiktoken blobfile cloudpickle pillow termcolor tqdm aiohttp anyio huggingface-hub pyrage

.PHONY: install test lint test-gpu mutations demo benchmarks clean

install:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) hatchling $(DISTRIBUTIONS)
	$(PIP_INSTALL) --no-deps $(COOKBOOK)
	$(PIP_INSTALL) $(COOKBOOK_DEPS)

# The linters (as `make lint`) beside each distribution's tests, each suite from its own folder
# as a publisher would run them, one job per CPU at once; the recipe-key walk and the mutation
# list run last (tests/run_suites.py).
test:
	$(BIN)/python tests/run_suites.py

# ruff and mypy over every distribution, configured once in the root pyproject.toml.
lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy

# The GPU suite (tests marked gpu, files test_gpu_*.py), every distribution's at once. On a
# machine with torch+CUDA and NexRL installed: the venv's python when there is one, else
# GPU_PYTHON (e.g. make test-gpu GPU_PYTHON=python3). Without a GPU every test is skipped.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(CURDIR)/$(BIN)/python,python3)

test-gpu:
	$(GPU_PYTHON) tests/run_suites.py --gpu

# Each mutation of tests/mutations.yaml, applied to a throwaway copy, must fail the tests it names
# (`make test` runs the same list through tests/test_mutations.py; give that script mutation ids
# to run only those).
mutations:
	$(BIN)/python tests/test_mutations.py

# A fresh quickstart each time: --overwrite replaces the previous demo run (and says so).
# DEMO_ARGS adds overrides, e.g. make demo DEMO_ARGS='schedule.steps=10'.
DEMO_ARGS ?=
demo:
	$(BIN)/nexrl train --overwrite $(DEMO_ARGS)

benchmarks:
	$(PIP_INSTALL) trl
	$(BIN)/python benchmarks/tinker_service_overhead.py
	$(BIN)/python benchmarks/weaver_service_overhead.py
	$(BIN)/python benchmarks/zmq_transport.py
	$(BIN)/python benchmarks/episode_server.py
	$(BIN)/python benchmarks/vs_trl.py

clean:
	rm -rf $(VENV) build dist
