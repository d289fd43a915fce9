#!/usr/bin/env bash
# The GPU check: every CUDA test, the worker's gRPC tests on the GPU, and
# the benchmarks (grouped LoRA kernels, dense and Mixture-of-Experts decode,
# each beside transformers + PEFT on the same GPU), in one command.
#
#   deploy/gpu-check.sh build   on the build machine (x86_64 Linux with cargo):
#                               release test and benchmark binaries into
#                               target/gpu-check/, and all of them in
#                               target/gpu-check.tar.xz (the file to copy)
#   deploy/gpu-check.sh run     on the GPU machine, from the repository root,
#                               with target/gpu-check/ or its .tar.xz there
#   deploy/gpu-check.sh         both, on a machine with cargo and a GPU
#
# `run` fails if any GPU test fails or cannot find the GPU or NVRTC (the
# GPU tests run with --include-ignored; LORAFLEET_REQUIRE_NVRTC=1), then prints the
# benchmark tables, whose last lines say which targets were missed.
# GPU_CHECK_SKIP="step ..." leaves steps out (and their binaries need not
# be there), for a run that fits the device time at hand.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu-check

executables() {
  grep -o '"executable":"[^"]*"' | sed 's/^"executable":"//; s/"$//'
}

build() {
  mkdir -p "$out"
  cargo test --release -p lorafleet-engine --test cuda_gpu --test cuda_engine --test cuda_quantized \
    --test cuda_adapter_kinds --test cuda_kernels_compile \
    --no-run --message-format=json | executables > "$out/.tests"
  cargo bench -p lorafleet-engine --bench cuda_lora --bench cuda_decode --bench cuda_long --bench moe_decode --no-run \
    --message-format=json | executables > "$out/.benches"
  while read -r exe; do
    name=$(basename "$exe" | sed 's/-[0-9a-f]*$//')
    cp "$exe" "$out/$name"
    strip "$out/$name" 2>/dev/null || true
  done < <(cat "$out/.tests" "$out/.benches")
  # The worker's gRPC integration tests and the worker they start: the
  # tests find the binary one directory above their own (as cargo lays
  # out target/<profile>/deps/).
  mkdir -p "$out/deps"
  cargo build --release -p lorafleet-worker --bin lorafleet-worker
  cp target/release/lorafleet-worker "$out/lorafleet-worker"
  strip "$out/lorafleet-worker"
  exe=$(cargo test --release -p lorafleet-tests --test worker_grpc --no-run --message-format=json | executables)
  cp "$exe" "$out/deps/worker_grpc"
  strip "$out/deps/worker_grpc"
  rm -f "$out/.tests" "$out/.benches"
  ls -l "$out" "$out/deps"
  du -sh "$out"
  # One compressed file to carry to the GPU machine (the working tree and
  # what travels with it share one size limit); `run` unpacks it there.
  tar cJf "$out.tar.xz" -C "$(dirname "$out")" "$(basename "$out")"
  ls -l "$out.tar.xz"
}

# Puts the directory holding library $1 on LD_LIBRARY_PATH when the
# loader cannot already find it (the CUDA toolkit's lib64, or a Python
# wheel's nvidia/*/lib).
find_lib() {
  ldconfig -p 2>/dev/null | grep -q "$1" && return 0
  local dir found
  for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$dir/$1" ] && found=$dir && break
  done
  if [ -z "${found:-}" ]; then
    found=$(find /usr/local /opt /usr/lib -name "$1" -print -quit 2>/dev/null | xargs -r dirname)
  fi
  if [ -n "${found:-}" ]; then
    export LD_LIBRARY_PATH="$found${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "gpu-check: $1 from $found"
  else
    echo "gpu-check: $1 not found" >&2
  fi
}

