#!/usr/bin/env bash
# The checks that need a CUDA device, in one go, for a machine that has one (CI has none).
# Runs against this checkout's sources with the machine's own python3/torch; writes its reports to $OUT
# (default ./gpu-check). Usage: OUT=dir bash tools/gpu_check.sh [--suite]   (--suite: the whole suite too)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
PY=${PYTHON:-python3}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
                              'nccl', torch.cuda.nccl.version())"
  echo "cores: $(nproc)"
  $PY -m polytrain devices
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== GPU-marked tests"
$PY -m pytest -q -p no:cacheprovider -m "gpu or multigpu" -ra tests 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"

echo "== the CLI on the GPU"
run() {
  echo "\$ polytrain train $*"
  timeout 300 $PY -m polytrain train "$@" 2>&1 | tail -4
  echo "exit ${PIPESTATUS[0]}"
}
{
  run --device cuda --strategy single --model cifar_cnn --data synthetic:shape=3x24x24,size=8192 \
      --batch-size 128 --steps 300 --eval-every 0 --progress lines --metrics-file "$OUT/single_cuda.jsonl"
  run --device cuda --strategy sync --workers 1 --model cifar_cnn --data synthetic:shape=3x24x24,size=8192 \
      --batch-size 128 --steps 300 --eval-every 0 --progress lines
  run --device cuda --workers 2 --steps 5
  run --device cuda --workers 2 --soft-placement --steps 5
  run --device cuda:0 --workers 2 --backend gloo --steps 50 --progress lines
  run --device cuda --place classifier=cpu --log-placement --steps 3 --strategy single
} | tee "$OUT/cli.txt"

echo "== precision, memory, activation checkpointing and compile on the GPU"
LM=(--device cuda --strategy single --model transformer_lm:layers=4,dim=256,heads=4 --data text:seq_len=128
    --batch-size 32 --optimizer adam --eval-every 0 --progress lines)
{
  for p in 32-true bf16-mixed bf16-true 16-mixed; do
    run "${LM[@]}" --steps 200 --precision "$p" --metrics-file "$OUT/lm_$p.jsonl"
  done
  run "${LM[@]}" --steps 200 --activation-checkpointing full
  run "${LM[@]}" --steps 200 --compile
  run "${LM[@]}" --steps 20 --memory-limit 20MiB      # refused: the model's state alone is larger
  run "${LM[@]}" --steps 20 --memory-limit 2GiB
  run "${LM[@]}" --steps 20 --device cuda:0 --strategy fsdp --workers 2 --backend gloo
  run "${LM[@]}" --steps 20 --device cuda:0 --strategy sync --workers 2 --backend gloo
  run "${LM[@]}" --steps 20 --device cuda:0 --strategy pipeline --workers 2 --backend gloo   # refused: needs nccl
} | tee "$OUT/features.txt"

echo "== model FLOPs utilisation: transformer_lm 8 x 1024, bf16-mixed, compiled, against a plain loop"
timeout 400 $PY benchmarks/mfu.py --steps 200 --out "$OUT/mfu.json" 2>&1 | grep -v -i warn | tail -5 | tee "$OUT/mfu.txt"

if [ "${1:-}" = "--suite" ]; then
  echo "== the whole suite, with CUDA visible"
  timeout 420 $PY -m pytest -q -p no:cacheprovider -n 8 -ra tests > "$OUT/suite.txt" 2>&1
  echo "exit $?"; tail -30 "$OUT/suite.txt"
fi
