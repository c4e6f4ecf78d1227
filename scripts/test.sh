#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh cpu,tools,test
.venv/bin/ruff check .   # the style of ruff.toml, before the suite
exec .venv/bin/python -m pytest tests "$@"
