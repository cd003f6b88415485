#!/usr/bin/env bash
# Packs a CUDA build made here for a lent GPU machine that can neither install packages nor reach
# a network (the device tool's nvidia-h200: an Ubuntu-based CUDA image with nvcc, cuBLAS, NCCL and
# a python3 with numpy, but no Debian -dev packages, so scripts/gpu_check.sh cannot build there).
#
# Here (Debian 12, CUDA 13 in /usr/local/cuda): configures and builds $BUILD_DIR (default
# build-gpu) with -DFD_WITH_CUDA=ON, sm_90 and FD_NATIVE=OFF (so the CPU kernels run on whatever
# x86-64 host the GPU sits in), then writes .gpu/ (ignored through .git/info/exclude, which this
# script fills in; name `.gpu` in the device tool's carry):
#   .gpu/bundle.tar.xz  the build dir's executables and CTest files (no objects), stripped
#   .gpu/lib/           the shared libraries they link that a CUDA image lacks (spdlog, fmt,
#                       sentencepiece, pcre2, utf8proc, yaml-cpp, gloo, openssl, rsync's, ...);
#                       never libc, libstdc++ or the CUDA libraries (the GPU machine's own are used)
#   .gpu/bin/           tools the tests run that such an image lacks (rsync)
#   .gpu/python3        FD_PYTHON for the tests: the first python3 with numpy it finds
#   .gpu/root           this checkout's absolute path (the CTest files name it; gpu_check.sh
#                       links it to the copy's root on the GPU machine)
# There: FD_GPU_PREBUILT=1 scripts/gpu_check.sh (unpacks, skips install and build).
#   BUILD_DIR (default build-gpu), FD_JOBS (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd -P)
BUILD_DIR=${BUILD_DIR:-build-gpu}
JOBS=${FD_JOBS:-2}
mkdir -p .gpu
# .gpu/ must stay out of git (the device tool carries it as an ignored path): ignore it locally.
exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || true)
if [[ -n "$exclude" ]] && ! grep -qx '/.gpu/' "$exclude" 2>/dev/null; then mkdir -p "$(dirname "$exclude")"; echo '/.gpu/' >> "$exclude"; fi
cat > .gpu/python3 <<'EOF'
#!/bin/sh
# FD_PYTHON of a prebuilt GPU bundle: Debian's python3 here, the CUDA image's (with numpy) there.
for p in /usr/bin/python3 /opt/torch/.venv/bin/python3 python3; do
  if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import numpy' 2>/dev/null; then exec "$p" "$@"; fi
done
echo "no python3 with numpy found" >&2
exit 1
EOF
chmod +x .gpu/python3
echo "$root" > .gpu/root

targets=(fdrollout fdctl fd_gpu_bench cuda_ipc_publisher)
for t in test_cuda_ops test_cuda_kv_bf16 test_cuda_vmm test_cuda_backend test_cuda_worker test_cuda_graph \
         test_nccl_comm test_cuda_kv_copier; do targets+=("fd_gpu_$t"); done
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFD_WITH_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DFD_NATIVE=OFF -DFD_PYTHON="$root/.gpu/python3" >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]}"

# The executables (stripped copies) and every CTest file, at their paths under the build dir.
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
bins=()
for t in "${targets[@]}"; do
  f=$(find "$BUILD_DIR" -maxdepth 3 -type f -name "$t" -perm -u+x | head -1)
  [[ -n "$f" ]] || { echo "gpu_bundle: $t not built" >&2; exit 1; }
  mkdir -p "$stage/$(dirname "$f")"
  strip -o "$stage/$f" "$f"
  bins+=("$f")
done
(find "$BUILD_DIR" -name CTestTestfile.cmake; echo "$BUILD_DIR/CMakeCache.txt") |
  while read -r f; do mkdir -p "$stage/$(dirname "$f")"; cp "$f" "$stage/$f"; done
tar -C "$stage" -cJf .gpu/bundle.tar.xz "$BUILD_DIR"

# Tools the GPU tests run that a CUDA image lacks (rsync: the rank-fault suite's wakeup source).
rm -rf .gpu/bin .gpu/lib && mkdir -p .gpu/bin .gpu/lib
cp -L "$(command -v rsync)" .gpu/bin/
# Shared libraries: everything ldd resolves except the C runtime and the CUDA libraries.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libstdc\+\+|libgcc_s|libpthread|libdl\.|librt\.|libcuda\.|libcudart|libcublas|libnccl)'
ldd "${bins[@]}" .gpu/bin/* | awk '/=> \//{print $1, $3}' | sort -u | while read -r name path; do
  [[ "$name" =~ $skip ]] || cp -L "$path" ".gpu/lib/$name"
done
echo "gpu_bundle: .gpu/ $(du -sh .gpu | cut -f1) (bundle $(du -h .gpu/bundle.tar.xz | cut -f1), libs: $(ls .gpu/lib | tr '\n' ' '))"
