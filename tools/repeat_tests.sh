#!/usr/bin/env bash
# Run `make test` N times in a fresh clone of this checkout's HEAD and print each run's result and time:
# "the suite passes N times in a row" is then something anyone can check, on a clean tree, without this
# checkout's venv, caches or untracked files. The first run includes `make`'s set-up of .venv (it needs
# PyPI; PIP_ARGS in the environment is passed on to make). The clone is kept (its path is printed) with
# one log per run.
#
#   tools/repeat_tests.sh 5
#
# Exit status: 0 if every run passed, 1 otherwise.
set -u

runs=${1:-5}
case $runs in
    '' | *[!0-9]* | 0) echo "usage: $0 N   (N >= 1 runs of make test)" >&2; exit 2 ;;
esac

repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel) || exit 2
commit=$(git -C "$repo" rev-parse HEAD) || exit 2
clone=$(mktemp -d "${TMPDIR:-/tmp}/polytrain-repeat.XXXXXX")
git clone --quiet --no-hardlinks "$repo" "$clone" && git -C "$clone" checkout --quiet "$commit" || exit 2
echo "clone of ${commit:0:12} in $clone; $runs runs of make test"

failed=0
for i in $(seq 1 "$runs"); do
    log="$clone/run-$i.log"
    start=$(date +%s)
    make -C "$clone" test >"$log" 2>&1
    status=$?
    seconds=$(( $(date +%s) - start ))
    summary=$(grep -E '(passed|failed|error|no tests ran).* in [0-9.]+s' "$log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
    if [ "$status" -eq 0 ]; then verdict=PASS; else verdict="FAIL (exit $status)"; failed=$((failed + 1)); fi
    printf 'run %d/%d: %s in %d s: %s  (%s)\n' "$i" "$runs" "$verdict" "$seconds" "${summary:-no pytest summary}" "$log"
done

echo "$((runs - failed)) of $runs runs passed"
[ "$failed" -eq 0 ]
