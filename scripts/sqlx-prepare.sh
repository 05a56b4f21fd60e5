#!/usr/bin/env bash
# Regenerates adapters-postgres/.sqlx (the offline data of sqlx's compile-time-checked queries) against a
# scratch database migrated from migrations/. Run after changing a query or a migration.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
admin=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
db=idem_sqlx_prepare
psql "$admin" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db"
url="${admin%/*}/$db"
for m in "$root"/migrations/*.sql; do psql "$url" -q -v ON_ERROR_STOP=1 -f "$m"; done
rm -rf "$root/adapters-postgres/.sqlx" && mkdir -p "$root/adapters-postgres/.sqlx"
touch "$root"/adapters-postgres/src/*.rs
SQLX_OFFLINE=false DATABASE_URL="$url" SQLX_OFFLINE_DIR="$root/adapters-postgres/.sqlx" \
  cargo check -p idem-postgres --quiet
psql "$admin" -qc "DROP DATABASE $db WITH (FORCE)"
echo "wrote $(ls "$root/adapters-postgres/.sqlx" | wc -l) query files to adapters-postgres/.sqlx"
