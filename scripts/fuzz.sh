#!/usr/bin/env bash
# Long fuzz campaigns over `bmx::fuzz` with cargo-fuzz (nightly, libFuzzer).
#
#   scripts/fuzz.sh                     # every target, 10 million runs each
#   scripts/fuzz.sh 1000000 frame_json  # one target, a million runs
#
# The corpus of each target starts from fuzz/seeds/ and grows under
# fuzz/corpus/<target> (not committed); a crash lands in fuzz/artifacts/.
# Each target's libFuzzer statistics go to target/fuzz-<target>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10000000}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(frame_json frame_msgpack api_body terminal_frame scrollback ring tool_input)
fi
command -v cargo-fuzz >/dev/null 2>&1 || cargo +nightly install cargo-fuzz --locked
mkdir -p target
for t in "${targets[@]}"; do
  corpus=fuzz/corpus/$t
  mkdir -p "$corpus"
  case $t in
    frame_json | frame_msgpack) cp fuzz/seeds/frame/* "$corpus"/ ;;
    api_body) cp fuzz/seeds/api_body/* "$corpus"/ ;;
  esac
  # tool_input does real file I/O through a runtime per case: fewer runs.
  n=$runs
  [ "$t" = tool_input ] && n=$((runs / 20))
  echo "== $t: $n runs"
  (cd fuzz && cargo +nightly fuzz run --release "$t" "corpus/$t" -- \
      -runs="$n" -max_len=4096 -print_final_stats=1) >"target/fuzz-$t.log" 2>&1 || {
    tail -n 40 "target/fuzz-$t.log"
    echo "fuzz target $t FAILED (see target/fuzz-$t.log and fuzz/artifacts/$t)"
    exit 1
  }
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb|Done [0-9]+ runs" "target/fuzz-$t.log" || true
done
