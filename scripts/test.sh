#!/usr/bin/env bash
# The test command: installs what the black-box tests drive (real PTYs via
# util-linux `script`; tmux, which tests/harness_terminal.rs drives `bmx attach` in), then runs every test
# in release mode (the tests spawn many real processes).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v script >/dev/null 2>&1 || need+=(util-linux)
command -v tmux >/dev/null 2>&1 || need+=(tmux)
command -v bash >/dev/null 2>&1 || need+=(bash)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  fi
fi

cargo test --release "$@"
