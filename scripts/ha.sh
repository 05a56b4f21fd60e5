#!/usr/bin/env bash
# A PostgreSQL 15 cluster for failover tests, from Debian's packages: etcd, three nodes under Patroni with
# synchronous replication (synchronous_mode and synchronous_mode_strict on, maximum_lag_on_failover 0), and
# HAProxy routing a read-write port to the current primary by Patroni's REST health check. Everything
# listens on loopback only; state lives under .local/ha/ (HA_DIR).
#
#   scripts/ha.sh up            installs what is missing, starts the cluster, prints DATABASE_URL=… (through
#                               HAProxy) and DATABASE_MULTIHOST_URL=… (the three nodes, read-write)
#   scripts/ha.sh status        {"primary": NAME, "members": [{"name", "role", "state", "host", "port"}]}
#   scripts/ha.sh kill-primary  SIGKILL of the primary node: its Patroni and its postmaster (a machine that
#                               died; the postmaster alone would be restarted in place by its Patroni)
#   scripts/ha.sh isolate-primary    black-holes the primary (no RST, no FIN) from clients and peers alike
#   scripts/ha.sh partition-primary  cuts the primary from its peers and etcd; clients still reach it
#   scripts/ha.sh heal          lifts every cut and starts every node that is down (it rejoins as a replica)
#   scripts/ha.sh async|sync    synchronous mode off / on (for the control run; async also lets a lagging
#                               standby be promoted, as a cluster without synchronous replication does)
#   scripts/ha.sh down          stops everything and removes the state
#
# As root, each node runs in a network namespace of its own, on a bridge in one more namespace the script
# creates; the host reaches them as 10.X.0.1 (X from HA_BASE_PORT), where etcd and HAProxy listen, and cuts
# are nftables rules that drop packets inside the node's namespace. Without root (HA_NETNS=0) every node
# listens on loopback and the cuts are not available.
#
# Nothing is open without a password, each generated for the cluster at its first `up` and kept in
# $HA_DIR/secrets (mode 0600; printed only inside the two URLs): PostgreSQL takes SCRAM only
# (password_encryption scram-sha-256, no `trust` in pg_hba) for the superuser `postgres` and the replication
# user `replicator`; Patroni's REST API wants Basic auth for every unsafe method (POST, PATCH, PUT, DELETE:
# restart, switchover, config…), while its GET/OPTIONS health checks, which HAProxy polls, stay open; etcd
# has authentication enabled, with a `root` user and a `patroni` user that may only read and write Patroni's
# /service/ prefix. The node files n*.yml and ctl.yml hold passwords too and are 0600, owned by their reader.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dir=${HA_DIR:-$root/.local/ha}
base_port=${HA_BASE_PORT:-21500}
etcd_client=$((base_port)) etcd_peer=$((base_port + 1)) haproxy_port=$((base_port + 2))
pg_port() { echo $((base_port + 10 + $1)); }
api_port() { echo $((base_port + 20 + $1)); }
nodes=(1 2 3)
netns=${HA_NETNS:-$([ "$(id -u)" -eq 0 ] && echo 1 || echo 0)}
net="10.$((100 + (base_port / 100) % 150))"
ns_of() { echo "idemha${base_port}-n$1"; }
switch_ns="idemha${base_port}-sw"
host_if="ih${base_port}"
# where a node listens, and where the host side (clients, etcd, HAProxy) is
node_ip() { if [ "$netns" = 1 ]; then echo "$net.0.1$1"; else echo 127.0.0.1; fi; }
host_ip() { if [ "$netns" = 1 ]; then echo "$net.0.1"; else echo 127.0.0.1; fi; }
in_node() { local n=$1; shift; if [ "$netns" = 1 ]; then ip netns exec "$(ns_of "$n")" "$@"; else "$@"; fi; }
# one DCS scope per state directory: a cluster never meets another's keys in a shared or leftover etcd
scope="idem-ha-$(printf '%s' "$dir" | md5sum | cut -c1-12)"

