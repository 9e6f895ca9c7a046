#!/usr/bin/env bash
# Installs the build dependencies (Debian/Ubuntu packages) when missing, then configures and
# builds bumblebee into ./build. Re-running is cheap: apt is skipped when everything is there.
#   ./scripts/setup.sh [TARGET...]   (default: everything; e.g. `bumblebee` for just the program)
#   BUMBLEBEE_CUDA=AUTO|ON|OFF  (default AUTO: the CUDA backend is built when nvcc is found)
#   BUILD_DIR=build             JOBS=$(nproc)     BUILD_TYPE=Release
#   EXTRA_PKGS="clang libclang-rt-dev"   more Debian packages to install (e.g. for a clang build)
#   CC=clang CXX=clang++        compilers, as CMake reads them (only when BUILD_DIR is new)
#   CMAKE_ARGS="-DBUMBLEBEE_FUZZ=ON"     more cmake arguments (word-split)
# The sanitized + fuzzing build that CI runs (docs/reliability.md):
#   EXTRA_PKGS="clang libclang-rt-dev" CC=clang CXX=clang++ BUMBLEBEE_CUDA=OFF BUILD_DIR=build-asan \
#     BUILD_TYPE=RelWithDebInfo CMAKE_ARGS="-DBUMBLEBEE_FUZZ=ON" ./scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(build-essential cmake ninja-build pkg-config libopenblas-dev libopenmpi-dev openmpi-bin
      nlohmann-json3-dev libtoml11-dev libcli11-dev libgtest-dev libgmock-dev python3 python3-numpy)
# A build of everything is for the tests: tests/cli/test_report.sh renders the run report in a
# headless browser. Building only some targets (the demo's `bumblebee`) does not need it.
[ $# -eq 0 ] && pkgs+=(chromium)
read -r -a extra_pkgs <<< "${EXTRA_PKGS:-}"
pkgs+=("${extra_pkgs[@]}")
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
read -r -a cmake_args <<< "${CMAKE_ARGS:-}"
echo "[setup] configuring ${BUILD_DIR} (BUMBLEBEE_CUDA=${BUMBLEBEE_CUDA:-AUTO}${CC:+, CC=$CC}${CXX:+, CXX=$CXX}${CMAKE_ARGS:+, $CMAKE_ARGS})"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" \
  -DBUMBLEBEE_CUDA="${BUMBLEBEE_CUDA:-AUTO}" "${cmake_args[@]}" >/dev/null
echo "[setup] building ${*:-everything} with ${JOBS} jobs"
if [ $# -gt 0 ]; then
  cmake --build "$BUILD_DIR" -j "$JOBS" --target "$@"
else
  cmake --build "$BUILD_DIR" -j "$JOBS"
fi
