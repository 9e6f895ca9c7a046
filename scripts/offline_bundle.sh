#!/usr/bin/env bash
# Builds bumblebee with the CUDA backend on a build machine and bundles the shared libraries
# that a GPU machine without package access may lack, so the build directory can be copied
# there and run as is. See docs/offline-build.md.
#   BUILD_DIR=build-dev (default)   JOBS=$(nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build-dev}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUMBLEBEE_CUDA=ON >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS"
# Libraries from the build machine's packages (not CUDA, not glibc): copied into lib/ and only
# put on the library path on the target when the target lacks them (scripts/offline_env.sh).
mkdir -p "$BUILD_DIR/lib"
ldd "$BUILD_DIR/bumblebee" "$BUILD_DIR"/tests/* 2>/dev/null | awk '/=> \//{print $3}' | sort -u |
  grep -vE '/(libc|libm|libdl|libpthread|librt|ld-linux|libgcc_s|libstdc\+\+)[.-]|/cuda|libcu|libnv' |
  while read -r lib; do cp -L "$lib" "$BUILD_DIR/lib/"; done
echo "[bundle] $BUILD_DIR ready: $(du -sh "$BUILD_DIR" | cut -f1); bundled libs: $(ls "$BUILD_DIR/lib" | tr '\n' ' ')"
