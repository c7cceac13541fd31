#!/usr/bin/env bash
# Idempotent set-up of ./.venv: torch (kept if already importable, else torch==2.13.0, the CPU
# build on machines without a GPU), deepspeed, transformers, pytest, and this package (editable).
# Re-running is cheap: the pip step is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv --system-site-packages .venv
VPY=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Never reinstall a torch that is present; never let a range pull a multi-GB CUDA build.
if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0"
  "$VPY" -m pip install -q torch==2.13.0
fi
"$VPY" - <<'PYCHECK'
import sys, torch
v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
if v < (2, 6):
    sys.exit(f"setup: torch {torch.__version__} is older than 2.6 (FSDP2 fully_shard and DeviceMesh); "
             "upgrade it yourself (pip install torch==2.13.0) - setup will not replace an installed torch")
PYCHECK

stamp=.venv/.hybrid-setup
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing hybrid and its dependencies into .venv"
  "$VPY" -m pip install -q -e ".[dev,hf,plot]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VPY" -c "import hybrid, deepspeed, yaml, pytest" >/dev/null 2>&1 || { echo "setup: install failed"; exit 1; }
  # DeepSpeed's CPU accelerator JIT-compiles a shared-memory comm op the first time a process
  # group starts; build it once here instead of in racing ranks.
  "$VPY" - <<'PYBUILD' 2>&1 | grep -v "WARNING\|Setting accelerator" || true
from deepspeed.accelerator import get_accelerator
b = get_accelerator().create_op_builder("ShareMemCommBuilder")
if b is not None and b.is_compatible():
    b.load(verbose=False)
PYBUILD
  echo "$want" > "$stamp"
fi
