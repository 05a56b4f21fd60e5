#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the service: installs and starts PostgreSQL and the tansu
# broker (scripts/services.sh), builds idem, applies migrations and serves on HTTP_ADDR until Ctrl-C.
set -euo pipefail
source "$(dirname "$0")/env.sh"
# A local-only demo key; set IDEM_API_KEYS for anything else.
export IDEM_API_KEYS="${IDEM_API_KEYS:-demo:demo_key_0123456789}"
cargo build --release -p idem-app
exec ./target/release/idem serve "$@"
