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

# find_links: the machine's wheel directories (pip's config, PIP_FIND_LINKS), one per line
find_links() {
  local dir
  for dir in $(python3 -m pip config get global.find-links 2>/dev/null || true) ${PIP_FIND_LINKS:-}; do
    [ -d "$dir" ] && echo "$dir"
  done
  return 0
}

# venv_uv VENV ARGS...: `uv pip install ARGS` into VENV (uv itself installed there by the venv's pip first)
venv_uv() {
  local venv="$1"; shift
  [ -x "$venv/bin/uv" ] || "$venv/bin/pip" install -qq --no-input --disable-pip-version-check "uv==$UV_VERSION"
  local links=() dir
  for dir in $(find_links); do links+=(--find-links "$dir"); done
  "$venv/bin/uv" pip install -q --python "$venv/bin/python" "${links[@]}" "$@"
}

# The venv cache. Installing the main venv costs a fresh clone ~10 s of uv (from its warm cache) and ~60 s of
# byte-compiling on 2 cores (~130 s of CI's set-up beside its system part), although a machine that built
# the same venv before holds every byte of it. So a built venv is kept in the user's cache dir (beside pip's and uv's caches), keyed by everything that decides
# its contents, and the next clone's venv is made from it by hard links in seconds (a copy where the cache is on
# another filesystem). Only the #! lines of its scripts and pyvenv.cfg name the venv's path: they are rewritten
# (into new files); .pyc files name their source's path too, but Python corrects that on load. The project's
# own editable install names the clone and is reinstalled by the caller. Nothing writes into an installed file
# in place (uv and pip replace files, Python writes .pyc by rename), so a clone's venv never changes the cache.
# FACTORY_VENV_CACHE=0 turns it off.

# venv_cache_entry NAME FILE...: the cache entry of venv NAME, keyed by the FILEs it is installed from, uv's
# version, the Python, and what the machine's wheel directories hold
venv_cache_entry() {
  local name="$1"; shift
  local key file
  for file in "$@"; do [ -f "$file" ] || { echo "venv_cache_entry: no file $file" >&2; return 1; }; done
  key="$( { cat "$@"; echo "uv $UV_VERSION"; python3 -c 'import sys; print(sys.base_prefix, sys.version)'
            local dir; for dir in $(find_links); do ls -l "$dir"; done; } | sha256sum | cut -c1-24)"
  echo "${XDG_CACHE_HOME:-$HOME/.cache}/factory/venvs/$name-$key"
}

# venv_restore ENTRY VENV: make VENV (which has no bin/ yet) from the cache ENTRY; false if there is none
venv_restore() {
  local entry="$1" venv="$2" origin f
  [ "${FACTORY_VENV_CACHE:-1}" != 0 ] && [ -f "$entry/origin" ] && [ ! -e "$venv/bin" ] || return 1
  origin="$(cat "$entry/origin")"
  mkdir -p "$venv"
  cp -al "$entry/venv/." "$venv/" 2>/dev/null || cp -a "$entry/venv/." "$venv/" || return 1
  if [ "$origin" != "$venv" ]; then
    for f in "$venv/pyvenv.cfg" $(grep -IlF "$origin" "$venv"/bin/* 2>/dev/null || true); do
      sed "s|$origin|$venv|g" "$f" >"$f.relocated" && chmod --reference="$f" "$f.relocated" \
        && mv -f "$f.relocated" "$f" || return 1
    done
  fi
}

# venv_drop ENTRY VENV: undo a venv_restore that failed (only what came from ENTRY), and forget ENTRY
venv_drop() {
  local entry="$1" venv="$2" part
  for part in "$entry"/venv/* "$entry"/venv/.[!.]*; do
    [ -e "$part" ] || [ -L "$part" ] && rm -rf "${venv:?}/$(basename "$part")"
  done
  rm -rf "$entry"
}

# venv_save ENTRY VENV [SKIP...]: keep VENV, just installed and checked, as cache ENTRY for the next clone (its
# stamp and the SKIPped names beside its own parts left out); drops older entries of the same venv. Best effort
venv_save() {
  local entry="$1" venv="$2"; shift 2
  [ "${FACTORY_VENV_CACHE:-1}" != 0 ] && [ ! -e "$entry" ] || return 0
  local partial="$entry.partial-$$" part name old
  mkdir -p "$partial/venv" || return 0
  for part in "$venv"/* "$venv"/.[!.]*; do
    name="$(basename "$part")"
    { [ -e "$part" ] || [ -L "$part" ]; } && [ "$name" != .factory-installed ] || continue
    case " $* " in *" $name "*) continue ;; esac
    cp -al "$part" "$partial/venv/" 2>/dev/null || cp -a "$part" "$partial/venv/" || { rm -rf "$partial"; return 0; }
  done
  echo "$venv" >"$partial/origin"
  mv -T "$partial" "$entry" 2>/dev/null || { rm -rf "$partial"; return 0; }
  for old in "${entry%-*}"-*; do
    [ "$old" = "$entry" ] || case "$old" in *.partial-*) ;; *) rm -rf "$old" ;; esac
  done
}
