# Two commands set everything up and check it: `make install` then `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned so pip takes the CPU build instead of several GB of CUDA packages.
PIP_INSTALL := $(BIN)/pip install --quiet -c constraints.txt
DISTRIBUTIONS := -e '.[test,tensorboard,postgres,data]' -e 'plugins/nexrl_remote_api[test]' -e 'plugins/nexrl_grpo[test]' -e 'plugins/nexrl_engine[test]' -e 'nexrl_fsdp[test]' -e 'plugins/nexrl_service[test]' -e 'nexrl_tinker[server,test]' \
	-e 'nexrl_weaver[server,test]' -e 'plugins/nexrl_episodes[test]' -e 'plugins/nexrl_math[test]' -e 'plugins/nexrl_sinks[test]' -e 'plugins/nexrl_testing[test,fuzz,postgres]' \
	-e 'examples/nexrl-example-plugin[test]'
# tinker-cookbook cannot be installed with its declared dependencies from PyPI (it wants
# tml-renderers>=0.4.1, which is not published there): install it without them, plus the
# runtime dependencies its RL trainer really uses. Only the cookbook compatibility test needs it.
COOKBOOK := tinker-cookbook==0.6.1
COOKBOOK_DEPS := chz datasets tiktoken blobfile cloudpickle pillow termcolor tqdm aiohttp anyio huggingface-hub pyrage

# Each distribution's tests run on their own, from its own folder, as a publisher would run them.
# The core's run last: its recipe-key walk reads what every earlier run recorded (see
# plugins/nexrl_testing/nexrl_testing/recipe_key_records.py) into one folder per `make test`.
TEST_DIRS := plugins/nexrl_remote_api plugins/nexrl_grpo plugins/nexrl_engine nexrl_fsdp plugins/nexrl_service nexrl_tinker nexrl_weaver plugins/nexrl_episodes plugins/nexrl_math plugins/nexrl_sinks plugins/nexrl_testing examples/nexrl-example-plugin .
# pytest's verdict is its exit code once the session is over: the process then ends with os._exit,
# skipping the interpreter's teardown, where the native threads third-party clients leave behind
# (the tinker SDK's event loop and HTTP runtime, pyarrow's allocator) once aborted a fully green run
# with "double free or corruption" after pytest had printed its summary.
RUN_PYTEST := import os, sys, pytest; code = pytest.main(); sys.stdout.flush(); sys.stderr.flush(); os._exit(int(code))

.PHONY: install test test-gpu mutations demo benchmarks clean

install:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(PIP_INSTALL) torch==2.13.0
	$(PIP_INSTALL) hatchling $(DISTRIBUTIONS)
	$(PIP_INSTALL) --no-deps $(COOKBOOK)
	$(PIP_INSTALL) $(COOKBOOK_DEPS)

test:
	@records=$$(mktemp -d); failed=""; for dir in $(TEST_DIRS); do \
		echo "=== pytest $$dir"; \
		(cd $$dir && NEXRL_RECIPE_KEY_RECORDS=$$records $(CURDIR)/$(BIN)/python -c '$(RUN_PYTEST)' --durations=15) || failed="$$failed $$dir"; \
	done; \
	rm -rf $$records; \
	if [ -n "$$failed" ]; then echo "tests failed in:$$failed"; exit 1; fi

# The GPU suite (tests marked gpu, files test_gpu_*.py): every path trained on CUDA and
# driven as a user does. On a machine with torch+CUDA and NexRL installed; the venv's python
# when there is one, else GPU_PYTHON (e.g. make test-gpu GPU_PYTHON=python3). The four
# distributions with GPU tests run at once (each trains the tiny model, which leaves the
# GPU mostly idle), so the suite takes as long as the slowest. Without a GPU every test is
# collected and skipped.
GPU_TEST_DIRS := plugins/nexrl_engine nexrl_fsdp nexrl_tinker nexrl_weaver .
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(CURDIR)/$(BIN)/python,python3)

test-gpu:
	@logs=$$(mktemp -d); for dir in $(GPU_TEST_DIRS); do \
		name=$$(cd $$dir && basename "$$PWD"); \
		(cd $$dir && $(GPU_PYTHON) -c '$(RUN_PYTEST)' -m gpu -rs --durations=10 > $$logs/$$name.log 2>&1; echo $$? > $$logs/$$name.rc) & \
	done; wait; failed=""; \
	for log in $$logs/*.log; do \
		name=$$(basename $$log .log); echo "=== pytest -m gpu: $$name"; cat $$log; \
		case $$(cat $$logs/$$name.rc) in 0|5) ;; *) failed="$$failed $$name";; esac; \
	done; rm -rf $$logs; \
	if [ -n "$$failed" ]; then echo "GPU tests failed in:$$failed"; exit 1; fi

# Each mutation of tests/mutations.yaml, applied to a throwaway copy, must fail the tests it names
# (`make test` runs the same list through tests/test_mutations.py).
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
