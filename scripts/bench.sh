#!/usr/bin/env bash
# Runs a benchmark against the local services and prints its figures.
#   scripts/bench.sh http      HTTP charges: layer on/off, replays, pgbench ceiling
# Settings are environment variables documented at the top of each tests/benches/*.rs.
set -euo pipefail
source "$(dirname "$0")/env.sh"
command -v pgbench >/dev/null || sudo_apt=1
if [ "${sudo_apt:-0}" = 1 ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql-client >/dev/null; fi
cargo build --release -p idem-app --quiet
export IDEM_BIN="$root/target/release/idem"
for bench in "${@:-http}"; do
  cargo bench -p idem-tests --bench "$bench" --quiet
done
