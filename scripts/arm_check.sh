#!/usr/bin/env bash
# ARM64 NEON products checked on an x86 machine: cross-build the kernel sources for ARMv8.2-A with
# the dot product (TSQ_ISA neon-dotprod) and for plain ARMv8-A (TSQ_ISA neon), run
# scripts/arm_harness.c under qemu-aarch64 against the reference in the same build, bit for bit.
# A correctness check only: qemu's timings mean nothing. Installs Debian's gcc-aarch64-linux-gnu
# and qemu-user where missing. Prints "N passed, M failed" last; exit 0 only when M is 0.
set -euo pipefail
cd "$(dirname "$0")/.."
CC=${ARM_CC:-aarch64-linux-gnu-gcc}
if ! command -v "$CC" >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
    echo "installing gcc-aarch64-linux-gnu and qemu-user" >&2
    SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get install -y -q gcc-aarch64-linux-gnu qemu-user >/dev/null 2>&1 ||
        { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q gcc-aarch64-linux-gnu qemu-user >/dev/null; }
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
total_pass=0; total_fail=0
for level in "armv8.2-a+dotprod 4 neon-dotprod" "armv8-a 3 neon"; do
    set -- $level
    # the flags tsspec/kernels/__init__.py LEVELS gives this level, less -mtune=native
    "$CC" -O3 -fopenmp -ffp-contract=off -std=c11 -march="$1" -DTSQ_ISA="$2" -Itsspec/kernels \
        -o "$out/harness-$3" tsspec/kernels/*.c scripts/arm_harness.c -lm
    log="$out/$3.log"
    qemu-aarch64 -L /usr/aarch64-linux-gnu "$out/harness-$3" >"$log" 2>&1 || true
    sed "s/^/$3: /" "$log" | grep -v " passed, " || true
    p=$(sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$/\1/p' "$log"); f=$(sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed$/\2/p' "$log")
    if [ -z "$p" ]; then echo "$3: the harness did not finish" >&2; p=0; f=1; fi
    echo "$3: $p passed, $f failed"
    total_pass=$((total_pass + p)); total_fail=$((total_fail + f))
done
echo "$total_pass passed, $total_fail failed"
[ "$total_fail" = 0 ]
