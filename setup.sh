#!/usr/bin/env bash
# Idempotent set-up of ./.venv: torch (kept if already importable, else torch==2.13.0, the CPU
# build on machines without a GPU), deepspeed, transformers, pytest, ruff, and this package (editable).
# Re-running is cheap: the pip step is skipped while pyproject.toml is unchanged, the DeepSpeed
# op build while its library is in .venv/torch_extensions.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
say() { echo "setup: $*"; }
if [ -x .venv/bin/python ]; then
  say ".venv exists"
else
  say "creating .venv with $("$PY" --version 2>&1) (it sees the system's packages)"
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1
# DeepSpeed JIT-builds its ops into TORCH_EXTENSIONS_DIR, by default one per-user directory every
# environment shares (a build by another venv's torch is rebuilt); this environment keeps its own,
# as hybrid's DeepSpeed backend and the tests set it at run time (hybrid/runtime/extensions.py extension_cache).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"

# Never reinstall a torch that is present; never let a range pull a multi-GB CUDA build.
if ! "$VPY" -c "import torch" 2>/dev/null; then
  say "installing torch==2.13.0 (about 1 GB on a fresh machine: a few minutes)"
  "$VPY" -m pip install -q torch==2.13.0
fi
"$VPY" - <<'PYCHECK'
import sys, torch
v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
if v < (2, 6):
    sys.exit(f"setup: torch {torch.__version__} is older than 2.6 (FSDP2 fully_shard and DeviceMesh); "
             "upgrade it yourself (pip install torch==2.13.0) - setup will not replace an installed torch")
print(f"setup: torch {torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build'})")
PYCHECK

stamp=.venv/.hybrid-setup
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing hybrid (editable) with deepspeed, transformers, accelerate, peft, bitsandbytes, matplotlib, pytest and ruff (a few minutes on a fresh machine)"
  "$VPY" -m pip install -q -e ".[dev,hf,plot,lora]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VPY" -c "import hybrid, deepspeed, yaml, pytest" >/dev/null 2>&1 || { echo "setup: install failed"; exit 1; }
  echo "$want" > "$stamp"
else
  say "hybrid and its dependencies are installed (pyproject.toml unchanged)"
fi
# A build killed midway leaves <cache>/<op>/lock, on which every later build waits forever (torch's
# FileBaton records no pid): cleared here when stale in our cache, named in one line elsewhere.
"$VPY" - <<'PYLOCKS'
import os, sys
from hybrid.errors import HybridError
from hybrid.runtime.extensions import is_own, ready
root = os.environ["TORCH_EXTENSIONS_DIR"]
try:
    ready(root, own=is_own(root))
except HybridError as e:
    sys.exit(f"setup: {e}")
PYLOCKS
# DeepSpeed's CPU accelerator JIT-compiles a shared-memory comm op the first time a process group
# starts; build it once here (within HYBRID_BUILD_TIMEOUT, 600 s) instead of in racing ranks.
if compgen -G "$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm/*.so" >/dev/null || compgen -G "$TORCH_EXTENSIONS_DIR/*/deepspeed_shm_comm/*.so" >/dev/null; then
  say "DeepSpeed's CPU communication op is built (in $TORCH_EXTENSIONS_DIR)"
else
  say "building DeepSpeed's CPU communication op into $TORCH_EXTENSIONS_DIR (about a minute, once)"
  "$VPY" - <<'PYBUILD'
import os, sys
from hybrid.errors import HybridError
from hybrid.runtime.extensions import build_op, build_timeout
try:
    build_op(os.environ["TORCH_EXTENSIONS_DIR"], timeout=build_timeout())
except HybridError as e:
    sys.exit(f"setup: {e}")
PYBUILD
fi
say "done: .venv/bin/hybrid demo; .venv/bin/python -m pytest -q"
