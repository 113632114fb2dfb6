#!/usr/bin/env bash
# Fails when `make test` (or `make venv`) would run pip outside the project's own
# virtual environment (target/venv). Debian's and Ubuntu's system Python refuse
# `pip install` (PEP 668), so the README's test command must never reach it.
#
# It reads the commands make would run (`make -n -B`, nothing is executed) and
# checks that every pip call goes through target/venv/bin, that the environment is
# made with `-m venv`, and that the Makefile exports PIP_REQUIRE_VIRTUALENV=true so
# a pip call outside a virtual environment fails at run time as well.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv="$root/target/venv/bin/"

fail=0
commands=$(make --no-print-directory -n -B test venv)

# Every line that runs pip, in any spelling.
pip_lines=$(grep -E '(^|[[:space:]/])pip3?([[:space:]]|$)|-m[[:space:]]+pip([[:space:]]|$)|ensurepip' <<<"$commands" || true)
if [ -z "$pip_lines" ]; then
    echo "check-make-pip: make -n test installs nothing with pip; this check is out of date" >&2
    fail=1
fi
while IFS= read -r line; do
    [ -z "$line" ] && continue
    case "$line" in
        "$venv"python*" -m pip "* | "$venv"pip*) ;;
        *)
            echo "check-make-pip: pip outside target/venv: $line" >&2
            fail=1
            ;;
    esac
done <<<"$pip_lines"

# A Python other than the environment's runs only to make the environment.
while IFS= read -r line; do
    [ -z "$line" ] && continue
    first=${line%% *}
    case "$first" in
        python*|*/python*) ;;
        *) continue ;;
    esac
    case "$line" in
        "$venv"python*) ;;
        *" -m venv $root/target/venv") ;;
        *)
            echo "check-make-pip: Python outside target/venv: $line" >&2
            fail=1
            ;;
    esac
done <<<"$commands"

if [ "$(env -u PIP_REQUIRE_VIRTUALENV make --no-print-directory -s print-env-PIP_REQUIRE_VIRTUALENV)" != "true" ]; then
    echo "check-make-pip: the Makefile must export PIP_REQUIRE_VIRTUALENV=true" >&2
    fail=1
fi

if [ "$fail" -ne 0 ]; then
    exit 1
fi
echo "check-make-pip: make test installs Python packages only into target/venv"
