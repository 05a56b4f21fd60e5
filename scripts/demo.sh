#!/usr/bin/env bash
# Starts the services and idem (in the background), runs `idem demo` against it, prints the table, stops idem.
set -euo pipefail
source "$(dirname "$0")/env.sh"
export IDEM_API_KEYS="${IDEM_API_KEYS:-demo:demo_key_0123456789}"
export HTTP_ADDR="${HTTP_ADDR:-127.0.0.1:8080}"
cargo build --release -p idem-app --quiet
./target/release/idem serve >.local/demo-serve.log 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do curl -sf "http://$HTTP_ADDR/healthz" >/dev/null && break; sleep 0.2; done
IDEM_URL="http://$HTTP_ADDR" IDEM_API_KEY="${IDEM_API_KEYS#*:}" ./target/release/idem demo
