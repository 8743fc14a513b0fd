#!/usr/bin/env bash
# Installs the project (editable, with its dev extra) into the virtual environment whose python is
# $1, with torch pinned through constraints.txt. uv does it in 25 s where pip takes 76 (both
# byte-compile every installed module; uv installs and compiles in parallel); uv is
# given pip's own configured indexes and find-links and `--index-strategy unsafe-best-match`, so it
# picks the same versions pip would. Where uv cannot be installed or fails, pip does the install.
# It prints one line saying what it installs and with which tool, prefixed by $2 when given.
# Usage: deploy/venv_install.sh .venv/bin/python ["install 2/4"]   (the Makefile's install step)
set -uo pipefail
PY=$1
BIN=$(dirname "$PY")
PHASE=${2:-install}
WHAT="pdserve and its packages (torch pinned by constraints.txt, Ray, ...)"
cd "$(dirname "$0")/.."

pip_config() { "$PY" -m pip config get "global.$1" 2>/dev/null || true; }

if "$PY" -m pip install -q uv >/dev/null 2>&1 && [ -x "$BIN/uv" ]; then
  args=(--index-strategy unsafe-best-match)
  index=$(pip_config index-url)
  [ -n "$index" ] && args+=(--index-url "$index")
  for url in $(pip_config extra-index-url); do args+=(--extra-index-url "$url"); done
  for dir in $(pip_config find-links); do args+=(--find-links "$dir"); done
  # --compile-bytecode: as pip does; where PYTHONDONTWRITEBYTECODE is set (these machines), every
  # process would otherwise compile torch and Ray from source at each import (the suite ran 2x slower)
  echo "$PHASE: $WHAT with uv"
  if "$BIN/uv" pip install -q --compile-bytecode --python "$PY" "${args[@]}" -c constraints.txt -e '.[dev]'; then
    exit 0
  fi
  echo "uv could not install the project; pip does" >&2
fi
echo "$PHASE: $WHAT with pip"
"$PY" -m pip install -q --upgrade pip
exec "$PY" -m pip install -q -c constraints.txt -e '.[dev]'
