# Sourced before running anything: environment that must be set before Python starts.
# MLX's Linux CPU wheel multiplies with a slow reference BLAS; OpenBLAS, preloaded, is ~30x faster.
for _blas in /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3; do
    if [ "$(uname -s)" = Linux ] && [ -e "$_blas" ]; then
        export LD_PRELOAD="${_blas}${LD_PRELOAD:+:$LD_PRELOAD}"
        # With OpenBLAS preloaded, PyTorch's GEMMs land in it too; OpenMP threads spinning beside
        # OpenBLAS's own threads made torch decode 4x slower (measured), so OpenMP gets one.
        export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-$(nproc)}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
        break
    fi
done
unset _blas
# Never reach for a model hub: every model we run is on disk.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