log() { printf '[ha] %s\n' "$*" >&2; }
secrets="$dir/secrets"
# The cluster's passwords (32 hex digits each, safe in a URL), made once and kept with its state.
load_secrets() {
  if [ ! -s "$secrets" ]; then
    [ "${1:-}" = create ] || { log "no $secrets: run \`$0 up\` first"; exit 1; }
    local k
    (
      umask 077
      for k in SUPERUSER REPLICATION RESTAPI ETCD_ROOT ETCD_PATRONI; do
        echo "${k}_PASSWORD=$(openssl rand -hex 16)"
      done >"$secrets.new"
    )
    mv "$secrets.new" "$secrets"
  fi
  chmod 600 "$secrets"
  # shellcheck disable=SC1090
  . "$secrets"
}
# A file only `owner` (postgres for what Patroni reads) may read: written from stdin.
write_private() {
  local file=$1 owner=${2:-}
  (umask 077; cat >"$file.new")
  [ -n "$owner" ] && [ "$(id -u)" -eq 0 ] && chown "$owner:$owner" "$file.new"
  mv "$file.new" "$file"
}
as_postgres() { if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
bindir() { ls -d /usr/lib/postgresql/15/bin 2>/dev/null || ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n1; }

install() {
  local missing=()
  for p in patroni etcd-server etcd-client haproxy postgresql-15 postgresql-client-15 curl nftables iproute2 openssl; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return
  log "installing ${missing[*]}"
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
    sudo_if_needed apt-get update -q >/dev/null
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  }
}

# A cluster whose script was killed before `down` (its test process ended abruptly) leaves etcd, HAProxy,
# Patroni and PostgreSQL running on this port range: they are ended first. Only processes of ha.sh clusters
# (their command lines name an `ha` state directory) are touched.
reclaim_ports() {
  local port pid cmd
  for port in $(seq "$base_port" $((base_port + 23))); do
    for pid in $(ss -ltnpH "sport = :$port" 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u); do
      cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null || true)
      case "$cmd" in
        *"$dir/"*) ;;                                   # this cluster's own
        *etcd\ --name\ ha*|*haproxy*/ha/haproxy.cfg*|*patroni*/ha/n*|*postgres*/ha/n*/data*|*postgres*idem-ha*)
          log "ending a leftover cluster's process on port $port: $cmd"
          kill -9 "$pid" 2>/dev/null || true ;;
      esac
    done
  done
  # their Patroni processes hold no port of this range (the REST API does): end those whose state is gone
  for pid in $(pgrep -f "bin/patroni .*/ha/n[0-9].yml" || true); do
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null || true)
    yml=${cmd% }; yml=${yml##* }
    [ -e "$yml" ] || { log "ending a leftover Patroni: $cmd"; kill -9 "$pid" 2>/dev/null || true; }
  done
  sleep 0.3
}

# The namespaces: a bridge in the switch namespace, one veth from the host and one from each node to it.
# A leftover set of this port range (a killed test) is removed first, with whatever runs inside.
net_down() {
  [ "$netns" = 1 ] || return 0
  local ns pid
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^idemha${base_port}-" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  ip link del "$host_if" 2>/dev/null || true
}

net_up() {
  [ "$netns" = 1 ] || return 0
  net_down
  ip netns add "$switch_ns"
  ip netns exec "$switch_ns" ip link add br0 type bridge
  ip netns exec "$switch_ns" ip link set br0 up
  ip link add "$host_if" type veth peer name up0 netns "$switch_ns"
  ip netns exec "$switch_ns" ip link set up0 master br0 up
  ip addr add "$(host_ip)/24" dev "$host_if"
  ip link set "$host_if" up
  local n ns
  for n in "${nodes[@]}"; do
    ns=$(ns_of "$n")
    ip netns add "$ns"
    ip link add "${host_if}n$n" type veth peer name eth0 netns "$ns"
    ip link set "${host_if}n$n" netns "$switch_ns"
    ip netns exec "$switch_ns" ip link set "${host_if}n$n" master br0 up
    ip netns exec "$ns" ip addr add "$(node_ip "$n")/24" dev eth0
    ip netns exec "$ns" ip link set eth0 up
    ip netns exec "$ns" ip link set lo up
  done
}

# Drops, inside node n's namespace, every packet to and from `what`: "all" (isolation) or "peers" (the
# other nodes and etcd; the host's clients and HAProxy still get through).
cut_node() {
  local n=$1 what=$2 rules peers="" m
  [ "$netns" = 1 ] || { log "cuts need network namespaces (run as root)"; exit 1; }
  if [ "$what" = all ]; then
    rules="add rule inet cut in iifname eth0 drop
add rule inet cut out oifname eth0 drop"
  else
    for m in "${nodes[@]}"; do [ "$m" = "$n" ] || peers="$peers${peers:+, }$(node_ip "$m")"; done
    rules="add rule inet cut in ip saddr { $peers } drop
add rule inet cut out ip daddr { $peers } drop
add rule inet cut in ip saddr $(host_ip) tcp sport { $etcd_client, $etcd_peer } drop
add rule inet cut out ip daddr $(host_ip) tcp dport { $etcd_client, $etcd_peer } drop"
  fi
  in_node "$n" nft -f - <<EOF
table inet cut
delete table inet cut
table inet cut {
  chain in { type filter hook input priority 0; policy accept; }
  chain out { type filter hook output priority 0; policy accept; }
}
$rules
EOF
}

