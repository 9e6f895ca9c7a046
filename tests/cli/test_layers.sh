#!/usr/bin/env bash
# The layering of DESIGN.md sec. 2 and 11 holds in the includes: models/ depends on primitives/
# and core/ (never runtime/ or comm/), primitives/ never on models/ or runtime/, comm/ only on
# core/ and backend/, core/, io/ and backend/ on none of them. Includes are matched in both
# spellings ("..." and <...>), and a relative include that climbs out of its folder ("../") is
# refused anywhere in src/ (it would hide the layer it reaches). A folder that is missing fails
# (the rule would otherwise pass vacuously after a rename).
# Usage: test_layers.sh [bumblebee-binary, unused] [SRC_ROOT]   (run from the repository root)
set -u
SRC=${2:-src}
fail=0
check() {  # check <directory> <forbidden include prefix> <why>
  local hits
  if [ ! -d "$SRC/$1" ]; then
    echo "FAIL: $SRC/$1 does not exist (renamed? update this test)"
    fail=1
    return
  fi
  hits=$(grep -rnE "#[[:space:]]*include[[:space:]]*[\"<]$2" "$SRC/$1")
  if [ -n "$hits" ]; then
    echo "FAIL: $SRC/$1 includes $2 ($3):"
    echo "$hits"
    fail=1
  fi
}
climb=$(grep -rnE "#[[:space:]]*include[[:space:]]*[\"<][^\">]*\.\./" "$SRC")
if [ -n "$climb" ]; then
  echo "FAIL: relative includes that climb out of their folder (write the path from src/):"
  echo "$climb"
  fail=1
fi
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
check io runtime/ "io is a bottom layer (files and formats)"
check io models/ "io is a bottom layer (files and formats)"
check io primitives/ "io is a bottom layer (files and formats)"
check io comm/ "io is a bottom layer (files and formats)"
check primitives plan/ "a primitive is a self-contained capability"
check models plan/ "models know nothing about the planner"
check runtime capi/ "the C interface sits on top of the runtime"
[ $fail -eq 0 ] && echo "ok: includes follow the layers"
exit $fail
