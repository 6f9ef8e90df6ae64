#!/usr/bin/env bash
# The project's test command (the README's): lint, format and type checks over the package, then the
# CPU unit tests, plus the GPU functional farm, whose cases skip with their reason where GPUs or
# Transformer Engine are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check megatron_cg_plugin tests
.venv/bin/ruff format --check megatron_cg_plugin tests
.venv/bin/mypy megatron_cg_plugin
exec .venv/bin/python -m pytest tests/unit tests/functional -q -rs -p no:cacheprovider "$@"
