#!/usr/bin/env bash
# Installs what the production profile's one-machine stack runs (idempotent): PostgreSQL 15 from
# Debian, s3rver (an S3 API server that keeps objects on disk) from npm into the venv's dir. The
# Python side (dagster-postgres, psycopg2, boto3) is the `production` extra that infra/setup.sh installs.
set -euo pipefail
cd "$(dirname "$0")/../.."
STATE="${FACTORY_HOME:-$PWD/.state}"
NODE_DIR="${S3RVER_DIR:-$STATE/venv/s3rver}"  # beside the Python packages, whatever FACTORY_HOME a run uses

if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || { echo "install: PostgreSQL is missing; as root: apt-get install -y postgresql-15" >&2; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq postgresql-15 >/dev/null
  # the package's own cluster is not ours: keep it down (the stack runs its own on its own port)
  pg_ctlcluster 15 main stop 2>/dev/null || true
fi
if [ ! -x "$NODE_DIR/node_modules/.bin/s3rver" ]; then
  command -v npm >/dev/null || { echo "install: npm is missing (apt-get install -y nodejs npm)" >&2; exit 1; }
  mkdir -p "$NODE_DIR"
  npm install --prefix "$NODE_DIR" --no-audit --no-fund --loglevel=error s3rver@3.7.1 >/dev/null
fi
echo "install: production services ready (postgres: $(ls -d /usr/lib/postgresql/*/bin | head -1), s3rver: $NODE_DIR)"
