#!/usr/bin/env bash
# A two-node Ray cluster on one machine (root): two network namespaces joined by a veth pair; node 2
# sees a private state dir. Usage: up | run CMD... | down | partition SECONDS | kill-node2 | start-node2.
# On real machines the two `ray start` lines below (without netns/unshare) are all it takes (docs/cluster.md).
# Settings: CLUSTER_NAME (default factory), CLUSTER_SUBNET (default 10.250.0), CLUSTER_DIR
# (default /tmp/factory-cluster-NAME), FACTORY_HOME (default <repo>/.state/cluster-home), PYTHON.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
NAME="${CLUSTER_NAME:-factory}"
SUBNET="${CLUSTER_SUBNET:-10.250.0}"
export FACTORY_HOME="${FACTORY_HOME:-$REPO/.state/cluster-home}"
CLUSTER_DIR="${CLUSTER_DIR:-/tmp/factory-cluster-$NAME}"
PYTHON="${PYTHON:-$REPO/.state/venv/bin/python}"
RAY="$(dirname "$PYTHON")/ray"
HEAD_NS="$NAME-head" NODE_NS="$NAME-node2"
HEAD_IP="$SUBNET.1" NODE_IP="$SUBNET.2" PORT=6379
# what every Ray process of either node inherits: no auth on a private link, no usage reports, no hub
# (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1: a caller that ran a local Ray may have set it to 0, which
# makes `ray start --address` refuse to join; a driver's RAY_ADDRESS is set only by `run`)
NODE_ENV=(-u RAY_ADDRESS RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 RAY_worker_niceness=0 HF_HUB_OFFLINE=1
          TOKENIZERS_PARALLELISM=false "FACTORY_HOME=$FACTORY_HOME" "PYTHONPATH=$REPO")

die() { echo "netns.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (ip netns, mount); run it as root"

up() {
  ip netns list | grep -qw "$HEAD_NS" && die "namespace $HEAD_NS exists already: run '$0 down' first"
  [ -x "$RAY" ] || die "no ray at $RAY: run 'make setup' (or set PYTHON to a venv with ray)"
  mkdir -p "$CLUSTER_DIR" "$FACTORY_HOME"
  trap 'echo "netns.sh: up failed; tearing down what it made" >&2; down' EXIT  # no half-made cluster left
  ip netns add "$HEAD_NS"
  ip netns add "$NODE_NS"
  ip link add "$NAME-h" type veth peer name "$NAME-n"
  ip link set "$NAME-h" netns "$HEAD_NS"
  ip link set "$NAME-n" netns "$NODE_NS"
  ip -n "$HEAD_NS" addr add "$HEAD_IP/24" dev "$NAME-h"
  ip -n "$NODE_NS" addr add "$NODE_IP/24" dev "$NAME-n"
  for ns in "$HEAD_NS" "$NODE_NS"; do ip -n "$ns" link set lo up; done
  ip -n "$HEAD_NS" link set "$NAME-h" up
  ip -n "$NODE_NS" link set "$NAME-n" up

  ip netns exec "$HEAD_NS" env "${NODE_ENV[@]}" "$RAY" start --head --node-ip-address "$HEAD_IP" --port "$PORT" \
    --temp-dir "$CLUSTER_DIR/ray-head" --num-cpus 8 --resources '{"trainer": 4, "trainer_rank": 1}' --include-dashboard false \
    --disable-usage-stats > "$CLUSTER_DIR/head.log" 2>&1 || { cat "$CLUSTER_DIR/head.log" >&2; die "ray head did not start"; }
  start_node2
  trap - EXIT
  echo "driver: $0 run <command>   (RAY_ADDRESS=$HEAD_IP:$PORT inside $HEAD_NS)"
}

start_node2() {  # node 2: a private mount namespace with an empty tmpfs over the state dir, then its Ray worker node
  local log="$CLUSTER_DIR/node2.log" temp="$CLUSTER_DIR/ray-node2"
  if [ -e "$temp" ]; then temp="$CLUSTER_DIR/ray-node2-$(date +%s)"; log="$temp.log"; fi  # a new node: its own dirs
  ip netns exec "$NODE_NS" unshare -m --propagation private sh -c \
    'mount -t tmpfs -o size=8g factory-node2 "$0" && exec env "$@"' "$FACTORY_HOME" \
    "${NODE_ENV[@]}" "$RAY" start --address "$HEAD_IP:$PORT" --node-ip-address "$NODE_IP" \
    --temp-dir "$temp" --num-cpus 8 --resources '{"rollout": 8, "trainer_rank": 1}' --disable-usage-stats \
    > "$log" 2>&1 || { cat "$log" >&2; die "ray node 2 did not start"; }
  # ready when the head sees both nodes alive
  ip netns exec "$HEAD_NS" env "${NODE_ENV[@]}" "$PYTHON" - "$HEAD_IP:$PORT" <<'PY'
import sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
deadline = time.time() + 60
while sum(n["Alive"] for n in ray.nodes()) < 2:
    if time.time() > deadline:
        sys.exit("netns.sh: node 2 did not join the head within 60 s")
    time.sleep(0.5)
print("cluster up:", ", ".join(sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})))
PY
}

kill_ns() {  # every process in the namespace at once, by PID (a machine that loses power); the namespace stays
  local ns="$1" pids
  pids=$(ip netns pids "$ns" || true)
  [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
  for _ in $(seq 1 50); do
    [ -z "$(ip netns pids "$ns" || true)" ] && break
    sleep 0.1
  done
}

partition() {  # the link between the nodes down for SECONDS, then up again (both nodes live on)
  local seconds="${1:?partition: give the seconds}"
  ip -n "$NODE_NS" link set "$NAME-n" down
  echo "partition: link down for $seconds s"
  sleep "$seconds"
  ip -n "$NODE_NS" link set "$NAME-n" up
  echo "partition: link up"
}

run() {
  [ $# -gt 0 ] || die "run: give a command, e.g. '$0 run factory run recipes/two_node.yaml'"
  exec ip netns exec "$HEAD_NS" env "${NODE_ENV[@]}" RAY_ADDRESS="$HEAD_IP:$PORT" "$@"
}

stop_ns() {  # every process in the namespace, by PID: TERM, a grace period, then KILL
  local ns="$1" pids
  ip netns list | grep -qw "$ns" || return 0
  pids=$(ip netns pids "$ns" || true)
  [ -z "$pids" ] || kill -TERM $pids 2>/dev/null || true
  for _ in $(seq 1 50); do
    pids=$(ip netns pids "$ns" || true)
    [ -z "$pids" ] && break
    sleep 0.1
  done
  pids=$(ip netns pids "$ns" || true)
  [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
  for _ in $(seq 1 50); do  # a namespace outlives nothing: wait until its processes are gone
    [ -z "$(ip netns pids "$ns" || true)" ] && break
    sleep 0.1
  done
  ip netns del "$ns"  # takes its end of the veth pair with it
}

down() {
  stop_ns "$NODE_NS"
  stop_ns "$HEAD_NS"
  ip link del "$NAME-h" 2>/dev/null || true  # only if a half-made cluster left it in the root namespace
  echo "cluster down"
}

case "${1:-}" in
  up) up ;;
  run) shift; run "$@" ;;
  down) down ;;
  partition) shift; partition "$@" ;;  # faults, for tests and bench/chaos.py
  kill-node2) kill_ns "$NODE_NS"; echo "node 2 killed" ;;
  start-node2) start_node2 ;;
  *) die "usage: $0 up | run CMD... | down | partition SECONDS | kill-node2 | start-node2" ;;
esac
