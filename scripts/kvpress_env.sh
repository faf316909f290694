#!/usr/bin/env bash
# The side environment of the kvpress reference check (bench/check_kvpress.py,
# tests/test_kvpress_reference.py): NVIDIA's kvpress 0.5.5 pins transformers < 5.3, which
# cachelib's own environment (.venv) does not have, so it lives in its own virtual environment,
# .venv-kvpress, next to .venv. Same Python and the same CPU PyTorch as scripts/bootstrap.sh
# (its CACHELIB_TORCH override included); cachelib itself is not installed there: the side
# environment only computes kvpress's scores, the comparison runs in .venv.
# Idempotent: a second run with unchanged inputs returns at once. Prints the venv's python.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${CACHELIB_KVPRESS_VENV:-.venv-kvpress}
TORCH_SPEC=${CACHELIB_TORCH:-torch==2.13.0}
KVPRESS_SPEC="kvpress==0.5.5"
TRANSFORMERS_SPEC="transformers>=4.56,<5.3"

log() { printf '[kvpress_env] %s\n' "$*" >&2; }

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "kvpress needs Python >= 3.10"'
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
PY="$VENV/bin/python"

stamp="$VENV/.stamp-kvpress"
want="$(cat scripts/kvpress_env.sh | "$PY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')-$TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "$PY"
    exit 0
fi

pip() { "$PY" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
log "installing PyTorch ($TORCH_SPEC)"
# shellcheck disable=SC2086
"$PY" -c 'import torch' 2>/dev/null || pip install $TORCH_SPEC
log "installing $KVPRESS_SPEC with $TRANSFORMERS_SPEC"
# shellcheck disable=SC2086
pip install "$KVPRESS_SPEC" "$TRANSFORMERS_SPEC" $TORCH_SPEC
"$PY" -c 'import kvpress, transformers; print("kvpress", __import__("importlib.metadata").metadata.version("kvpress"), "transformers", transformers.__version__)' >&2
echo "$want" > "$stamp"
log "done"
echo "$PY"
