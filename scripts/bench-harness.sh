#!/usr/bin/env bash
# `bmx bench harness` against both stores (issue 17, docs/benchmarks.md):
# the embedded SQLite default, then PostgreSQL, a throwaway cluster started
# here with fsync on (as a production database runs) on a private port and
# data dir, stopped at the end; then two replicas over that PostgreSQL,
# sharing the server's core. Extra arguments go to every run, e.g.
#   scripts/bench-harness.sh --executors 1000,10000 --json
set -euo pipefail
cd "$(dirname "$0")/.."
bmx=target/release/bmx
[ -x "$bmx" ] || cargo build --release --bin bmx
echo "== embedded SQLite"
"$bmx" bench harness "$@"
# shellcheck source=scripts/pg.sh
. scripts/pg.sh
BMX_PG_FSYNC=on BMX_PG_PORT=${BMX_PG_PORT:-25442} pg_start
if [ -z "${BMX_TEST_PG:-}" ]; then
  echo "no PostgreSQL: the PostgreSQL rows are not measured" >&2
  exit 1
fi
echo "== PostgreSQL (fsync on)"
"$bmx" bench harness --no-baseline --harness-arg=--store --harness-arg="$BMX_TEST_PG" "$@"
echo "== two replicas over PostgreSQL (fsync on), one core"
"$bmx" bench harness --no-baseline --replicas 2 --harness-arg=--store --harness-arg="$BMX_TEST_PG" "$@"
