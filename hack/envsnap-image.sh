#!/usr/bin/env bash
# Builds the DaemonSet's image (ghcr.io/envsnap/envsnap at the tag
# deploy/kubernetes/kustomization.yaml names) from deploy/image/Dockerfile
# with BuildKit (buildkitd and buildctl from make deps), as a user builds
# it, for tests/kube. Idempotent and cached: the OCI archive lands in
# .cache/image/<key>/envsnap.tar, where <key> hashes this script, the
# Dockerfile and the Go sources the binaries are built from.
# Prints that directory on its last line.
#
# The one departure from a user's build: the Dockerfile's base images
# (golang:<GO_VERSION>-bookworm, debian:bookworm-slim) are on Docker Hub,
# which this machine kind does not reach. Stand-ins are made here and given
# to the Dockerfile's FROM lines as BuildKit named contexts, the Dockerfile
# unchanged: Debian bookworm's minbase variant from Debian's packages
# (mmdebstrap; what debian:bookworm-slim is built from), and the same
# with this machine's Go toolchain in /usr/local/go (the golang image's
# layout and environment), and this machine's CA bundle, which the Go
# module proxy's certificate is checked against here. The build's RUN
# steps reach Debian's mirror and the Go module proxy on the host's
# network.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache="${IMAGE_CACHE:-$root/.cache/image}"
tools="${ENVSNAP_TOOLS:-$root/bin/tools}"
dockerfile="$root/deploy/image/Dockerfile"

for tool in buildkitd buildctl runc; do
	if [ ! -x "$tools/$tool" ]; then
		echo "envsnap-image: $tools/$tool missing (make deps installs it)" >&2
		exit 1
	fi
done
if [ "$(id -u)" -ne 0 ]; then
	echo "envsnap-image: need root (mmdebstrap, buildkitd)" >&2
	exit 1
fi
if ! command -v mmdebstrap >/dev/null; then
	echo "envsnap-image: apt-get install mmdebstrap" >&2
	# A private sticky TMPDIR for apt's sandbox user (hack/vm-image.sh
	# says why).
	apt_tmp=$(mktemp -d)
	chmod 1777 "$apt_tmp"
	TMPDIR=$apt_tmp apt-get update -qq
	TMPDIR=$apt_tmp DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
	rm -rf "$apt_tmp"
fi

# The golang stand-in must be the Go the Dockerfile asks for.
go_tag=$(sed -n 's/^ARG GO_VERSION=//p' "$dockerfile")
goroot=$(go env GOROOT)
go_have=$(go env GOVERSION)
case "$go_have" in
"go$go_tag" | "go$go_tag".*) ;;
*)
	echo "envsnap-image: the Dockerfile builds with Go $go_tag, this machine has $go_have" >&2
	exit 1
	;;
esac
tag=$(sed -n 's/^ *newTag: *//p' "$root/deploy/kubernetes/kustomization.yaml")
image="ghcr.io/envsnap/envsnap:$tag"

sources() {
	cd "$root"
	find cmd internal layerfmt snapshotter shim -name '*.go' ! -name '*_test.go' | LC_ALL=C sort
	echo go.mod go.sum deploy/image/Dockerfile deploy/image/Dockerfile.dockerignore
}
base_key=$( (cat "$0"; echo "$go_have") | sha256sum | cut -c1-16)
key=$( (cat "$0"; echo "$image"; cd "$root" && sources | xargs cat) | sha256sum | cut -c1-16)
out="$cache/$key"
if [ -f "$out/envsnap.tar" ]; then
	echo "$out"
	exit 0
fi

work=$(mktemp -d)
bk_pid=
cleanup() {
	if [ -n "$bk_pid" ]; then
		kill "$bk_pid" 2>/dev/null || true
		wait "$bk_pid" 2>/dev/null || true
	fi
	# Whatever buildkitd left mounted in its state, deepest first.
	findmnt -rn -o TARGET | grep "^$work/" | sort -r | xargs -r umount -l || true
	rm -rf "$work"
}
trap cleanup EXIT

