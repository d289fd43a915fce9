#!/usr/bin/env bash
# The GPU check: every CUDA test and the grouped-LoRA kernel benchmark, in
# one command.
#
#   deploy/gpu-check.sh build   on the build machine (x86_64 Linux with cargo):
#                               release test and benchmark binaries into
#                               target/gpu-check/ (small enough to copy)
#   deploy/gpu-check.sh run     on the GPU machine, from the repository root,
#                               with target/gpu-check/ copied there
#   deploy/gpu-check.sh         both, on a machine with cargo and a GPU
#
# `run` fails if any GPU test fails or cannot find the GPU or NVRTC
# (LORAFLEET_REQUIRE_GPU=1, LORAFLEET_REQUIRE_NVRTC=1), then prints the
# benchmark table, whose last lines say which targets were missed.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu-check

executables() {
  grep -o '"executable":"[^"]*"' | sed 's/^"executable":"//; s/"$//'
}

build() {
  mkdir -p "$out"
  cargo test --release -p lorafleet-engine --test cuda_gpu --test cuda_kernels_compile \
    --no-run --message-format=json | executables > "$out/.tests"
  cargo bench -p lorafleet-engine --bench cuda_lora --no-run --message-format=json \
    | executables > "$out/.benches"
  while read -r exe; do
    name=$(basename "$exe" | sed 's/-[0-9a-f]*$//')
    cp "$exe" "$out/$name"
    strip "$out/$name" 2>/dev/null || true
  done < <(cat "$out/.tests" "$out/.benches")
  rm -f "$out/.tests" "$out/.benches"
  ls -l "$out"
}

run() {
  for exe in cuda_kernels_compile cuda_gpu cuda_lora; do
    [ -x "$out/$exe" ] || { echo "gpu-check: $out/$exe is missing; run '$0 build' first" >&2; exit 1; }
  done
  # The CUDA libraries wherever the toolkit put them.
  for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$dir" ] && export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
  export LORAFLEET_REQUIRE_GPU=1 LORAFLEET_REQUIRE_NVRTC=1
  export LORAFLEET_FIXTURES="$PWD/worker/engine/tests/fixtures"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$out/cuda_kernels_compile" --test-threads=1
  "$out/cuda_gpu" --test-threads=1
  "$out/cuda_lora"
}

case "${1:-all}" in
  build) build ;;
  run) run ;;
  all) build; run ;;
  *) echo "usage: $0 [build|run]" >&2; exit 2 ;;
esac
