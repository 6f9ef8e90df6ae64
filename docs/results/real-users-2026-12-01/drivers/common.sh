# Sourced by the GPU session drivers: the stack and the deterministic environment.
cd "$(dirname "${BASH_SOURCE[0]}")/../../../.."  # the project root (the drivers ran from .gpu-run/, one level down)
# Once per machine: a second driver in the same call must not reinstall under a running one.
[ -e /tmp/site/.cg-installed ] || { bash .gpu/install.sh || exit 1; touch /tmp/site/.cg-installed; }
export PYTHONPATH=/tmp/site:$PWD MEGATRON_LM_DIR=$PWD/.megatron-lm PYTHONUNBUFFERED=1
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 CUDA_DEVICE_MAX_CONNECTIONS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_NVLS_ENABLE=0
F=$OUT/f; mkdir -p $F
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $F/gpu.txt
python3 -c "import sentencepiece, transformer_engine; print('sentencepiece', sentencepiece.__version__, 'te', transformer_engine.__version__)" >> $F/gpu.txt 2>&1
pack() { tar czf $OUT/results.tgz -C $OUT f; }
