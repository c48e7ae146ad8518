#!/bin/bash
# Usage: run.sh REPO
# Scores an episode: runs the repository's own tests offline (-count=1, so
# a cached pass from earlier in the episode does not count) and prints
# reward=1 when they pass, reward=0 otherwise; the exit code says the same.
set -u
. /opt/evaluator/env.sh
repo=${1:?usage: run.sh REPO}
cd "$repo" || { echo "reward=0"; exit 1; }
start=$(date +%s.%N)
if go test -count=1 ./... 2>&1; then
	reward=1
else
	reward=0
fi
echo "evaluator seconds=$(echo "$(date +%s.%N) $start" | awk '{printf "%.3f", $1-$2}')"
echo "reward=$reward"
[[ $reward == 1 ]]
