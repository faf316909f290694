# Sourced before running anything: environment that must be set before Python starts.
# MLX's Linux CPU wheel multiplies with Debian's OpenBLAS (~30x faster than the reference BLAS it
# ships: scripts/bootstrap.sh links it in, nothing is preloaded), PyTorch with its own MKL. OpenBLAS
# takes every core; PyTorch's OpenMP one thread: its threads spinning beside OpenBLAS's, or beside
# the test suite's other workers, made a decode several times slower (measured: 4x, and 895 ms
# against 83 ms a step of SmolLM2 at load 5).
for _blas in /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3; do
    if [ "$(uname -s)" = Linux ] && [ -e "$_blas" ]; then
        export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-$(nproc)}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
        break
    fi
done
unset _blas
# Never reach for a model hub: every model we run is on disk.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
