#!/usr/bin/env bash
# Runs benchmarks against the local services and prints their figures.
#   scripts/bench.sh [--commit-bound] http|consumer|relay|cleanup|scale|peers|soak|phases|webhook ...
# --commit-bound runs them against a private PostgreSQL whose fsync takes FSYNC_DELAY (default 2ms; see
# scripts/slowdisk/start.sh). BENCH_CLIENTS="8 32 64 128" runs the HTTP benchmark once per concurrency.
# `scale` runs the HTTP benchmark's charges against idempotency_record prefilled to each of BENCH_SIZES
# rows (default "0 5000000 20000000"; BENCH_KEYS=v4 (default) or v7 for the clients' keys), with the pgbench
# ceiling on a table of the same size. `peers` installs the peers from their registries into .local/peers/
# (axum-idempotent from crates.io, built from peers/axum-idempotent; pg-transactional-outbox and kafkajs from
# npm, with Debian's nodejs when node is missing) and runs tests/benches/peers.rs. `soak` runs one service for
# BENCH_SOAK_MINUTES (30) at a steady rate with its RSS sampled. Other settings are environment variables documented at the top of
# each tests/benches/*.rs.
# `failover` runs the failover harness at length (tests/tests/deploy/failover.rs, release idem): every fault
# FAILOVER_ROUNDS times (default 3) on the synchronous Patroni cluster, then the asynchronous control run
# with partition-primary and kill-primary FAILOVER_ROUNDS times; it prints the history checker's figures.
set -euo pipefail
# tansu keeps every topic in memory: after a test run it holds hundreds, and its CPU per message was 3x
# higher than on an empty broker (BENCHMARKS.md). Benchmarks start from an empty one (BENCH_KEEP_BROKER=1
# keeps the running broker).
if [ "${BENCH_KEEP_BROKER:-0}" != 1 ]; then "$(dirname "$0")/services.sh" stop >/dev/null 2>&1 || true; fi
source "$(dirname "$0")/env.sh"
command -v pgbench >/dev/null || sudo_apt=1
if [ "${sudo_apt:-0}" = 1 ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql-client >/dev/null; fi
# Databases left by a test run (the suite drops them only after 30 minutes) keep autovacuum busy on the
# cores the benchmarks measure: drop them. Never run the benchmarks while tests run.
for db in $(psql -At "$DATABASE_URL" -c "SELECT datname FROM pg_database WHERE datname LIKE 'idem\\_test\\_%'"); do
  psql -q "$DATABASE_URL" -c "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)"
done
if [ "${1:-}" = "--commit-bound" ]; then
  shift
  DATABASE_URL=$("$root/scripts/slowdisk/start.sh")
  export DATABASE_URL
  trap '"$root/scripts/slowdisk/start.sh" stop' EXIT
fi
cargo build --release -p idem-app --quiet
export IDEM_BIN="$root/target/release/idem"
for bench in "${@:-http}"; do
  if [ "$bench" = scale ]; then
    for size in ${BENCH_SIZES:-0 5000000 20000000}; do
      BENCH_PREFILL_ROWS=$size BENCH_KEYS=${BENCH_KEYS:-v4} BENCH_PHASES=${BENCH_PHASES:-on} \
        cargo bench -p idem-tests --bench http --quiet
    done
  elif [ "$bench" = peers ]; then
    command -v node >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q nodejs npm >/dev/null
    cargo build --release --quiet --manifest-path "$root/peers/axum-idempotent/Cargo.toml" \
      --target-dir "$root/.local/peers/target"
    mkdir -p "$root/.local/peers/outbox"
    cp "$root"/peers/pg-transactional-outbox/{package.json,package-lock.json,bench.cjs} "$root/.local/peers/outbox/"
    (cd "$root/.local/peers/outbox" && npm ci --no-audit --no-fund --silent)
    cargo bench -p idem-tests --bench peers --quiet
  elif [ "$bench" = failover ]; then
    FAILOVER_ROUNDS=${FAILOVER_ROUNDS:-3} FAILOVER_CONTROL_FAULTS=${FAILOVER_CONTROL_FAULTS:-partition-primary,kill-primary} \
      cargo nextest run -p idem-tests --test deploy --no-capture --no-fail-fast \
      -E 'test(a_synchronous_cluster_through_every_fault) | test(the_asynchronous_control_run)' 2>&1 |
      grep -v '^ *\(PASS\|START\|SLOW\)' | grep -v 'WARN\|INFO'
  elif [ "$bench" = http ]; then
    for clients in ${BENCH_CLIENTS:-${BENCH_CONCURRENCY:-8}}; do
      BENCH_CONCURRENCY=$clients cargo bench -p idem-tests --bench http --quiet
    done
  else
    cargo bench -p idem-tests --bench "$bench" --quiet
  fi
done
