#!/usr/bin/env bash
# Run turnd's fuzz targets (cargo-fuzz, libFuzzer) for a fixed time each.
#
#   scripts/fuzz.sh                      # every target, 60 s each
#   FUZZ_SECONDS=600 scripts/fuzz.sh     # 10 minutes each
#   FUZZ_TARGETS=requests scripts/fuzz.sh
#
# Environment:
#   FUZZ_SECONDS    seconds of fuzzing per target (default 60)
#   FUZZ_TARGETS    space-separated targets (default: frame_decode requests)
#   FUZZ_SANITIZER  cargo-fuzz --sanitizer (default none: the toolchain is stable
#                   Rust; any other value builds with RUSTC_BOOTSTRAP=1 for
#                   -Zsanitizer, and rebuilds everything; see docs/fuzzing.md)
#   FUZZ_ARGS       extra libFuzzer flags for every target (e.g. "-seed=1")
#   CARGO           cargo command (default cargo)
#
# Installs cargo-fuzz when it is missing, builds the targets once (optimized, with
# debug assertions and overflow checks), replays the kept regressions, then fuzzes
# each target, growing fuzz/corpus/<target> from fuzz/seeds/<target>. Exits non-zero
# if any target crashed (or a regression input fails); crashing inputs are in
# fuzz/artifacts/<target>/ and the full log in fuzz/logs/.
set -euo pipefail

CARGO=${CARGO:-cargo}
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
FUZZ_TARGETS=${FUZZ_TARGETS:-"frame_decode requests"}
FUZZ_SANITIZER=${FUZZ_SANITIZER:-none}
FUZZ_ARGS=${FUZZ_ARGS:-}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
fuzz="$root/fuzz"
cd "$fuzz"

if ! "$CARGO" fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: installing cargo-fuzz (cargo install cargo-fuzz --locked)" >&2
    "$CARGO" install cargo-fuzz --locked
fi

# Sanitizers need rustc's -Zsanitizer, which stable rustc accepts only with
# RUSTC_BOOTSTRAP=1 (the stable toolchain ships the ASan runtime). `none` needs no
# unstable flag: coverage instrumentation (-Cpasses=sancov-module) is stable.
if [ "$FUZZ_SANITIZER" != none ]; then
    export RUSTC_BOOTSTRAP=1
fi

# -O: optimized; -a: keep debug assertions and overflow checks (an overflow is a
# finding, as it would panic in a debug build of the daemon).
build_flags=(--sanitizer "$FUZZ_SANITIZER" -O -a)

# libFuzzer flags per target.
target_args() {
    case "$1" in
        frame_decode) echo "-dict=$fuzz/dict/frames.dict -max_len=4096" ;;
        # Inputs are decoded into up to 64 actions; let them be long from the start.
        requests) echo "-max_len=1024 -len_control=0 -timeout=10" ;;
        *) echo "" ;;
    esac
}

echo "fuzz.sh: building ${FUZZ_TARGETS} ($("$CARGO" fuzz --version))" >&2
for t in $FUZZ_TARGETS; do
    "$CARGO" fuzz build "${build_flags[@]}" "$t"
done

mkdir -p "$fuzz/logs"
failed=()
summary=()
for t in $FUZZ_TARGETS; do
    # Replay the kept regression inputs first: each must run clean.
    if compgen -G "$fuzz/regressions/$t/*" >/dev/null; then
        mapfile -t regs < <(find "$fuzz/regressions/$t" -type f ! -name '*.md' | sort)
        if [ "${#regs[@]}" -gt 0 ]; then
            echo "fuzz.sh: $t: replaying ${#regs[@]} regression input(s)" >&2
            if ! "$CARGO" fuzz run "${build_flags[@]}" "$t" "${regs[@]}" -- -runs=1 \
                    >"$fuzz/logs/$t-regressions.log" 2>&1; then
                echo "fuzz.sh: $t: a regression input fails; see fuzz/logs/$t-regressions.log" >&2
                failed+=("$t (regressions)")
                continue
            fi
        fi
    fi

    corpus="$fuzz/corpus/$t"
    seeds="$fuzz/seeds/$t"
    mkdir -p "$corpus" "$seeds"
    log="$fuzz/logs/$t-$(date -u +%Y%m%dT%H%M%SZ).log"
    echo "fuzz.sh: $t: fuzzing for ${FUZZ_SECONDS}s (log: ${log#"$root"/})" >&2
    start=$(date +%s)
    # shellcheck disable=SC2046 # word splitting of the flag lists is intended
    if "$CARGO" fuzz run "${build_flags[@]}" "$t" "$corpus" "$seeds" -- \
            -max_total_time="$FUZZ_SECONDS" -print_final_stats=1 \
            $(target_args "$t") $FUZZ_ARGS >"$log" 2>&1; then
        result=ok
    else
        result=CRASH
        failed+=("$t")
    fi
    secs=$(( $(date +%s) - start ))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -1 || true)
    files=$(find "$corpus" -type f | wc -l)
    line="$t: $result after ${secs}s, ${execs:-?} executions, corpus ${files} files, ${cov:-cov ?}"
    summary+=("$line")
    echo "fuzz.sh: $line" >&2
    if [ "$result" = CRASH ]; then
        grep -E "panicked at|^SUMMARY|Test unit written to|ERROR: libFuzzer" "$log" | head -8 >&2 || true
    fi
done

echo "fuzz.sh: summary" >&2
for l in "${summary[@]}"; do echo "  $l" >&2; done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "fuzz.sh: FAILED: ${failed[*]} (inputs in fuzz/artifacts/, logs in fuzz/logs/)" >&2
    exit 1
fi
