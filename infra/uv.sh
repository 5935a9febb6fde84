# Sourced by infra/setup.sh and infra/sglang-venv.sh: install into a venv with uv instead of pip.
#
# Why: pip took ~125 s of a fresh clone's set-up for the main venv on this machine's 2 cores (resolving
# and unpacking one wheel at a time), and ~150 s for SGLang's beside it; uv does the same install in
# ~20 s from a cold cache. pip byte-compiles everything it installs, uv only when asked: the main venv
# asks (`--compile-bytecode`, ~25 s more: where PYTHONDONTWRITEBYTECODE is set nothing writes .pyc
# later, and every process would compile its imports again); SGLang's venv compiles only what its
# server imports (infra/sglang-venv.sh).
#
# uv reads none of pip's configuration, so this hands it the machine's wheel directories (pip's
# `find-links`: where a CPU build of torch may lie) from pip's config and PIP_FIND_LINKS.
UV_VERSION="0.13.*"

# venv_uv VENV ARGS...: `uv pip install ARGS` into VENV (uv itself installed there by the venv's pip first)
venv_uv() {
  local venv="$1"; shift
  [ -x "$venv/bin/uv" ] || "$venv/bin/pip" install -qq --no-input --disable-pip-version-check "uv==$UV_VERSION"
  local links=() dir
  for dir in $(python3 -m pip config get global.find-links 2>/dev/null || true) ${PIP_FIND_LINKS:-}; do
    [ -d "$dir" ] && links+=(--find-links "$dir")
  done
  "$venv/bin/uv" pip install -q --python "$venv/bin/python" "${links[@]}" "$@"
}
