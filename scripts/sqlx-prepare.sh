#!/usr/bin/env bash
# Regenerates adapters-postgres/.sqlx (the offline data of sqlx's compile-time-checked queries) against a
# scratch database migrated from migrations/. Run after changing a query or a migration.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
admin=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
db=idem_sqlx_prepare
psql "$admin" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db"
url="${admin%/*}/$db"
for m in "$root"/migrations/*.sql "$root"/adapters-postgres/migrations/*.sql "$root"/ledger/migrations/*.sql; do psql "$url" -q -v ON_ERROR_STOP=1 -f "$m"; done
for crate in adapters-postgres:idem-postgres ledger:idem-ledger; do
  dir=${crate%%:*} package=${crate##*:}
  rm -rf "$root/$dir/.sqlx" && mkdir -p "$root/$dir/.sqlx"
  touch "$root/$dir"/src/*.rs
  SQLX_OFFLINE=false DATABASE_URL="$url" SQLX_OFFLINE_DIR="$root/$dir/.sqlx" cargo check -p "$package" --quiet
done
# checking the ledger recompiled idem-postgres into the ledger's directory: keep only the ledger's queries
for f in "$root"/ledger/.sqlx/*; do [ -e "$root/adapters-postgres/.sqlx/$(basename "$f")" ] && rm "$f"; done
psql "$admin" -qc "DROP DATABASE $db WITH (FORCE)"
echo "wrote $(ls "$root/adapters-postgres/.sqlx" | wc -l) + $(ls "$root/ledger/.sqlx" | wc -l) query files to adapters-postgres/.sqlx and ledger/.sqlx"
