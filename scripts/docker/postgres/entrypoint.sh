#!/bin/sh
# A throwaway test server: trust authentication, durability off, on PGPORT (5432) and PGLISTEN (127.0.0.1:
# the containers share the host's network).
set -e
port="${PGPORT:-5432}"
data=/var/lib/postgresql/test-data
bin=/usr/lib/postgresql/15/bin
if [ ! -s "$data/PG_VERSION" ]; then
  mkdir -p "$data" && chown postgres:postgres "$data"
  runuser -u postgres -- "$bin/initdb" -D "$data" -U postgres --auth=trust >/dev/null
fi
mkdir -p /var/run/postgresql && chown postgres:postgres /var/run/postgresql
exec runuser -u postgres -- "$bin/postgres" -D "$data" -p "$port" -c listen_addresses="${PGLISTEN:-127.0.0.1}" \
  -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300