uncut_all() {
  [ "$netns" = 1 ] || return 0
  local n
  for n in "${nodes[@]}"; do in_node "$n" nft delete table inet cut 2>/dev/null || true; done
}

start_etcd() {
  [ -f "$dir/etcd.pid" ] && kill -0 "$(cat "$dir/etcd.pid")" 2>/dev/null && return
  mkdir -p "$dir/etcd"
  setsid nohup etcd --name ha --data-dir "$dir/etcd" \
    --listen-client-urls "http://$(host_ip):$etcd_client$([ "$netns" = 1 ] && echo ",http://127.0.0.1:$etcd_client")" \
    --advertise-client-urls "http://$(host_ip):$etcd_client" \
    --listen-peer-urls "http://$(host_ip):$etcd_peer" --initial-advertise-peer-urls "http://$(host_ip):$etcd_peer" \
    --initial-cluster "ha=http://$(host_ip):$etcd_peer" --enable-v2=false >"$dir/etcd.log" 2>&1 &
  echo $! >"$dir/etcd.pid"
  for _ in $(seq 1 100); do port_open "$etcd_client" && return; sleep 0.1; done
  log "etcd did not start (see $dir/etcd.log)"; exit 1
}

etcdctl_() { ETCDCTL_API=3 etcdctl --endpoints "http://127.0.0.1:$etcd_client" "$@"; }
# etcdctl as root (the credentials in its environment, not on its command line)
etcdctl_root() { ETCDCTL_USER="root:$ETCD_ROOT_PASSWORD" etcdctl_ "$@"; }
# Runs an etcdctl step of the set-up, which may have been done already by an `up` that stopped half-way.
etcd_step() {
  local out
  out=$("$@" 2>&1) && return 0
  case "$out" in *"already exists"* | *"already granted"* | *"already enabled"*) return 0 ;; esac
  log "etcd: $out"; return 1
}

# A new etcd answers anyone: give it a root user and one for Patroni (read-write on its /service/ prefix
# only), then turn authentication on. One that already refuses anonymous requests must take root's password.
etcd_auth() {
  local state=""
  for _ in $(seq 1 100); do
    if etcdctl_ get --limit 1 /service/ >/dev/null 2>&1; then state=open; break; fi
    if etcdctl_root get --limit 1 /service/ >/dev/null 2>&1; then state=closed; break; fi
    sleep 0.1
  done
  case "$state" in
    closed) return 0 ;;
    "") log "etcd refuses root's password or does not answer (see $dir/etcd.log)"; exit 1 ;;
  esac
  printf '%s\n' "$ETCD_ROOT_PASSWORD" | etcd_step etcdctl_ user add root --interactive=false
  etcd_step etcdctl_ user grant-role root root
  etcd_step etcdctl_ role add patroni
  etcd_step etcdctl_ role grant-permission patroni --prefix=true readwrite /service/
  printf '%s\n' "$ETCD_PATRONI_PASSWORD" | etcd_step etcdctl_ user add patroni --interactive=false
  etcd_step etcdctl_ user grant-role patroni patroni
  etcd_step etcdctl_ auth enable
  etcdctl_ get --limit 1 /service/ >/dev/null 2>&1 && { log "etcd still answers without a password"; exit 1; }
  return 0
}

