#!/usr/bin/env bash
# Starts (or restarts) a private PostgreSQL cluster whose fsync/fdatasync take FSYNC_DELAY (default 2ms):
# a commit-bound disk, emulated with an LD_PRELOAD shim (slowfsync.c) and wal_sync_method=fdatasync.
# Prints the cluster's URL on stdout; pg_test_fsync under the same shim confirms the delay (stderr).
#   scripts/slowdisk/start.sh [stop]
# Settings: FSYNC_DELAY (2ms; a number with us or ms), SLOWDISK_PORT (5433), SLOWDISK_OPTS (more server
# options, e.g. "-c shared_preload_libraries=pg_stat_statements" to see where a benchmark's SQL time goes).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
state="$root/.local/slowdisk"
port="${SLOWDISK_PORT:-5433}"
bindir=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n1)
log() { printf '[slowdisk] %s\n' "$*" >&2; }
as_pg() { if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

delay="${FSYNC_DELAY:-2ms}"
case "$delay" in
  *us) us=${delay%us} ;;
  *ms) us=$(( ${delay%ms} * 1000 )) ;;
  *) log "FSYNC_DELAY: write 2ms or 500us"; exit 2 ;;
esac

if [ -f "$state/data/postmaster.pid" ]; then as_pg "$bindir/pg_ctl" -D "$state/data" -m fast stop >/dev/null || true; fi
[ "${1:-}" = stop ] && exit 0

mkdir -p "$state"
command -v gcc >/dev/null || { log "gcc is needed to build the shim"; exit 1; }
gcc -O2 -shared -fPIC -o "$state/slowfsync.so" "$root/scripts/slowdisk/slowfsync.c" -ldl
chmod 755 "$state/slowfsync.so"; if [ "$(id -u)" -eq 0 ]; then chown postgres "$state"; fi
if [ ! -d "$state/data" ]; then
  mkdir -p "$state/data" && chown postgres "$state/data" 2>/dev/null || true
  as_pg "$bindir/initdb" -D "$state/data" --auth=trust -U postgres >/dev/null
fi
log "pg_test_fsync with the shim (${us} us per flush):"
(cd /tmp && as_pg env LD_PRELOAD="$state/slowfsync.so" IDEM_FSYNC_DELAY_US="$us" "$bindir/pg_test_fsync" -s 1 -f "$state/fsync.probe" 2>&1 | grep -m1 -E "^\s+fdatasync" >&2) || true
as_pg env LD_PRELOAD="$state/slowfsync.so" IDEM_FSYNC_DELAY_US="$us" "$bindir/pg_ctl" -D "$state/data" -l "$state/postgres.log" -w start \
  -o "-p $port -c listen_addresses=127.0.0.1 -c unix_socket_directories=/tmp -c wal_sync_method=fdatasync -c max_connections=400 -c shared_buffers=512MB -c synchronous_commit=on -c fsync=on ${SLOWDISK_OPTS:-}" >/dev/null
log "commit-bound PostgreSQL on 127.0.0.1:$port (fsync +${us} us)"
echo "postgres://postgres@127.0.0.1:$port/postgres"
