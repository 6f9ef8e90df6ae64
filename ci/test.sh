#!/usr/bin/env bash
# The project's test command (the README's): CPU unit tests, plus the GPU functional farm, whose
# cases skip with their reason where GPUs or Transformer Engine are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest tests/unit tests/functional -q -rs -p no:cacheprovider "$@"