node_config() {
  local n=$1
  write_private "$dir/n$n.yml" postgres <<EOF
scope: $scope
name: n$n
restapi:
  listen: $(node_ip "$n"):$(api_port "$n")
  connect_address: $(node_ip "$n"):$(api_port "$n")
  authentication:
    username: patroni
    password: $RESTAPI_PASSWORD
etcd3:
  hosts: $(host_ip):$etcd_client
  username: patroni
  password: $ETCD_PATRONI_PASSWORD
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 1
    retry_timeout: 4
    maximum_lag_on_failover: 0
    synchronous_mode: true
    synchronous_mode_strict: true
    postgresql:
      use_pg_rewind: true
      parameters:
        synchronous_commit: "on"
        wal_log_hints: "on"
        max_connections: 100
        shared_buffers: 32MB
        fsync: "off"
        password_encryption: scram-sha-256
  initdb:
    - encoding: UTF8
    - auth-local: scram-sha-256
    - auth-host: scram-sha-256
postgresql:
  listen: $(node_ip "$n"):$(pg_port "$n")
  connect_address: $(node_ip "$n"):$(pg_port "$n")
  data_dir: $dir/n$n/data
  bin_dir: $(bindir)
  pgpass: $dir/n$n/pgpass
  # the whole of pg_hba.conf, on every node: passwords (SCRAM) only
  pg_hba:
    - local all all scram-sha-256
    - host all all 127.0.0.1/32 scram-sha-256
    - host replication replicator 127.0.0.1/32 scram-sha-256
    - host all all $net.0.0/24 scram-sha-256
    - host replication replicator $net.0.0/24 scram-sha-256
  # pg_rewind uses the superuser
  authentication:
    superuser:
      username: postgres
      password: $SUPERUSER_PASSWORD
    replication:
      username: replicator
      password: $REPLICATION_PASSWORD
  parameters:
    unix_socket_directories: $dir/n$n
    password_encryption: scram-sha-256
tags:
  nofailover: false
  noloadbalance: false
EOF
}

# Patroni's own process (`…/bin/patroni FILE`), not the runuser wrapper around it.
node_pid() { pgrep -f "bin/patroni $dir/n$1.yml" | head -n1; }

start_node() {
  local n=$1
  [ -n "$(node_pid "$n")" ] && return
  mkdir -p "$dir/n$n"
  chmod 700 "$dir/n$n"
  [ "$(id -u)" -eq 0 ] && chown -R postgres:postgres "$dir/n$n" "$dir/n$n.yml"
  # a session of its own: nothing sent to the caller's process group reaches it
  if [ "$netns" = 1 ]; then
    ip netns exec "$(ns_of "$n")" runuser -u postgres -- setsid nohup patroni "$dir/n$n.yml" >>"$dir/n$n.log" 2>&1 &
  else
    as_postgres setsid nohup patroni "$dir/n$n.yml" >>"$dir/n$n.log" 2>&1 &
  fi
}

start_haproxy() {
  [ -f "$dir/haproxy.pid" ] && kill -0 "$(cat "$dir/haproxy.pid")" 2>/dev/null && return
  {
    echo "global"
    echo "  maxconn 200"
    echo "defaults"
    echo "  mode tcp"
    echo "  timeout connect 2s"
    echo "  timeout client 30m"
    echo "  timeout server 30m"
    echo "  timeout check 1s"
    echo "listen primary"
    echo "  bind 127.0.0.1:$haproxy_port"
    echo "  option httpchk OPTIONS /primary"
    echo "  http-check expect status 200"
    echo "  default-server inter 500ms fall 2 rise 2 on-marked-down shutdown-sessions"
    for n in "${nodes[@]}"; do
      echo "  server n$n $(node_ip "$n"):$(pg_port "$n") maxconn 100 check port $(api_port "$n")"
    done
  } >"$dir/haproxy.cfg"
  haproxy -D -f "$dir/haproxy.cfg" -p "$dir/haproxy.pid"
}

members_json() {
  curl -fsS --max-time 1 "http://$(node_ip "${1:-1}"):$(api_port "${1:-1}")/cluster" 2>/dev/null
}

status() {
  local raw=""
  for n in "${nodes[@]}"; do raw=$(members_json "$n") && break; done
  python3 - "$raw" <<'EOF'
import json, sys
raw = sys.argv[1]
cluster = json.loads(raw) if raw else {"members": []}
members = [{"name": m["name"], "role": m.get("role"), "state": m.get("state"), "host": m.get("host"), "port": m.get("port")}
           for m in cluster.get("members", [])]
primary = next((m["name"] for m in members if m["role"] == "leader" and m["state"] == "running"), None)
print(json.dumps({"primary": primary, "members": members}))
EOF
}

# Waits until a primary runs and both other nodes stream from it, one of them as the synchronous standby
# (unless `async` switched synchronous mode off).
wait_healthy() {
  local sync=1
  [ "$(cat "$dir/mode" 2>/dev/null)" = async ] && sync=0
  for _ in $(seq 1 "${1:-600}"); do
    if status | python3 -c '
import json, sys
s = json.load(sys.stdin)
ms = s["members"]
ok = s["primary"] and len(ms) == 3 and all(m["state"] in ("running", "streaming") for m in ms) \
     and (sys.argv[1] == "0" or any(m["role"] == "sync_standby" for m in ms))
sys.exit(0 if ok else 1)' "$sync"; then return 0; fi
    sleep 0.2
  done
  log "the cluster did not become healthy: $(status)"; return 1
}

