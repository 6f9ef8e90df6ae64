#!/usr/bin/env bash
# Builds the project's Python 3.12 virtual environment from scratch at .venv and installs the
# package with its test extra. PYTHON may name the interpreter; otherwise python3.12 on PATH or
# pyenv's 3.12 is used.
set -euo pipefail
cd "$(dirname "$0")/.."
is_312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }
python=${PYTHON:-}
if [ -z "$python" ]; then
  # The first candidate that really runs 3.12 (a pyenv shim can exist and still refuse to run).
  for candidate in python3.12 /root/.pyenv/versions/3.12.1/bin/python "$HOME/.pyenv/versions/3.12.1/bin/python"; do
    if is_312 "$candidate"; then python=$candidate; break; fi
  done
fi
if [ -z "$python" ] || ! is_312 "$python"; then
  echo "ci/setup_venv.sh: needs Python 3.12; set PYTHON=/path/to/python3.12" >&2
  exit 2
fi
rm -rf .venv
"$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import megatron_cg_plugin, megatron.core, torch; print('venv ready:', megatron_cg_plugin.__version__, 'megatron-core', megatron.core.__version__, 'torch', torch.__version__)"
