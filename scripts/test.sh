#!/usr/bin/env bash
# The test command: installs what the black-box tests drive (real PTYs via
# util-linux `script`; tmux, which tests/harness/terminal.rs drives `bmx attach` in), then runs every test
# in release mode (the tests spawn many real processes).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v script >/dev/null 2>&1 || need+=(util-linux)
command -v tmux >/dev/null 2>&1 || need+=(tmux)
command -v bash >/dev/null 2>&1 || need+=(bash)
command -v npm >/dev/null 2>&1 || need+=(nodejs npm)
# Issue 15: real `git clone` over HTTP (git http-backend) and a real
# `pip install --target` (tests/executor/git.rs, tests/executor/packages.rs).
command -v git >/dev/null 2>&1 || need+=(git)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3 python3-pip)
# schemathesis goes into a venv (below).
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
# Issue 20: computer use on a virtual display (tests/executor/computer.rs)
# drives a real Xvfb and a real xterm.
command -v Xvfb >/dev/null 2>&1 || need+=(xvfb)
command -v xterm >/dev/null 2>&1 || need+=(xterm)
# The VNC server of the display's RFB relay (tests/harness/rfb.rs, and
# the console's display page in noVNC, tests/harness/console_display.rs).
command -v x11vnc >/dev/null 2>&1 || need+=(x11vnc)
# Issue 16: the web console in a real browser (tests/harness/console.rs
# drives Debian's chromium through playwright-core, tests/peers).
command -v chromium >/dev/null 2>&1 || need+=(chromium)
# Issue 17: the test PostgreSQL's throwaway CA and certificates (scripts/pg.sh).
command -v openssl >/dev/null 2>&1 || need+=(openssl)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  fi
fi

# Real MCP servers (issue 11), pinned by tests/peers/package-lock.json.
# `npm ci` only when the lock changed since the last install: offline after.
if [ ! -f tests/peers/node_modules/.package-lock.json ] ||
   ! cmp -s tests/peers/package-lock.json tests/peers/node_modules/.bmx-installed-lock; then
  (cd tests/peers && npm ci --no-audit --no-fund --loglevel=error &&
    cp package-lock.json node_modules/.bmx-installed-lock)
fi

# schemathesis (issue 18), pinned, in a venv under target/: the security
# tests run it against the served OpenAPI document. Reinstalled only when
# the pin changes.
st_pin=4.32.5
if [ ! -x target/py/bin/st ] || ! grep -qx "$st_pin" target/py/.bmx-st 2>/dev/null; then
  python3 -m venv target/py
  target/py/bin/pip install --quiet --disable-pip-version-check "schemathesis==$st_pin"
  echo "$st_pin" > target/py/.bmx-st
fi

# Issue 17: a throwaway PostgreSQL for the PostgreSQL store's tests
# (BMX_TEST_PG), stopped on exit, failure included.
. scripts/pg.sh
pg_start

# Issue 48: sessions run in a sandbox that reads only the system's
# directories; the real MCP servers and ACP peers the tests drive are
# installed in the checkout, so the tests' executors may read them there
# (as an operator would pass --sandbox-read for a toolchain of theirs).
export BMX_SANDBOX_READ="$PWD/tests/peers"

cargo test --profile tests "$@"