primary_node() { status | python3 -c 'import json,sys; p=json.load(sys.stdin)["primary"]; print(p[1:] if p else "")'; }

# The only place a password is printed: the superuser's, in the URLs the tests connect with.
urls() {
  load_secrets
  echo "DATABASE_URL=postgres://postgres:$SUPERUSER_PASSWORD@127.0.0.1:$haproxy_port/postgres"
  local hosts=""
  for n in "${nodes[@]}"; do hosts="$hosts${hosts:+,}$(node_ip "$n"):$(pg_port "$n")"; done
  echo "DATABASE_MULTIHOST_URL=postgres://postgres:$SUPERUSER_PASSWORD@$hosts/postgres?target_session_attrs=read-write&connect_timeout=2"
}

case "${1:-}" in
  up)
    install
    mkdir -p "$dir"
    load_secrets create
    reclaim_ports
    net_up
    start_etcd
    etcd_auth
    for n in "${nodes[@]}"; do node_config "$n"; start_node "$n"; done
    wait_healthy 900
    start_haproxy
    # HAProxy starts with every server up until its checks say otherwise: wait until ten connections in a
    # row reach the primary
    in_a_row=0
    for _ in $(seq 1 300); do
      if [ "$(PGPASSWORD=$SUPERUSER_PASSWORD psql "postgres://postgres@127.0.0.1:$haproxy_port/postgres?connect_timeout=1" \
            -Atc 'SELECT pg_is_in_recovery()' 2>/dev/null)" = f ]; then in_a_row=$((in_a_row + 1)); else in_a_row=0; fi
      [ "$in_a_row" -ge 10 ] && break
      sleep 0.1
    done
    [ "$in_a_row" -ge 10 ] || { log "HAProxy does not route to the primary"; exit 1; }
    urls
    ;;
  status) status ;;
  urls) urls ;;
  wait) wait_healthy "${2:-600}" ;;
  kill-primary)
    p=$(primary_node)
    [ -n "$p" ] || { log "no primary"; exit 1; }
    postmaster=$(head -n1 "$dir/n$p/data/postmaster.pid" 2>/dev/null || true)
    kill -9 "$(node_pid "$p")"
    [ -n "$postmaster" ] && kill -9 "$postmaster" 2>/dev/null || true
    echo "n$p"
    ;;
  isolate-primary | partition-primary)
    p=$(primary_node)
    [ -n "$p" ] || { log "no primary"; exit 1; }
    cut_node "$p" "$([ "$1" = isolate-primary ] && echo all || echo peers)"
    echo "n$p"
    ;;
  heal)
    uncut_all
    for n in "${nodes[@]}"; do start_node "$n"; done
    ;;
  async | sync)
    mode=$([ "$1" = sync ] && echo true || echo false)
    lag=$([ "$1" = sync ] && echo 0 || echo 1073741824)
    # patronictl reads the DCS address from a node's file; from the host, etcd is on loopback too
    # (it holds the node's passwords: etcd's for Patroni, and the REST API's, which patronictl sends)
    sed "s/hosts: .*/hosts: 127.0.0.1:$etcd_client/" "$dir/n1.yml" | write_private "$dir/ctl.yml" postgres
    as_postgres patronictl -c "$dir/ctl.yml" edit-config --force \
      -s "synchronous_mode=$mode" -s "synchronous_mode_strict=$mode" -s "maximum_lag_on_failover=$lag" >/dev/null
    echo "$1" >"$dir/mode"
    ;;
  down)
    [ -f "$dir/haproxy.pid" ] && kill "$(cat "$dir/haproxy.pid")" 2>/dev/null || true
    for n in "${nodes[@]}"; do
      pkill -9 -f "bin/patroni $dir/n$n.yml" 2>/dev/null || true
      [ -f "$dir/n$n/data/postmaster.pid" ] && kill -9 "$(head -n1 "$dir/n$n/data/postmaster.pid")" 2>/dev/null || true
    done
    [ -f "$dir/etcd.pid" ] && kill "$(cat "$dir/etcd.pid")" 2>/dev/null || true
    sleep 0.5
    net_down
    rm -rf "$dir"
    ;;
  *) echo "usage: $0 up|status|urls|wait|kill-primary|isolate-primary|partition-primary|heal|async|sync|down" >&2; exit 2 ;;
esac
