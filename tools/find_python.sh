#!/usr/bin/env bash
# Print the path of a working Python interpreter of version $1 (e.g. 3.12): PATH first, then pyenv.
# Exit 1 (printing nothing) when there is none.
set -u
want="$1"
cands=("python$want")
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for d in "$root"/versions/"$want".*; do [ -x "$d/bin/python$want" ] && cands+=("$d/bin/python$want"); done
fi
for p in "${cands[@]}"; do
  if "$p" -c "import sys; sys.exit(0 if '%d.%d' % sys.version_info[:2] == '$want' else 1)" >/dev/null 2>&1; then
    if [[ "$p" == */* ]]; then echo "$p"; else
      # resolve a pyenv shim to the real interpreter so the venv does not depend on PYENV_VERSION
      "$p" -c 'import sys; print(sys.executable)'
    fi
    exit 0
  fi
done
exit 1