# buildkitd's state lives as long as this build: kept, it would hold a few
# GiB of layers to save the half minute of the module download.
state="$work/buildkit"
mkdir -p "$cache"
addr="unix://$work/buildkitd.sock"
PATH="$tools:$PATH" "$tools/buildkitd" --root "$state" --addr "$addr" \
	--oci-worker=true --containerd-worker=false --oci-worker-net=host \
	>"$work/buildkitd.log" 2>&1 &
bk_pid=$!
for _ in $(seq 1 120); do
	"$tools/buildctl" --addr "$addr" debug workers >/dev/null 2>&1 && break
	if ! kill -0 "$bk_pid" 2>/dev/null; then
		echo "envsnap-image: buildkitd exited:" >&2
		cat "$work/buildkitd.log" >&2
		exit 1
	fi
	sleep 0.5
done
buildctl() { "$tools/buildctl" --addr "$addr" build --progress plain "$@" 2>"$work/build.log" || {
	tail -n 60 "$work/build.log" >&2
	echo "envsnap-image: buildctl build failed" >&2
	exit 1
}; }
# digest prints the image manifest's digest of an OCI layout directory.
digest() { sed -n 's/.*"digest":"\(sha256:[0-9a-f]*\)".*/\1/p' "$1/index.json" | head -1; }

base="$cache/base-$base_key"
if [ ! -f "$base/done" ]; then
	rm -rf "$base"
	mkdir -p "$base" "$work/debian" "$work/golang"
	echo "envsnap-image: Debian bookworm minbase (mmdebstrap)" >&2
	mmdebstrap --quiet --variant=minbase --skip=output/dev bookworm "$work/debian/rootfs.tar"
	printf '%s\n' 'FROM scratch' 'ADD rootfs.tar /' 'CMD ["bash"]' >"$work/debian/Dockerfile"
	buildctl --frontend dockerfile.v0 --local context="$work/debian" --local dockerfile="$work/debian" \
		--output "type=oci,dest=$base/debian,tar=false"
	echo "envsnap-image: the golang stand-in (Debian minbase, $go_have in /usr/local/go)" >&2
	# What the golang image adds to Debian for `go mod download` and
	# `go build`: CA certificates for the module proxy (the host's bundle,
	# as a build machine behind a TLS-inspecting proxy adds its CA), the
	# toolchain and its environment.
	cp /etc/ssl/certs/ca-certificates.crt "$work/golang/"
	cat >"$work/golang/Dockerfile" <<'EOF'
FROM debian
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=goroot / /usr/local/go
ENV GOPATH=/go PATH=/go/bin:/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
WORKDIR /go
EOF
	buildctl --frontend dockerfile.v0 --local context="$work/golang" --local dockerfile="$work/golang" \
		--local goroot="$goroot" --opt context:goroot=local:goroot \
		--oci-layout debian="$base/debian" --opt "context:debian=oci-layout://debian@$(digest "$base/debian")" \
		--output "type=oci,dest=$base/golang,tar=false"
	touch "$base/done"
fi

echo "envsnap-image: docker build -f deploy/image/Dockerfile -t $image . (BuildKit)" >&2
mkdir -p "$work/out"
start=$(date +%s)
buildctl --frontend dockerfile.v0 --local context="$root" --local dockerfile="$root/deploy/image" \
	--oci-layout golang="$base/golang" --oci-layout debian="$base/debian" \
	--opt "context:golang:$go_tag-bookworm=oci-layout://golang@$(digest "$base/golang")" \
	--opt "context:debian:bookworm-slim=oci-layout://debian@$(digest "$base/debian")" \
	--output "type=oci,dest=$work/out/envsnap.tar,name=$image"
echo "envsnap-image: built $image in $(($(date +%s) - start)) s" >&2
# Older builds go: only the newest image and the base are kept.
find "$cache" -mindepth 1 -maxdepth 1 -type d ! -name "base-$base_key" ! -name "$key" -exec rm -rf {} +
mkdir -p "$out"
install -m 0644 "$work/out/envsnap.tar" "$out/envsnap.tar"
echo "$image" >"$out/image"
echo "$out"
