#!/usr/bin/env bash
# Runs every Fuzz target in the module for a budget each: an execution count
# (default 50000x) or a duration (30s).
# Each target runs alone because `go test -fuzz` accepts one target at a time.
set -euo pipefail
fuzztime=${1:-50000x}
cd "$(dirname "$0")/.."
found=0
for pkg in $(go list ./...); do
	dir=$(go list -f '{{.Dir}}' "$pkg")
	for target in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go 2>/dev/null | sed 's/^func //'); do
		found=1
		echo "fuzz: $pkg $target ($fuzztime)"
		go test -run='^$' -fuzz="^${target}\$" -fuzztime="$fuzztime" "$pkg"
	done
done
[ "$found" = 1 ] || echo "fuzz: no targets"
