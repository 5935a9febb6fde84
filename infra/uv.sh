# Sourced by infra/setup.sh, infra/sglang-venv.sh and infra/docs-venv.sh: install into a venv with uv, much faster than pip.
# uv reads none of pip's configuration, so it is handed the machine's wheel directories (find-links).
UV_VERSION="0.13.*"

# venv_built STAMP FILES...: true when the venv behind STAMP was built from FILES as they are now (the
# stamp holds their hash); VENV_WANT is set to that hash for the caller to write once it is built
venv_built() {
  local stamp=$1; shift
  VENV_WANT="$(cat "$@" | sha256sum | cut -c1-16)"
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$VENV_WANT" ]
}

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

# The venv cache: a built venv is kept in the user's cache dir, keyed by what decides its contents, and
# a new clone's venv is hard-linked from it; only the scripts' #! lines and pyvenv.cfg are rewritten.
# Nothing writes an installed file in place, so a clone never changes the cache. FACTORY_VENV_CACHE=0: off.
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
