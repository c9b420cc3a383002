#!/usr/bin/env bash
# Issue 9's GPU checks as one device run, prepared on a machine without a GPU.
#
#   scripts/gpu_checks.sh prepare
#       here: builds everything the run needs into gpu-run/ (git-ignored): the
#       CUDA kernels (`cargo xtask kernels`: compute_75 PTX and sm_75/80/90
#       cubins; nvcc from PyPI where there is none), the CUDA test binary of
#       siliceo-kernels-turing and the kernel bench, both with the `cuda`
#       feature (cudarc loads the driver at run time, so they build without
#       one) and for baseline x86-64 (the kernels pick AVX2/AVX-512 at run
#       time), so they run on whatever CPU the GPU machine has.
#   scripts/gpu_checks.sh run
#       on the GPU machine (device run with carry ["gpu-run"]; no Rust needed):
#       the CUDA kernels against the CPU kernel (SILICEO_REQUIRE_GPU: no GPU
#       is a failure), from the device's cubin and again from the PTX alone,
#       then `bench --gpu`: achieved bandwidth against the device's peak and
#       a measured copy, per format, context and batch (and the F16 kernel's
#       loads-in-flight variants at 32k); then the tests again
#       under compute-sanitizer (memcheck, racecheck, synccheck); then the CPU kernel's
#       thread scaling on that machine's cores. Logs go to $OUT (or
#       gpu-run/out); copy the tables into docs/BENCHMARKS.md.
#
# Equivalent with a Rust toolchain on the GPU machine: `cargo xtask test-gpu`
# and `cargo xtask bench kernels --gpu ...`.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=gpu-run

# The kernels travel as kernels.tar.xz (`prepare`), unpacked into
# $dir/kernels by `run` and by scripts/gpu_serve_checks.sh (`unpack`).
unpack_kernels() {
  [ -f "$dir/kernels.tar.xz" ] || { echo "no $dir/kernels.tar.xz: run prepare first" >&2; exit 2; }
  rm -rf "$dir/kernels" && mkdir -p "$dir/kernels"
  xz -dc "$dir/kernels.tar.xz" | tar -C "$dir/kernels" --strip-components=1 -xf -
}

case "${1:-}" in
prepare)
  base=${CARGO_TARGET_DIR:-$PWD/target}
  cargo xtask kernels
  rm -rf "$dir"
  mkdir -p "$dir"
  # xz-compressed: the PTX and three cubins are ~13 MB, ~1.2 MB packed (a
  # device run carries at most 64 MiB); `run` unpacks them.
  tar -C kernels -cf - build | xz -T2 -6 >"$dir/kernels.tar.xz"
  # Baseline x86-64 in its own target directory (the workspace builds with
  # target-cpu=native; only this crate and its few dependencies are built).
  export CARGO_ENCODED_RUSTFLAGS="" CARGO_TARGET_DIR="$base/gpu-portable"
  test_bin=$(cargo test --release -p siliceo-kernels-turing --features cuda --test cuda \
    --no-run --message-format=json |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        print(m["executable"])')
  cargo build --release -p siliceo-kernels-turing --features cuda --example bench
  cp "$test_bin" "$dir/cuda-tests"
  cp "$CARGO_TARGET_DIR/release/examples/bench" "$dir/bench"
  strip "$dir/cuda-tests" "$dir/bench" 2>/dev/null || true
  du -sh "$dir"
  echo "prepared $dir/: device run with carry [\"$dir\"] and command: scripts/gpu_checks.sh run"
  ;;
run)
  [ -x "$dir/bench" ] || { echo "no $dir/bench: run 'scripts/gpu_checks.sh prepare' first" >&2; exit 2; }
  unpack_kernels
  out=${OUT:-$dir/out}
  mkdir -p "$out"
  export SILICEO_KERNELS_DIR="$PWD/$dir/kernels" SILICEO_REQUIRE_GPU=1
  { nvidia-smi || true; lscpu | head -20 || true; } >"$out/machine.txt" 2>&1
  status=0
  "$dir/cuda-tests" --test-threads=1 --nocapture 2>&1 | tee "$out/test-gpu.log" || status=1
  # Again from the compute_75 PTX alone (JIT-compiled by the driver), as on
  # an architecture without a cubin (the issue: the same PTX must load on
  # Ampere and Hopper).
  mkdir -p "$dir/ptx-only"
  cp "$dir"/kernels/*.ptx "$dir/ptx-only/"
  SILICEO_KERNELS_DIR="$PWD/$dir/ptx-only" "$dir/cuda-tests" --test-threads=1 --nocapture 2>&1 |
    tee "$out/test-gpu-ptx.log" || status=1
  # Partitions are in blocks of 64 tokens (the GPU caps them at 16: 1024 tokens).
  "$dir/bench" --gpu --mode decode --formats f16,kv8,k5v4 --ctx 4096,32768 --batch 1,8 \
    --partition 2,4,8,16 --reps 9 2>&1 | tee "$out/bench-gpu.log" || status=1
  # A 512-token prefill chunk's attention, alone and after 4k and 32k tokens:
  # the decode kernel a token at a time against the prefill kernel.
  "$dir/bench" --gpu --mode prefill --formats f16,kv8,k5v4 --ctx 0,4096,32768 --chunk 512 \
    --reps 5 2>&1 | tee -a "$out/bench-gpu.log" || status=1
  # The F16 kernel's loads-in-flight variants at 32k, so one run can pick
  # the best (the table above uses the default, 4; 2 for eight heads).
  "$dir/bench" --gpu --mode decode --formats f16 --ctx 32768 --batch 1,8 --partition 4,8 --loads 1,2,4,8 \
    --reps 9 2>&1 | tee -a "$out/bench-gpu.log" || status=1
  # The GPU's own checkers on the decode and append/seal tests (what the CPU
  # emulator cannot see: real out-of-bounds accesses, shared-memory races
  # between warps, barriers in divergent code). Capped: they slow kernels
  # down by orders of magnitude.
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)
  if [ -n "$sanitizer" ]; then
    for tool in memcheck racecheck synccheck; do
      echo "== compute-sanitizer --tool $tool" >>"$out/sanitizer.log"
      timeout 60 "$sanitizer" --tool "$tool" --error-exitcode 9 "$dir/cuda-tests" --test-threads=1 gpu_ 2>&1 |
        tail -30 >>"$out/sanitizer.log" || status=1
    done
  else
    echo "no compute-sanitizer on this machine" >"$out/sanitizer.log"
  fi
  # While the machine is held: the CPU kernel's thread scaling on its cores
  # (this project's own machines have 2), decode and 64-token prefill chunks,
  # against the bandwidth measured in the same run. Capped so the whole run
  # stays well inside one 10-minute device command (the rest: ~5 min at most).
  timeout 100 "$dir/bench" --formats f16,kv8,k5v4 --ctx 4096,32768 --mode decode,prefill \
    --threads 1,2,4,8,16 --reps 5 --naive-max-ctx 0 2>&1 | tee "$out/bench-cpu.log" || true
  exit $status
  ;;
unpack)
  unpack_kernels
  ;;
*)
  echo "usage: scripts/gpu_checks.sh prepare|run|unpack" >&2
  exit 2
  ;;
esac
