#!/usr/bin/env bash
# Measures a cold CI run of this checkout's HEAD: a fresh clone with an empty
# HOME (cargo registry, target directory, ccache, pip cache, nvcc wheels, no
# models), the same toolchain, then `.ci/run`. Usage: scripts/cold_ci.sh [DIR]
# (default /tmp/cold; DIR is deleted first). The log ends with the phase
# times and the total.
set -u
repo="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-/tmp/cold}"
rustup_home="${RUSTUP_HOME:-$HOME/.rustup}"
cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"
rm -rf "$dir" && mkdir -p "$dir/home"
git clone -q "$repo" "$dir/src"
cd "$dir/src" || exit 1
export HOME="$dir/home" CARGO_HOME="$dir/home/.cargo" RUSTUP_HOME="$rustup_home"
export PATH="$cargo_bin:$PATH"
unset CARGO_TARGET_DIR
start=$(date +%s)
.ci/run > "$dir/log" 2>&1
rc=$?
echo "rc=$rc elapsed=$(( $(date +%s) - start ))s" >> "$dir/log"
tail -14 "$dir/log"
exit $rc
