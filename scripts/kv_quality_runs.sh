#!/usr/bin/env bash
# Reproduces docs/kv-quality/*.json (docs/KV_QUALITY.md): every table's command.
#   scripts/kv_quality_runs.sh [OUT_DIR]   (default docs/kv-quality)
#   ONLY=qwen scripts/kv_quality_runs.sh    (only the tables whose file name contains "qwen")
# Texts: prose = GPL-3 + GFDL-1.3 from Debian's base-files; code = five CPython
# 3.11.7 modules (see docs/KV_QUALITY.md). Build first: cargo build --release -p siliceo
set -euo pipefail
out=${1:-docs/kv-quality}
bin=${CARGO_TARGET_DIR:-target}/release/siliceo
tmp=$(mktemp -d)
cat /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/GFDL-1.3 >"$tmp/prose.txt"
py=$(python3 -c "import os, textwrap; print(os.path.dirname(textwrap.__file__))")
cat "$py"/{textwrap,heapq,bisect,shlex,fractions}.py >"$tmp/code.txt"
common="floor,f16,q8_0/q8_0,q5_1/q4_0,q5_1/q4_1,ours:f16,ours:kv8,ours:k5v4,ours:k5v4+rot,ours:k5v4+tail64,ours:k5v4+rot+tail64,ours:k5:kv8"
only=${ONLY:-}
run() { # model tag text window windows configs [extra flags and file suffix]
  [[ -z $only || "$2-$3-$4${8:-}" == *"$only"* ]] || return 0
  echo "== $2 $3 $4 ${8:-}" >&2
  "$bin" eval-kv -m "$1" --text "$tmp/$3.txt" --window "$4" --max-windows "$5" --configs "$6" --json ${7:-} \
    >"$out/$2-$3-$4${8:-}.json"
}
smol=models/SmolLM2-135M-Instruct.Q4_1.gguf
qwen=models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
for text in prose code; do
  run $smol SmolLM2-135M-Instruct.Q4_1 $text 512 8 "$common,q4_0/q4_0"
  run $smol SmolLM2-135M-Instruct.Q4_1 $text 2048 2 "$common,q4_0/q4_0"
  run $qwen qwen2.5-coder-1.5b-instruct-q4_k_m $text 512 2 "$common,q8_0/q4_0"
  run $qwen qwen2.5-coder-1.5b-instruct-q4_k_m $text 2048 1 "$common,q8_0/q4_0"
done
# Ours as a chunked prefill sees them (each 64-token block quantized before its
# own queries attend, like llama.cpp's caches), instead of as decoding sees them.
ours="ours:kv8,ours:k5v4,ours:k5v4+rot,ours:k5v4+tail64,q5_1/q4_0"
run $smol SmolLM2-135M-Instruct.Q4_1 prose 512 8 "$ours" "--shadow-chunk 0" -prefill-chunks
run $qwen qwen2.5-coder-1.5b-instruct-q4_k_m code 512 2 "$ours" "--shadow-chunk 0" -prefill-chunks
