#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the service: installs and starts PostgreSQL and the tansu
# broker (scripts/services.sh), builds idem, applies migrations and serves on HTTP_ADDR until Ctrl-C.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
./scripts/services.sh start
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
export KAFKA_BROKERS="${KAFKA_BROKERS:-127.0.0.1:9092}"
# A local-only demo key; set IDEM_API_KEYS for anything else.
export IDEM_API_KEYS="${IDEM_API_KEYS:-demo:demo_key_0123456789}"
cargo build --release -p idem-app
exec ./target/release/idem serve "$@"