run() {
  if [ ! -d "$out" ] && [ -f "$out.tar.xz" ]; then
    tar xJf "$out.tar.xz" -C "$(dirname "$out")"
  fi
  # GPU_CHECK_SKIP="cuda_lora reduced_precision" leaves steps out when
  # device time is short (a skipped step is said, never silent); a skipped
  # step's binaries need not be there.
  skipped() { [[ " ${GPU_CHECK_SKIP:-} " == *" $1 "* ]]; }
  for exe in cuda_kernels_compile cuda_gpu cuda_engine cuda_adapter_kinds cuda_quantized cuda_lora cuda_decode cuda_long moe_decode lorafleet-worker deps/worker_grpc; do
    case $exe in
      cuda_kernels_compile) skipped kernels_compile && continue ;;
      lorafleet-worker | deps/worker_grpc) skipped worker_grpc && continue ;;
      moe_decode) skipped moe_decode && skipped moe_decode_gpt_oss && skipped moe_decode_gpt_oss_mxfp4 && continue ;;
      cuda_long) skipped cuda_long && skipped cuda_long_gpt_oss && continue ;;
      cuda_decode) skipped cuda_decode && skipped cuda_decode_dora && skipped cuda_decode_saved_head && continue ;;
      *) skipped "$exe" && continue ;;
    esac
    [ -x "$out/$exe" ] || { echo "gpu-check: $out/$exe is missing; run '$0 build' first" >&2; exit 1; }
  done
  # Logs and the benchmark table go to GPU_CHECK_OUT (default
  # target/gpu-check/results).
  local results=${GPU_CHECK_OUT:-$out/results}
  mkdir -p "$results"
  find_lib libnvrtc.so.13
  find_lib libcublas.so.13
  export LORAFLEET_REQUIRE_NVRTC=1 RUST_BACKTRACE=1
  export LORAFLEET_FIXTURES="$PWD/worker/engine/tests/fixtures"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$results/gpu.txt" || true
  # Every step runs even when one before it fails, so one run reports all
  # of them; the exit status says whether all passed.
  local failed=()
  step() {
    local name=$1
    shift
    if skipped "$name"; then
      echo "== $name: SKIPPED (GPU_CHECK_SKIP)"
      return 0
    fi
    echo "== $name"
    if "$@" > "$results/$name.log" 2>&1; then
      echo "== $name: passed"
    else
      echo "== $name: FAILED (exit $?)"
      failed+=("$name")
    fi
    grep -E '^(test |thread |  left|  right|---- |failures:|test result)|panicked|relative error' \
      "$results/$name.log" | head -80 || true
  }
  step kernels_compile "$out/cuda_kernels_compile" --test-threads=1
  # The GPU tests are #[ignore]d where no device is; here they all run.
  step cuda_gpu "$out/cuda_gpu" --test-threads=1 --include-ignored
  step cuda_engine "$out/cuda_engine" --test-threads=1 --include-ignored
  # DoRA and lora_bias adapters: exact against the CPU backend and PEFT.
  step cuda_adapter_kinds "$out/cuda_adapter_kinds" --test-threads=1 --include-ignored
  # Quantized bases: codes dequantized in the projections; FP8 GEMMs
  # through cuBLASLt for a checkpoint that quantizes its activations.
  step cuda_quantized "$out/cuda_quantized" --test-threads=1 --include-ignored
  # The worker serving over gRPC from the GPU: every worker the tests
  # start runs --backend cuda (LORAFLEET_TEST_BACKEND). The cancellation
  # test is skipped: it needs two sequences running across a Watch report
  # interval, and on a GPU the other one finishes its 400 tokens first.
  step worker_grpc env LORAFLEET_TEST_BACKEND=cuda "$out/deps/worker_grpc" --test-threads=1 \
    --skip a_cancelled_stream_frees_its_kv_blocks
  step cuda_lora "$out/cuda_lora"
  export LORAFLEET_BENCH_STANDIN=${LORAFLEET_BENCH_STANDIN:-/tmp/lorafleet-standin}
  # Mixture-of-Experts decode on the GPU (a ~270M Qwen3-MoE-shape stand-in,
  # written the first time), then transformers + PEFT on the same GPU,
  # stand-in and workload.
  step moe_decode env LORAFLEET_BENCH_BACKEND=cuda "$out/moe_decode"
  # The same on a GPT-OSS-20B-architecture stand-in (sinks, sliding and
  # full layers, YaRN, 32 biased experts top 4, the clamped SwiGLU),
  # adapters on attention and experts: bf16 experts, then MXFP4 ones.
  step moe_decode_gpt_oss env LORAFLEET_BENCH_BACKEND=cuda LORAFLEET_BENCH_MODEL=gpt-oss \
    "$out/moe_decode"
  step moe_decode_gpt_oss_mxfp4 env LORAFLEET_BENCH_BACKEND=cuda \
    LORAFLEET_BENCH_MODEL=gpt-oss-mxfp4 "$out/moe_decode"
  if python3 -c 'import torch, transformers, peft' 2>/dev/null; then
    step peft_moe_baseline env PEFT_DEVICE=cuda PEFT_DTYPE=bfloat16 \
      timeout "${PEFT_MOE_TIMEOUT:-300}" python3 worker/engine/benches/peft_moe_baseline.py \
      "$LORAFLEET_BENCH_STANDIN/qwen3-moe-shape" "${PEFT_MOE_COUNTS:-1,8,64}"
  fi
  # The engine on a Llama-3.2-1B-shape stand-in (about 6 GB written under
  # LORAFLEET_BENCH_STANDIN the first time).
  # CUDA_DECODE_TIMEOUT (seconds) bounds it where device time is short.
  step cuda_decode timeout "${CUDA_DECODE_TIMEOUT:-0}" "$out/cuda_decode"
  # Its run is added to the chart of tokens/s against adapters
  # (docs/plots/gpu_decode_adapters.{json,svg}); a copy goes with the logs,
  # to be committed from the build machine.
  cp docs/plots/gpu_decode_adapters.json docs/plots/gpu_decode_adapters.svg "$results/" 2>/dev/null || true
  # The same tables with the adapters as DoRA (what DoRA costs on the GPU).
  step cuda_decode_dora env LORAFLEET_BENCH_DORA=1 LORAFLEET_BENCH_TABLES_ONLY=1 \
    LORAFLEET_BENCH_ADAPTERS="${LORAFLEET_BENCH_ADAPTERS:-0,1,8,64}" \
    timeout "${CUDA_DECODE_TIMEOUT:-0}" "$out/cuda_decode"
  # And each with its own lm_head (525 MB a copy at this shape: 8 at most).
  step cuda_decode_saved_head env LORAFLEET_BENCH_SAVED_HEAD=1 LORAFLEET_BENCH_TABLES_ONLY=1 \
    LORAFLEET_BENCH_ADAPTERS=0,1,8 timeout "${CUDA_DECODE_TIMEOUT:-0}" "$out/cuda_decode"
  # Long prompts (1,600 prompt and 600 new tokens, 16 at a time, 8
  # rank-32 adapters) against the base model alone, on the same stand-in.
  step cuda_long timeout "${CUDA_LONG_TIMEOUT:-0}" "$out/cuda_long"
  # The same workload on the GPT-OSS-20B-architecture stand-in, its MXFP4
  # experts, 8 adapters on attention and experts.
  step cuda_long_gpt_oss env LORAFLEET_LONG_MODEL=gpt-oss-mxfp4 \
    timeout "${CUDA_LONG_TIMEOUT:-0}" "$out/cuda_long"
  # transformers + PEFT on the same GPU, stand-in and workload as
  # cuda_decode: the baseline its tokens/s are compared with.
  if python3 -c 'import torch, transformers, peft' 2>/dev/null; then
    step peft_baseline env PEFT_DEVICE=cuda PEFT_MODEL=model-bf16 PEFT_DTYPE=bfloat16 \
      python3 worker/engine/benches/peft_baseline.py \
      "$LORAFLEET_BENCH_STANDIN/llama-3.2-1b-shape" "${PEFT_COUNTS:-1,8,64,512}"
    grep '^|' "$results/peft_baseline.log" || true
  fi
  # What transformers + PEFT themselves give in bf16 and f16 on this GPU,
  # beside the engine's own figures, where python3 has them.
  if python3 -c 'import torch, transformers, peft' 2>/dev/null; then
    step reduced_precision python3 worker/engine/scripts/reduced_precision.py \
      "$LORAFLEET_FIXTURES" "$results/reduced_precision.json"
    [ -f "$results/reduced_precision.log" ] && tail -2 "$results/reduced_precision.log"
  fi
  [ -f "$results/cuda_lora.log" ] && tail -40 "$results/cuda_lora.log"
  grep '^|' "$results/cuda_decode.log" || true
  for log in cuda_long cuda_long_gpt_oss; do
    [ -f "$results/$log.log" ] && grep '^|' "$results/$log.log" || true
  done
  for log in moe_decode moe_decode_gpt_oss moe_decode_gpt_oss_mxfp4 peft_moe_baseline; do
    [ -f "$results/$log.log" ] && grep -E '^(\||MoE|[0-9]+ adapters)' "$results/$log.log" || true
  done
  if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu-check: failed: ${failed[*]}" >&2
    exit 1
  fi
  echo "gpu-check: every step passed"
}

case "${1:-all}" in
  build) build ;;
  run) run ;;
  all) build; run ;;
  *) echo "usage: $0 [build|run]" >&2; exit 2 ;;
esac
