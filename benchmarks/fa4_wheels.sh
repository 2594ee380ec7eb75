#!/usr/bin/env bash
# Here (the CPU machine), for benchmarks/h200_flash_backend.sh: download flash-attn-4 (CuTe DSL)
# and what it needs that the device lacks, for Python 3.12 on x86-64, into two folders of at most
# ~55 MB each. A device call carries at most 64 MiB of working tree and the CuTe DSL's compiled
# libraries are one 92 MB wheel (nvidia-cutlass-dsl-libs-cu13, 63.6 MB even as tar.xz -9), so
# that wheel travels as two byte ranges in two calls: .fa/a (first half + the small wheels) and
# .fa/b (second half). Both folders are ignored by git (.git/info/exclude). All of them must be
# installed by ONE `pip install --target` (they share the top folder nvidia_cutlass_dsl, which a
# second --target --upgrade would replace). Checked here on the CPU with the cp311 builds: after
# that one install, `import flash_attn.cute` works with nvidia_cutlass_dsl/dsl_packages on the path.
# Usage: benchmarks/fa4_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.fa/' .git/info/exclude 2>/dev/null || echo '/.fa/' >> .git/info/exclude
rm -rf .fa && mkdir -p .fa/dl .fa/a .fa/b
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
          --implementation cp "${platforms[@]}" -d .fa/dl "$@"; }
get --pre flash-attn-4
get nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-cu13 \
    apache-tvm-ffi torch-c-dlpack-ext quack-kernels
big=$(ls .fa/dl/nvidia_cutlass_dsl_libs_cu13-*.whl)
size=$(stat -c %s "$big")
head -c $((size / 2)) "$big" > .fa/a/libs_cu13.part1
tail -c +$((size / 2 + 1)) "$big" > .fa/b/libs_cu13.part2
basename "$big" > .fa/b/libs_cu13.name
sha256sum "$big" | cut -d' ' -f1 > .fa/b/libs_cu13.sha256
for w in .fa/dl/*.whl; do [ "$w" = "$big" ] || cp "$w" .fa/a/; done
rm -rf .fa/dl
du -sh .fa/a .fa/b
