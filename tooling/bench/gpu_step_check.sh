#!/usr/bin/env bash
# Issue 35's checks on a lent GPU, in one call of at most 10 minutes (../shared/gpu/README.md:
# after staging, `source .gpu-c/env.sh && bash tooling/bench/gpu_step_check.sh`). Each step has
# its own timeout so that a hang costs one step, not the call; every report goes under $OUT.
#
#   tests.txt            tests/test_cuda.py and tests/test_cuda_graphs.py
#   profile-float32.txt  `bench profile`: ms, operators, kernels and launches a step, and
#                        the Python functions the host spends the step in (cProfile)
#   profile-bfloat16.txt the same in bfloat16
#   decoders.txt         `bench offline --decoder ...`: the trained drafters against
#                        autoregressive decoding, greedy identity per row
#   offline.txt          decode tokens/s and TTFT against transformers
#
# DEVICE=cpu MAX_TOKENS=8 STEPS=4 runs the same steps on a CPU (a dry run of the script; put the
# project's environment first on PATH: `PATH=.venv/bin:$PATH`).
set -u
OUT=${OUT:-/tmp/gpu-step-check}
DEVICE=${DEVICE:-cuda}
MAX_TOKENS=${MAX_TOKENS:-128}
STEPS=${STEPS:-32}
mkdir -p "$OUT"
step() {  # step NAME SECONDS COMMAND...: run it, its output to $OUT/NAME.txt, and say how it ended
  local name=$1 seconds=$2
  shift 2
  local command=("$@")
  # `timeout` runs programs, not shell functions: `specserve` is the whole command line tool
  # (bench lives in tooling.cli; server.cli, which env.sh's function runs, has no bench).
  [ "${command[0]}" = specserve ] && command=(python3 -m tooling.cli "${command[@]:1}")
  local started=$SECONDS
  timeout "$seconds" "${command[@]}" >"$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - started)) s" | tee -a "$OUT/summary.txt"
}

{
  echo "device: $DEVICE"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  git log -1 --format='commit %h %s' 2>/dev/null
} >"$OUT/summary.txt"

step tests 170 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_graphs.py
step profile-float32 60 specserve bench profile --device "$DEVICE" --steps "$STEPS" --python 15 \
  --decoder autoregressive,eagle3-k1,hydra-k1,ngram,ngram-goodput
step profile-bfloat16 45 specserve bench profile --device "$DEVICE" --dtype bfloat16 \
  --steps "$STEPS" --decoder autoregressive,eagle3-k1
step decoders 190 specserve bench offline --device "$DEVICE" --max-tokens "$MAX_TOKENS" \
  --decoder eagle3-k1,eagle3,eagle3-tree2,eagle3-goodput,hybrid-eagle3-k1,hydra-k1,ngram,ngram-goodput \
  --no-hf --no-llamacpp --plot none
step offline 100 specserve bench offline --device "$DEVICE" --max-tokens "$MAX_TOKENS" --no-llamacpp
cat "$OUT/summary.txt"
