#!/usr/bin/env bash
# One prepared GPU session on a machine with torch+CUDA but no package registry (the device
# tool's machines): install NexRL from wheels carried in .whl/ (made here first by
# `.venv/bin/python .ci/gpu_wheels.py`), run the GPU suite with each
# distribution's tests in parallel, then the GPU benchmarks; logs and tables go to $OUT.
#   bash .ci/gpu_session.sh [tests|bench|all] [benchmark args...]
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TINKER_TELEMETRY=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
R=$PWD
export PYTHONPATH=$R:$R/plugins/nexrl_remote_api:$R/plugins/nexrl_grpo:$R/plugins/nexrl_engine:$R/nexrl_fsdp:$R/plugins/nexrl_service:$R/nexrl_tinker:$R/nexrl_weaver:$R/plugins/nexrl_episodes:$R/plugins/nexrl_math:$R/plugins/nexrl_sinks:$R/plugins/nexrl_testing:/tmp/site
export PATH=/tmp/site/bin:$PATH
# the tests run the nexrl beside their interpreter (the one under test, not the first on PATH)
ln -sf /tmp/site/bin/nexrl "$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/nexrl"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/card.txt"
if [[ $what == tests || $what == all ]]; then
  started=$(date +%s)
  timeout 420 make test-gpu GPU_PYTHON=python3 > "$OUT/gpu_tests.log" 2>&1; echo "exit $?" >> "$OUT/gpu_tests.log"
  echo "GPU suite: $(( $(date +%s) - started )) s wall"
  grep -E "^=== |passed|failed|exit [0-9]" "$OUT/gpu_tests.log"
fi
if [[ $what == bench || $what == all ]]; then
  # default: the sides a GPU user compares, few steps, a reward random weights can move
  [[ $# -gt 0 ]] || set -- --only inprocess remote_api weaver trl --steps 3 --reward length
  timeout 400 python3 benchmarks/scaling.py --device cuda "$@" 2>&1 | tee "$OUT/scaling_cuda.log" | tail -40
fi
