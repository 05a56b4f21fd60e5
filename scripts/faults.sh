#!/usr/bin/env bash
# The fault-injection suite at full size (FAULTS_SCALE=full): the real idem binary, real PostgreSQL and
# tansu, 20+ kill -9, broker and database cuts, a duplicate storm, consumer group churn. Prints one summary
# line per scenario: | scenario | operations | faults | duplicates | lost |. CI runs the reduced size as
# part of scripts/test.sh.
set -euo pipefail
source "$(dirname "$0")/env.sh"
export FAULTS_SCALE="${FAULTS_SCALE:-full}"
cargo build -p idem-app --quiet
echo "| scenario                                     | operations | faults | duplicates |  lost |"
cargo nextest run -p idem-tests --test faults --no-capture --no-fail-fast "$@" 2>&1 | tee .local/faults.log | grep -E "^\|"
