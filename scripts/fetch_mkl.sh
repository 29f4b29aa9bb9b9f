#!/usr/bin/env bash
# Puts Intel MKL's runtime libraries (from PyPI's `mkl` wheel) in DIR (default target/mkl)
# and prints the PIPEFILL_BLAS line that makes the CPU backend compute its matrix products
# with them (src/tensor/cpu/blas.rs). Only the libraries a row-major sgemm on x86-64 needs
# are kept: the runtime, the core, the LP64 interface, the GNU OpenMP and sequential
# threading layers and the per-ISA kernels (470 MB of the 685 the wheel unpacks to).
#
#   scripts/fetch_mkl.sh [DIR]
#   export PIPEFILL_BLAS=$PWD/target/mkl/libmkl_rt.so.3
set -euo pipefail
dir=${1:-target/mkl}
version=${MKL_VERSION:-2026.2.1}
if [ -e "$dir/libmkl_rt.so.3" ]; then
  echo "PIPEFILL_BLAS=$(cd "$dir" && pwd)/libmkl_rt.so.3"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "mkl==$version" >&2
mkdir -p "$dir"
python3 - "$tmp" "$dir" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
keep = {"rt", "core", "intel_lp64", "gnu_thread", "sequential", "def", "mc3", "avx2", "avx512", "avx10"}
(wheel,) = glob.glob(os.path.join(tmp, "mkl-*.whl"))
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        base = os.path.basename(name)
        if "/lib/" in name and base.startswith("libmkl_") and base.split(".so")[0][len("libmkl_"):] in keep:
            with z.open(name) as src, open(os.path.join(dest, base), "wb") as out:
                shutil.copyfileobj(src, out)
PY
echo "PIPEFILL_BLAS=$(cd "$dir" && pwd)/libmkl_rt.so.3"
