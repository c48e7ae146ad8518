#!/usr/bin/env bash
# Installs what envsnap's tests need on a fresh Debian machine: Debian
# packages, then pinned tools built from the Go module proxy into a
# project-local bin dir. Idempotent: anything already present is skipped.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
tools="${TOOLS_BIN:-$root/bin/tools}"
mkdir -p "$tools"

CONTAINERD_VERSION=v2.4.2
RUNC_VERSION=v1.5.3
REGISTRY_VERSION=v3.1.2
CRITOOLS_VERSION=v1.37.0
KUSTOMIZE_VERSION=v5.7.1
BUILDKIT_VERSION=v0.34.2

# systemd: systemd-analyze verifies the shipped units (tests/deploy).
apt_pkgs=(fuse3 libseccomp-dev busybox-static zstd iproute2 pkg-config systemd)
missing=()
for p in "${apt_pkgs[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	echo "deps: apt-get install ${missing[*]}"
	if [ "$(id -u)" -ne 0 ]; then
		echo "deps: need root to install Debian packages" >&2
		exit 1
	fi
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# install NAME VERSION PKG [go build flags...]: builds PKG@VERSION into $tools
# unless $tools/NAME already reports VERSION (recorded in NAME.version).
install_tool() {
	local name=$1 version=$2 pkg=$3
	shift 3
	if [ -x "$tools/$name" ] && [ "$(cat "$tools/$name.version" 2>/dev/null)" = "$version" ]; then
		return 0
	fi
	echo "deps: go install $pkg@$version -> $tools/$name"
	GOBIN="$tools" GOFLAGS=-buildvcs=false go install "$@" "$pkg@$version"
	echo "$version" >"$tools/$name.version"
}

install_tool containerd "$CONTAINERD_VERSION" github.com/containerd/containerd/v2/cmd/containerd -tags "no_btrfs no_devmapper no_zfs"
install_tool ctr "$CONTAINERD_VERSION" github.com/containerd/containerd/v2/cmd/ctr
install_tool containerd-shim-runc-v2 "$CONTAINERD_VERSION" github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2
CGO_ENABLED=1 install_tool runc "$RUNC_VERSION" github.com/opencontainers/runc -tags seccomp
install_tool registry "$REGISTRY_VERSION" github.com/distribution/distribution/v3/cmd/registry
install_tool crictl "$CRITOOLS_VERSION" sigs.k8s.io/cri-tools/cmd/crictl
install_tool kustomize "$KUSTOMIZE_VERSION" sigs.k8s.io/kustomize/kustomize/v5

# BuildKit cannot be `go install`ed: its go.mod has an `exclude` directive,
# which `go install pkg@version` refuses. Build inside the module directory
# that `go mod download` fetched instead (its own go.mod then applies).
# buildkitd's runc worker needs a seccomp-enabled runc (built above).
install_module_cmds() {
	local version=$1 module=$2
	shift 2
	local name stale=
	for name in "$@"; do
		if ! [ -x "$tools/$name" ] || [ "$(cat "$tools/$name.version" 2>/dev/null)" != "$version" ]; then
			stale=1
		fi
	done
	[ -z "$stale" ] && return 0
	local dir
	dir=$(go mod download -json "$module@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
	if [ -z "$dir" ] || ! [ -d "$dir" ]; then
		echo "deps: go mod download $module@$version: no module directory" >&2
		exit 1
	fi
	echo "deps: go build $* from $module@$version -> $tools"
	for name in "$@"; do
		(cd "$dir" && GOFLAGS=-buildvcs=false go build -o "$tools/$name" "./cmd/$name")
		echo "$version" >"$tools/$name.version"
	done
}

install_module_cmds "$BUILDKIT_VERSION" github.com/moby/buildkit buildkitd buildctl
echo "deps: ok ($tools)"
