#!/bin/bash
# Usage: episode.sh REPO FIX.diff
# A scripted agent episode: start the harness, look around the repository,
# run the failing tests, apply the fix, test again, show the diff, then
# score with the evaluator. Each step prints
#   episode step=NAME rc=N seconds=S
# so a benchmark can time the phases; the last line is reward=N.
set -u
. /opt/evaluator/env.sh
repo=${1:?usage: episode.sh REPO FIX.diff}
fix=${2:?usage: episode.sh REPO FIX.diff}

now() { date +%s.%N; }
episode_start=$(now)
step() {
	local name=$1 t0 rc
	shift
	t0=$(now)
	"$@"
	rc=$?
	echo "episode step=$name rc=$rc seconds=$(echo "$(now) $t0" | awk '{printf "%.3f", $1-$2}')"
	return 0
}
# Files the fix touches: what an agent ends up reading after a few greps.
touched=$(sed -n 's#^+++ b/##p' "$fix")

step harness-version agent --version
cd "$repo" || exit 1
step git-status git status
step git-log git log --oneline -5
step list-files git ls-files
step grep-funcs grep -rn --include='*.go' -m 3 '^func ' .
step read-files cat README* go.mod $touched
step test-before go test ./...
step apply-fix git apply "$fix"
step test-after go test ./...
step git-diff git diff
echo "episode step=total-before-eval rc=0 seconds=$(echo "$(now) $episode_start" | awk '{printf "%.3f", $1-$2}')"
/opt/evaluator/run.sh "$repo"
