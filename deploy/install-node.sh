#!/bin/sh
# install-node.sh puts the host-side pieces of envsnap on a node: the shim
# binary containerd runs for the "envlet" runtime, the containerd-envsnap
# binary the descriptor keeper runs from as a host service (so it outlives
# the DaemonSet pod), the shim's configuration, and the containerd drop-in
# that registers the snapshotter and the runtime.
#
# The Kubernetes DaemonSet runs it as an init container with the host's
# directories mounted below HOST_ROOT=/host; on a plain host run it with
# HOST_ROOT=/ after copying the files next to it.
#
# It never restarts containerd and never edits the main containerd config:
# containerd reads the drop-in only when it starts, and a restart of the
# runtime under every pod of the node is the operator's decision
# (docs/kubernetes.md). It exits non-zero only when a file cannot be written.
# A missing `imports` line is reported, and ENVSNAP_CREATE_MAIN_CONFIG=true
# writes a minimal main config when there is none at all.
#
# Variables (defaults are the DaemonSet's paths):
#   HOST_ROOT              where the host's / is mounted (/host)
#   ENVSNAP_SHIM           shim binary to install (/usr/local/bin/containerd-shim-envlet-v2)
#   ENVSNAP_DAEMON         containerd-envsnap binary to install (/usr/local/bin/containerd-envsnap)
#   ENVSNAP_DROPIN         containerd drop-in to install (/config/containerd-envsnap.toml)
#   ENVSNAP_ENVLET_CONFIG  shim configuration to install (/config/envlet.toml)
#   ENVSNAP_CREATE_MAIN_CONFIG  "true": create /etc/containerd/config.toml
#                          with only the imports line when the host has none
set -eu

HOST_ROOT=${HOST_ROOT:-/host}
ENVSNAP_SHIM=${ENVSNAP_SHIM:-/usr/local/bin/containerd-shim-envlet-v2}
ENVSNAP_DAEMON=${ENVSNAP_DAEMON:-/usr/local/bin/containerd-envsnap}
ENVSNAP_DROPIN=${ENVSNAP_DROPIN:-/config/containerd-envsnap.toml}
ENVSNAP_ENVLET_CONFIG=${ENVSNAP_ENVLET_CONFIG:-/config/envlet.toml}
ENVSNAP_CREATE_MAIN_CONFIG=${ENVSNAP_CREATE_MAIN_CONFIG:-false}

host() { printf '%s%s' "${HOST_ROOT%/}" "$1"; }
say() { printf 'envsnap-install: %s\n' "$*"; }

# install_file SRC DEST MODE: replaces DEST atomically (write beside it,
# then rename) and only when the content differs. Renaming over the shim
# binary is what makes upgrading it safe while shims run: they keep the old
# inode, and writing into a running executable would fail with ETXTBSY.
# Sets changed=true when it replaced DEST. (No command substitution: set -e
# does not stop a script for a failure inside one used in a test.)
install_file() {
	src=$1 dest=$2 mode=$3
	changed=false
	if [ -f "$dest" ] && cmp -s "$src" "$dest"; then
		return 0
	fi
	mkdir -p "$(dirname "$dest")"
	tmp="$(dirname "$dest")/.$(basename "$dest").envsnap-tmp.$$"
	cp "$src" "$tmp"
	chmod "$mode" "$tmp"
	mv -f "$tmp" "$dest"
	changed=true
}

for f in "$ENVSNAP_SHIM" "$ENVSNAP_DAEMON" "$ENVSNAP_DROPIN" "$ENVSNAP_ENVLET_CONFIG"; do
	if [ ! -f "$f" ]; then
		say "missing $f"
		exit 1
	fi
done

install_file "$ENVSNAP_SHIM" "$(host /usr/local/bin/containerd-shim-envlet-v2)" 0755
if [ "$changed" = true ]; then
	say "installed /usr/local/bin/containerd-shim-envlet-v2 (new pods use it; running pods keep their shim)"
fi
# The keeper the snapshotter launches on the host (its --keeper-command)
# runs this binary; a running keeper keeps the inode it started from.
install_file "$ENVSNAP_DAEMON" "$(host /usr/local/bin/containerd-envsnap)" 0755
if [ "$changed" = true ]; then
	say "installed /usr/local/bin/containerd-envsnap (the descriptor keeper runs from it on the host)"
fi
install_file "$ENVSNAP_ENVLET_CONFIG" "$(host /etc/envsnap/envlet.toml)" 0644
if [ "$changed" = true ]; then
	say "installed /etc/envsnap/envlet.toml (read by each shim when it starts: applies to new pods)"
fi
install_file "$ENVSNAP_DROPIN" "$(host /etc/containerd/conf.d/envsnap.toml)" 0644
dropin_changed=$changed
if [ "$changed" = true ]; then
	say "installed /etc/containerd/conf.d/envsnap.toml"
fi

# containerd follows only the imports its config files list; its built-in
# default of /etc/containerd/conf.d/*.toml applies to nothing when there is
# no config file, and a config.toml without the line ignores conf.d.
main=$(host /etc/containerd/config.toml)
import_ok=false
if [ -f "$main" ]; then
	if grep -Eq '^[[:space:]]*imports[[:space:]]*=.*(/etc/containerd/conf\.d/(\*|envsnap)\.toml|conf\.d/\*\.toml)' "$main"; then
		import_ok=true
	fi
elif [ "$ENVSNAP_CREATE_MAIN_CONFIG" = true ]; then
	mkdir -p "$(dirname "$main")"
	# With a config file present containerd still starts from its built-in
	# defaults and merges the file over them, so this changes nothing but
	# the imports.
	printf '%s\n' 'version = 3' 'imports = ["/etc/containerd/conf.d/*.toml"]' >"$main.envsnap-tmp.$$"
	mv -f "$main.envsnap-tmp.$$" "$main"
	say "created /etc/containerd/config.toml importing /etc/containerd/conf.d/*.toml"
	import_ok=true
	dropin_changed=true
fi
if [ "$import_ok" != true ]; then
	say "WARNING: /etc/containerd/config.toml does not import /etc/containerd/conf.d/*.toml;"
	say "WARNING: add this line at its top (before any [table]) and restart containerd:"
	say 'WARNING:   imports = ["/etc/containerd/conf.d/*.toml"]'
fi

if [ "$dropin_changed" = true ]; then
	say "containerd must be restarted on this node to load the drop-in (systemctl restart containerd);"
	say "running containers survive it. Then label the node: kubectl label node <node> envsnap.io/envlet=ready"
else
	say "up to date"
fi
