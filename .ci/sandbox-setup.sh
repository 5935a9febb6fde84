#!/usr/bin/env bash
# Code sandboxes on a fresh Debian 12 (root, non-interactive, idempotent): bubblewrap, docker.io and
# debootstrap; a running dockerd (started here when no engine answers); the sandbox images built from
# sandboxes/*/spec.yaml (skipped while current). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
[ "$(id -u)" = 0 ] || { echo "sandbox-setup: must run as root (apt-get, dockerd, debootstrap)" >&2; exit 1; }

# Which python builds the images: $FACTORY_SANDBOX_PYTHON if set (infra/setup.sh: the system's, since
# it runs this beside the venv's install), else the project's venv when it exists, else the system
# python (+ PyYAML).
PY="${FACTORY_SANDBOX_PYTHON:-${FACTORY_HOME:-$PWD/.state}/venv/bin/python}"
[ -x "$PY" ] || PY=python3

need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v setpriv >/dev/null || need+=(util-linux)
command -v nsenter >/dev/null || need+=(util-linux)
command -v ip >/dev/null || need+=(iproute2)  # the two-node cluster test (infra/cluster/netns.sh)
command -v "$PY" >/dev/null || need+=(python3)
"$PY" -c "import yaml" 2>/dev/null || need+=(python3-yaml)
if [ ${#need[@]} -gt 0 ]; then
  echo "sandbox-setup: installing ${need[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" ca-certificates >/dev/null
  "$PY" -c "import yaml" 2>/dev/null || PY=/usr/bin/python3
fi

# dockerd: reuse a running engine, else start one in the background (no systemd needed).
if ! docker info >/dev/null 2>&1; then
  log=/tmp/factory-dockerd.log
  echo "sandbox-setup: starting dockerd (log: $log)"
  # without the caller's descriptors above 2: under `flock`, dockerd inherited the lock and held it
  # for as long as it ran, so the next locked job waited for ever
  (
    for fd in /proc/$BASHPID/fd/*; do
      n=${fd##*/}
      [ "$n" -gt 2 ] 2>/dev/null && eval "exec $n>&-" 2>/dev/null
    done
    exec setsid nohup dockerd >"$log" 2>&1 </dev/null
  ) &
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  docker info >/dev/null 2>&1 || { echo "sandbox-setup: dockerd did not come up; last log lines:" >&2; tail -n 20 "$log" >&2; exit 1; }
fi
echo "sandbox-setup: docker engine $(docker info --format '{{.ServerVersion}}') ready (pid $(cat /var/run/docker.pid 2>/dev/null || echo '?'))"

# Images: rootfs (debootstrap) + docker import; both skipped while current.
"$PY" sandboxes/build.py
