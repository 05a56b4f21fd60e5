#!/usr/bin/env bash
# Builds and tests examples/inventory (a service on the facade crate `idem`, its tests on `idem::testing`)
# the way a stranger's crate builds: from a directory outside this workspace (so .cargo/config.toml does not
# apply), with a DATABASE_URL in the environment that points at a database without idem's tables (so sqlx's
# macros, if they asked it, would fail). The tests create their own databases on that server and use the
# broker of KAFKA_BROKERS. The workspace's Cargo.lock pins the same versions, and the shared target
# directory reuses its builds.
set -euo pipefail
source "$(dirname "$0")/env.sh"
root=$(cd "$(dirname "$0")/.." && pwd)
admin=$DATABASE_URL
db=idem_outside_build
psql "$admin" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db"
dir=$(mktemp -d /tmp/idem-outside.XXXXXX)
trap 'rm -rf "$dir"' EXIT
cp -r "$root/examples/inventory/." "$dir/"
sed -i "s#path = \"../../idem\"#path = \"$root/idem\"#" "$dir/Cargo.toml"
cp "$root/Cargo.lock" "$dir/Cargo.lock"
(cd "$dir" && env -u SQLX_OFFLINE DATABASE_URL="${admin%/*}/$db" CARGO_TARGET_DIR="$root/target" cargo build --quiet)
(cd "$dir" && env -u SQLX_OFFLINE DATABASE_URL="${admin%/*}/$db" CARGO_TARGET_DIR="$root/target" cargo test --quiet)
psql "$admin" -qc "DROP DATABASE $db WITH (FORCE)"
echo "built and tested examples/inventory outside the workspace with DATABASE_URL set to a database without idem's tables"
