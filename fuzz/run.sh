#!/usr/bin/env bash
# Runs every fuzz target (or the ones named) for SECONDS seconds each, one job each,
# one after another, and prints the executions each one made.
#
#   fuzz/run.sh [SECONDS] [TARGET...]      SECONDS defaults to 600
#
# With cargo-fuzz and a nightly toolchain (`cargo install cargo-fuzz`) it runs
# `cargo +nightly fuzz run` (AddressSanitizer on). Without them it builds the targets
# with the stable toolchain, instrumented for coverage as cargo-fuzz does but without
# a sanitizer, and runs them directly on fuzz/corpus/<target>/. A crash leaves its
# input in fuzz/artifacts/<target>/; the script then goes on with the other targets
# and exits non-zero.
set -euo pipefail

seconds=${1:-600}
shift || true
if ! [[ $seconds =~ ^[0-9]+$ ]]; then
    echo "usage: $0 [SECONDS] [TARGET...]" >&2
    exit 2
fi

cd "$(dirname "$0")/.."
if cargo +nightly fuzz --version >/dev/null 2>&1; then
    mode=nightly
else
    mode=stable
fi
if [[ $# -gt 0 ]]; then
    targets=("$@")
elif [[ $mode == nightly ]]; then
    mapfile -t targets < <(cargo +nightly fuzz list)
else
    mapfile -t targets < <(sed -nE 's/^name = "(.*)"$/\1/p' fuzz/Cargo.toml | grep -v '^mooncake-fuzz$')
fi

# The stable build: coverage instrumentation for libFuzzer (the flags cargo-fuzz
# passes, less the sanitizer), applied through --target so that build scripts and
# proc macros are built without it.
host=$(rustc -vV | sed -n 's/^host: //p')
stable_dir=fuzz/target/stable
stable_flags="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"

if [[ $mode == nightly ]]; then
    cargo +nightly fuzz build
else
    bins=()
    for target in "${targets[@]}"; do bins+=(--bin "$target"); done
    (cd fuzz && RUSTFLAGS="$stable_flags" CARGO_TARGET_DIR=target/stable \
        cargo build --release --target "$host" "${bins[@]}")
fi

# Runs one target for $seconds seconds; its output goes to stdout.
run_target() {
    local target=$1
    if [[ $mode == nightly ]]; then
        cargo +nightly fuzz run "$target" -- -max_total_time="$seconds"
    else
        mkdir -p "fuzz/corpus/$target" "fuzz/artifacts/$target"
        "$stable_dir/$host/release/$target" "fuzz/corpus/$target" \
            -max_total_time="$seconds" -artifact_prefix="fuzz/artifacts/$target/"
    fi
}

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

failed=0
results=()
for target in "${targets[@]}"; do
    echo "== $target: ${seconds}s ($mode)" >&2
    log="$logs/$target.log"
    if run_target "$target" >"$log" 2>&1; then
        # libFuzzer's last status line: "#<executions> DONE cov: ... exec/s: <rate> ...".
        done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1)
        executions=$(sed -E 's/^#([0-9]+).*/\1/' <<<"$done_line")
        rate=$(sed -E 's/.*exec\/s: ([0-9]+).*/\1/' <<<"$done_line")
        results+=("$(printf '%-26s %12s executions  %8s exec/s' "$target" "$executions" "$rate")")
    else
        failed=1
        tail -n 40 "$log" >&2
        results+=("$(printf '%-26s FAILED: a crash leaves its input in fuzz/artifacts/%s/' "$target" "$target")")
    fi
done

printf '%s\n' "${results[@]}"
exit "$failed"
