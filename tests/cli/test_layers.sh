#!/usr/bin/env bash
# The layering of DESIGN.md sec. 2 and 11 holds in the includes: models/ depends on primitives/
# and core/ (never runtime/ or comm/), primitives/ never on models/ or runtime/, comm/ only on
# core/ and backend/, core/ and backend/ on none of them. Usage: test_layers.sh [bumblebee-binary, unused]   (run from the repository root)
set -u
fail=0
check() {  # check <directory> <forbidden include prefix> <why>
  local hits
  hits=$(grep -rnE "#include \"$2" "src/$1" 2>/dev/null)
  if [ -n "$hits" ]; then
    echo "FAIL: src/$1 includes $2 ($3):"
    echo "$hits"
    fail=1
  fi
}
check models runtime/ "models know nothing about the training protocol or parallelism"
check primitives runtime/ "a primitive is a self-contained capability"
check primitives models/ "a primitive is a self-contained capability"
check models comm/ "model code knows nothing about parallelism"
check comm runtime/ "the communication layer serves the runtime"
check comm models/ "the communication layer serves the runtime"
check comm primitives/ "the communication layer serves the runtime"
check core runtime/ "core is the bottom layer"
check core models/ "core is the bottom layer"
check core primitives/ "core is the bottom layer"
check backend runtime/ "backends serve primitives"
check backend models/ "backends serve primitives"
check backend primitives/ "backends serve primitives"
[ $fail -eq 0 ] && echo "ok: includes follow the layers"
exit $fail
