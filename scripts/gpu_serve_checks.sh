#!/usr/bin/env bash
# The GPU serving path's checks as one device run, prepared on a machine
# without a GPU (the GPU machine has CUDA 13, no network, no Rust, and takes
# at most 64 MiB of files).
#
#   scripts/gpu_serve_checks.sh prepare
#       here: into gpu-run/ (git-ignored), everything the run needs:
#       - what scripts/gpu_checks.sh prepares (our CUDA kernels as PTX and
#         cubins, xz-compressed; their GPU test binary and the kernel bench);
#       - `siliceo-bench` with llama.cpp's CUDA backend for sm_90 plus PTX
#         (`cargo xtask build --cuda --arch ${GPU_ARCH:-90}`: CUDA 13 from
#         PyPI, portable x86-64, cuBLAS linked dynamically), xz-compressed:
#         one CUDA binary is ~75 MB stripped, so only this one travels (it
#         makes the model too: `siliceo-bench synth-model`);
#       - a vocabulary-only GGUF (Qwen2.5's tokenizer, a few MB) from which
#         the run makes its model.
#       It fails if the folder is over 60 MiB.
#   scripts/gpu_serve_checks.sh run
#       there (device run with carry ["gpu-run"]), about 8 minutes:
#       1. `ldd`: the binaries must resolve the machine's CUDA libraries
#          (cuBLAS 13) before anything runs;
#       2. `siliceo-bench synth-model --like qwen2.5-7b`: a 7B-class
#          GGUF with random weights and a real tokenizer (its text is noise,
#          its speed is a real 7B's: say so in every table that uses it);
#       3. the CUDA kernels' tests (among them the grafted layer step on
#          device memory against the CPU store: gpu_graft_layer_matches_the_cpu_pages,
#          and the prefill kernel against the decode kernel:
#          gpu_prefill_matches_decode_and_exact_attention) and bench
#          (decode, then a 512-token chunk on the prefill kernel against the
#          decode kernel a token at a time);
#       4. decode tok/s at 1, 8 and 32 streams over 4k and 32k contexts,
#          all layers on the GPU, llama.cpp's own KV (f16, q8_0, q5_1/q4_0);
#          then ours (f16, kv8, k5v4+tail64) at 4k and 32k, 1 and 8 streams:
#          every layer on the GPU with its store in VRAM and our CUDA kernels
#          on llama.cpp's device tensors (grafted attention on the device);
#          then, as the baseline, ours at 4k with SILICEO_DEVICE_ATTENTION=host
#          (attention on the CPU over a host store, tensors copied per layer).
#       Logs go to $OUT (or gpu-run/out); copy the tables into
#       docs/BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=gpu-run
# The persistent target directory CI uses: llama.cpp's CUDA build (about 27
# minutes on 2 cores) is kept there between sessions, not in the checkout.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/siliceo/target}"

case "${1:-}" in
prepare)
  scripts/gpu_checks.sh prepare
  built=$(cargo xtask build --cuda --arch "${GPU_ARCH:-90}" | sed -n 's/^build: \(\/.*siliceo-bench\)$/\1/p')
  cp "$built" "$dir/siliceo-bench"
  strip "$dir/siliceo-bench" 2>/dev/null || true
  cargo xtask fetch-model --spec
  tok=models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
  [ -f "$tok" ] || tok=models/SmolLM2-135M-Instruct.Q4_1.gguf
  # The CUDA build needs cuBLAS at run time: here, the wheel's.
  LD_LIBRARY_PATH="$HOME/.cache/siliceo/cuda-13.0.88/nvidia/cu13/lib" \
    "$dir/siliceo-bench" synth-model --vocab-only --tokenizer "$tok" --out "$dir/vocab.gguf"
  xz -T2 -6 -f "$dir/siliceo-bench"
  size=$(du -sm "$dir" | cut -f1)
  du -sh "$dir"/*
  if [ "$size" -gt 60 ]; then
    echo "gpu-run/ is ${size} MiB: over what a device run carries (64 MiB with the tree)" >&2
    exit 1
  fi
  echo "prepared $dir/ (${size} MiB): device run with carry [\"$dir\"] and command: scripts/gpu_serve_checks.sh run"
  ;;
run)
  [ -f "$dir/siliceo-bench.xz" ] || { echo "no $dir/siliceo-bench.xz: run 'scripts/gpu_serve_checks.sh prepare' first" >&2; exit 2; }
  xz -d -k -f "$dir/siliceo-bench.xz"
  scripts/gpu_checks.sh unpack
  out=${OUT:-$dir/out}
  mkdir -p "$out"
  status=0
  { nvidia-smi || true; lscpu | head -20 || true; } >"$out/machine.txt" 2>&1
  # 1. The CUDA libraries, from the machine's toolkit.
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    [ -d "$d" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
  done
  ldd "$dir/siliceo-bench" | tee "$out/ldd.txt"
  if grep -q "not found" "$out/ldd.txt"; then
    echo "siliceo-bench: a library is missing (above); nothing else runs" | tee -a "$out/summary.txt"
    exit 1
  fi
  # 2. The model: made here, in seconds.
  model=/tmp/synth-qwen2.5-7b.q4_k_m.gguf
  "$dir/siliceo-bench" synth-model --like qwen2.5-7b --quant q4_k_m \
    --tokenizer "$dir/vocab.gguf" --out "$model" 2>&1 | tee "$out/synth.log" || status=1
  # 3. Our kernels on the device (tests, then the kernel bench).
  export SILICEO_KERNELS_DIR="$PWD/$dir/kernels" SILICEO_REQUIRE_GPU=1
  timeout 120 "$dir/cuda-tests" --test-threads=1 --nocapture >"$out/test-gpu.log" 2>&1 || status=1
  tail -5 "$out/test-gpu.log"
  timeout 110 "$dir/bench" --gpu --mode decode --formats f16,kv8,k5v4 --ctx 4096,32768 --batch 1,8 \
    --reps 5 2>&1 | tee "$out/bench-gpu.log" || status=1
  # A 512-token prefill chunk's attention after 4k and 32k tokens, Qwen2.5-7B's
  # heads (28 over 4 of 128): the decode kernel a token at a time against the
  # prefill kernel.
  timeout 40 "$dir/bench" --gpu --mode prefill --formats f16,kv8,k5v4 --ctx 4096,32768 --chunk 512 \
    --heads 28 --kv-heads 4 --reps 3 2>&1 | tee -a "$out/bench-gpu.log" || status=1
  # 4. Serving decode with every layer on the GPU: llama.cpp's KV, then ours.
  timeout 140 "$dir/siliceo-bench" graft --model "$model" --gpu-layers 99 --threads 8 \
    --reps 3 --contexts 4096,32768 --streams 1,8,32 --only llama.cpp 2>&1 | tee "$out/serve-gpu.log" || status=1
  timeout 110 "$dir/siliceo-bench" graft --model "$model" --gpu-layers 99 --threads 8 \
    --reps 2 --quick --contexts 4096,32768 --streams 1,8 --only ours 2>&1 | tee "$out/serve-gpu-ours.log" || status=1
  SILICEO_DEVICE_ATTENTION=host timeout 50 "$dir/siliceo-bench" graft --model "$model" --gpu-layers 99 \
    --threads 16 --reps 1 --quick --contexts 4096 --streams 1 --only 'ours kv8' 2>&1 |
    tee "$out/serve-gpu-ours-host.log" || status=1
  echo "status $status" | tee -a "$out/summary.txt"
  exit $status
  ;;
*)
  echo "usage: scripts/gpu_serve_checks.sh prepare|run" >&2
  exit 2
  ;;
esac
