#!/usr/bin/env bash
# The whole test suite: starts the services it needs (scripts/services.sh, and scripts/docker.sh for a Docker
# engine and the local images), then
#   1. every test of the workspace against the local PostgreSQL and tansu (DATABASE_URL, KAFKA_BROKERS),
#      idem's image test included; extra arguments go to this run (cargo nextest);
#   2. the doc tests (the README's example is one);
#   3. the integration suite and the ledger's tests again, through testcontainers: no DATABASE_URL or
#      KAFKA_BROKERS, so the harness starts PostgreSQL and the broker in containers (IDEM_TEST_POSTGRES_IMAGE,
#      IDEM_TEST_KAFKA_IMAGE). IDEM_TEST_CONTAINERS=0 skips it.
set -euo pipefail
source "$(dirname "$0")/env.sh"
./scripts/docker.sh
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@"
  cargo test --doc --workspace --quiet
  if [ "${IDEM_TEST_CONTAINERS:-1}" != 0 ]; then
    echo "== the integration suite and the ledger's tests through testcontainers"
    env -u DATABASE_URL -u KAFKA_BROKERS cargo nextest run --workspace --no-fail-fast -E 'binary(it) | package(idem-ledger)'
  fi
else
  cargo test --workspace --no-fail-fast "$@"
fi
