#!/usr/bin/env bash
# Source this on the GPU machine (from the repository root) before running a bundled build:
#   source scripts/offline_env.sh [BUILD_DIR]
# Puts bundled libraries on the library path only where the machine lacks them, and prefers
# newer cuDNN/NCCL found in a Python environment's nvidia/ packages when present.
BB_BUILD_DIR=${1:-build-dev}
BB_FALLBACK=$(mktemp -d)
for lib in "$BB_BUILD_DIR"/lib/*.so*; do
  [ -e "$lib" ] || continue
  name=$(basename "$lib")
  if ! ldconfig -p | grep -q " $name "; then ln -sf "$PWD/$lib" "$BB_FALLBACK/$name"; fi
done
for py in /opt/*/.venv/lib/python3*/site-packages/nvidia; do
  for pkg in cudnn nccl; do
    [ -d "$py/$pkg/lib" ] && BB_PREFER="${BB_PREFER:+$BB_PREFER:}$py/$pkg/lib"
  done
done
export LD_LIBRARY_PATH="${BB_PREFER:+$BB_PREFER:}${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$BB_FALLBACK"
echo "[offline_env] fallback libs: $(ls "$BB_FALLBACK" | tr '\n' ' ') | preferred: ${BB_PREFER:-none}"
