#!/usr/bin/env bash
# Runs every fuzz target (or the ones named) for SECONDS seconds each, one job each,
# one after another, and prints the executions each one made.
#
#   fuzz/run.sh [SECONDS] [TARGET...]      SECONDS defaults to 600
#
# Needs cargo-fuzz and a nightly toolchain (`cargo install cargo-fuzz`). A crash
# leaves its input in fuzz/artifacts/<target>/; the script then goes on with the
# other targets and exits non-zero.
set -euo pipefail

seconds=${1:-600}
shift || true
if ! [[ $seconds =~ ^[0-9]+$ ]]; then
    echo "usage: $0 [SECONDS] [TARGET...]" >&2
    exit 2
fi

cd "$(dirname "$0")/.."
if [[ $# -gt 0 ]]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo +nightly fuzz list)
fi

cargo +nightly fuzz build
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

failed=0
results=()
for target in "${targets[@]}"; do
    echo "== $target: ${seconds}s" >&2
    log="$logs/$target.log"
    if cargo +nightly fuzz run "$target" -- -max_total_time="$seconds" >"$log" 2>&1; then
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
