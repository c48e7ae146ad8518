#!/usr/bin/env bash
# Builds the one-node Kubernetes cluster of the test bed (tests/kube) from
# the Go module proxy: the control plane (kube-apiserver,
# kube-controller-manager, kube-scheduler), kubectl and kubelet from
# k8s.io/kubernetes, etcd from go.etcd.io/etcd/server/v3, and the CNI
# plugins the node's pod network uses (bridge, host-local, loopback) from
# github.com/containernetworking/plugins under cni/. Idempotent
# and cached like the guest image (hack/vm-image.sh): the binaries land in
# .cache/kube/<key>/ where <key> hashes this script, the Go version and the
# pinned versions, so an unchanged recipe costs nothing. Prints the binary
# directory on its last line.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache="${KUBE_CACHE:-$root/.cache/kube}"

KUBERNETES_VERSION=v1.37.2
# The staging modules (k8s.io/api, k8s.io/client-go, ...) are published
# with the same minor at major 0.
STAGING_VERSION=v0.37.2
ETCD_VERSION=v3.7.3
CNI_PLUGINS_VERSION=v1.10.0

key=$( (cat "$0"; go version) | sha256sum | cut -c1-16)
out="$cache/$KUBERNETES_VERSION-$key"
if [ -f "$out/done" ]; then
	echo "$out"
	exit 0
fi

# modfile DIR VERSION: a copy of DIR's go.mod (in a temp dir, since the
# module cache is read-only) whose replace directives into the module's own
# tree (k8s.io/kubernetes' ./staging/src/..., etcd's ../api, ...) name the
# published module at VERSION instead: a module zip from the proxy holds no
# nested modules, so those directories are not there.
modfile() {
	local dir=$1 version=$2 tmp
	tmp=$(mktemp -d "$work/mod.XXXXXX")
	sed -E "s#^([[:space:]]*)([^[:space:]]+)[[:space:]]+=>[[:space:]]+\.\.?/[^[:space:]]*\$#\1\2 => \2 $version#" \
		"$dir/go.mod" >"$tmp/go.mod"
	cp "$dir/go.sum" "$tmp/go.sum"
	chmod u+w "$tmp/go.mod" "$tmp/go.sum"
	echo "$tmp/go.mod"
}

moddir() {
	local dir
	dir=$(go mod download -json "$1@$2" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
	if [ -z "$dir" ] || ! [ -d "$dir" ]; then
		echo "kube: go mod download $1@$2: no module directory" >&2
		exit 1
	fi
	echo "$dir"
}

echo "kube: building Kubernetes $KUBERNETES_VERSION and etcd $ETCD_VERSION into $out" >&2
start=$(date +%s)
mkdir -p "$cache"
rm -rf "$out"
work=$(mktemp -d "$cache/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir "$work/bin"

# Static binaries: kubelet runs in the qemu guest, whose libc is not the
# host's.
export CGO_ENABLED=0 GOWORK=off GOFLAGS="${GOFLAGS:-} -buildvcs=false"

kdir=$(moddir k8s.io/kubernetes "$KUBERNETES_VERSION")
kmod=$(modfile "$kdir" "$STAGING_VERSION")
# The version stamp hack/lib/version.sh sets in a release build; kubelet
# and the apiserver compare them (version skew) and report them.
minor=${KUBERNETES_VERSION#v1.}
minor=${minor%%.*}
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	ldflags+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
	ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
(cd "$kdir" && go mod download -modfile="$kmod" >&2)
# One go build for all of them: they share most packages, and it links
# them in parallel.
t0=$(date +%s)
(cd "$kdir" && go build -mod=mod -modfile="$kmod" -trimpath -ldflags "$ldflags" -o "$work/bin/" \
	./cmd/kube-apiserver ./cmd/kube-controller-manager ./cmd/kube-scheduler ./cmd/kubectl ./cmd/kubelet)
echo "kube: Kubernetes built in $(($(date +%s) - t0))s" >&2

edir=$(moddir go.etcd.io/etcd/server/v3 "$ETCD_VERSION")
emod=$(modfile "$edir" "$ETCD_VERSION")
t0=$(date +%s)
(cd "$edir" && go build -mod=mod -modfile="$emod" -trimpath -ldflags "-s -w" -o "$work/bin/etcd" .)
echo "kube: etcd built in $(($(date +%s) - t0))s" >&2

cdir=$(moddir github.com/containernetworking/plugins "$CNI_PLUGINS_VERSION")
mkdir "$work/bin/cni"
for plugin in main/bridge ipam/host-local main/loopback; do
	(cd "$cdir" && go build -mod=mod -modfile="$(modfile "$cdir" "$CNI_PLUGINS_VERSION")" -trimpath -ldflags "-s -w" \
		-o "$work/bin/cni/${plugin#*/}" "./plugins/$plugin")
done

mv "$work/bin" "$out"
echo "$KUBERNETES_VERSION etcd $ETCD_VERSION cni-plugins $CNI_PLUGINS_VERSION" >"$out/version"
touch "$out/done"
# Older builds are dead weight.
find "$cache" -mindepth 1 -maxdepth 1 -type d ! -name "$(basename "$out")" ! -name 'build.*' -exec rm -rf {} + 2>/dev/null || true
echo "kube: built in $(($(date +%s) - start))s" >&2
echo "$out"
