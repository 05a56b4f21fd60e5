#!/usr/bin/env bash
# The whole test suite: starts the services it needs (scripts/services.sh), then runs every test of the
# workspace against real PostgreSQL and the tansu broker. Extra arguments go to cargo nextest.
set -euo pipefail
source "$(dirname "$0")/env.sh"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@"
  cargo test --doc --workspace --quiet # nextest does not run doc tests (the README's example is one)
else
  cargo test --workspace --no-fail-fast "$@"
fi
