#!/bin/bash
# Runs inside the base rootfs (chroot, no network) with the task group's
# overlay on top: gives /workspace/NAME a git history, warms the build cache
# with the toolchain the base ships, and turns candidate mutations into bug
# patches that the repository's own tests catch.
#
# Usage: build-task.sh NAME MODULE VERSION MUTATIONS.tsv
set -euo pipefail
# Exactly the evaluator's environment: test results are cached keyed on
# the environment variables tests read (PATH, for one), so the warm cache
# only hits at evaluation time when both agree.
. /mnt/workload/evaluator/env.sh
name=$1 module=$2 version=$3 mutations=$4
repo=/workspace/$name
tasks=/opt/tasks/$name

# Fixed identities and dates: the same inputs give the same commits.
export GIT_AUTHOR_NAME="envsnap bench" GIT_AUTHOR_EMAIL="bench@envsnap.invalid"
export GIT_COMMITTER_NAME="$GIT_AUTHOR_NAME" GIT_COMMITTER_EMAIL="$GIT_AUTHOR_EMAIL"
git() { command git -c init.defaultBranch=main -c core.fileMode=true "$@"; }

say() { echo "[build-task $name] $*" >&2; }
cd "$repo"

# One full test run offline: proves the module cache is complete, adds any
# go.sum lines the tests need (from the local cache) and fills GOCACHE.
say "go $(go env GOVERSION): go test ./... (warming the build cache)"
if ! timeout 600 go test ./... >/tmp/test-base.log 2>&1; then
	cat /tmp/test-base.log >&2
	say "tests fail on the unmodified repository"
	exit 1
fi

say "git history"
git init -q
git add -A
GIT_AUTHOR_DATE=2024-01-01T00:00:00Z GIT_COMMITTER_DATE=2024-01-01T00:00:00Z \
	git commit -q -m "Import $module $version from the Go module proxy"
readme=$(ls README* 2>/dev/null | head -1 || true)
readme=${readme:-README.md}
cat >>"$readme" <<EOF

## Working on this checkout

Run the tests offline with \`go test ./...\`; module dependencies are in the
module cache and the build cache is warm.
EOF
git add "$readme"
GIT_AUTHOR_DATE=2024-01-02T00:00:00Z GIT_COMMITTER_DATE=2024-01-02T00:00:00Z \
	git commit -q -m "docs: how to run the tests in this checkout"

# Mutation runs use a copy of the warm cache so the group's cache holds
# only what the unmodified repository builds.
cp -a /root/.cache/go-build /tmp/gocache-mut
kept=0
while IFS=$'\t' read -r id file expr; do
	[[ -z $id || $id == \#* ]] && continue
	if ! perl -0pi -e "$expr" "$file" || git diff --quiet; then
		say "$id: expression did not change $file, dropped"
		git checkout -q -- .
		continue
	fi
	mkdir -p "$tasks/$id"
	git diff >"$tasks/$id/bug.diff"
	git diff -R >"$tasks/$id/fix.diff"
	if GOCACHE=/tmp/gocache-mut timeout 600 go test ./... >"/tmp/test-$id.log" 2>&1; then
		say "$id: tests still pass with the bug, dropped"
		rm -rf "${tasks:?}/$id"
	else
		# A failing test is what makes the patch a task: say so plainly,
		# the failures themselves only with build.sh -v.
		say "$id: bug patch kept (the repository's tests catch it)"
		if [[ ${BUILD_VERBOSE:-0} == 1 ]]; then
			grep -E -m 4 -- '^(--- FAIL|FAIL|panic:|.*\.go:[0-9]+:[0-9]+: )' "/tmp/test-$id.log" | sed "s/^/[build-task $name]   /" >&2 || true
		fi
		kept=$((kept + 1))
	fi
	git checkout -q -- .
	git clean -qfd
done <"$mutations"

# Both patches must apply to the committed tree in the right order.
for d in "$tasks"/*/; do
	git apply --check "$d/bug.diff"
	git apply "$d/bug.diff"
	git apply --check "$d/fix.diff"
	git apply "$d/fix.diff"
	git diff --quiet
done
git status --porcelain | grep -q . && {
	say "working tree not clean after mutation checks"
	exit 1
}
say "$kept tasks"
[[ $kept -gt 0 ]]
