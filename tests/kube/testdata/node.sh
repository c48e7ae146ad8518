#!/bin/bash
# The Kubernetes node of tests/kube, run by vmtest.service (hack/vm-image.sh)
# in the qemu guest: systemd, cgroup v2 unified. It brings up the guest's
# side of qemu's user-mode network (the host's loopback is 10.0.2.2), installs
# containerd, runc, the CNI plugins and kubelet from the share (/mnt/host),
# and starts kubelet joined to the API server on the host. envsnap comes
# one of two ways (INSTALL in node.env): "systemd", the shipped units
# (deploy/systemd) and containerd drop-ins installed here; "daemonset",
# nothing of envsnap on the node but the systemd-cgroup drop-in (the
# operator's step for the systemd driver) and the DaemonSet's image
# imported into containerd, as a node whose image registry holds it: the
# host applies the DaemonSet, whose installer puts the rest on the node. It then waits until the host writes $S/stop, and powers off (the
# unit's ExecStopPost). Lines "KUBETEST: ..." on the serial console are for
# the host; nothing here is timed.
set -u
S=/mnt/host
T0=$(date +%s)
log() { echo "KUBETEST: LOG [$(($(date +%s) - T0))s] $*"; }
die() {
	echo "KUBETEST: FAIL $*"
	journalctl --no-pager -u containerd -u kubelet -u containerd-envsnap -u envsnap-arbiter | tail -n 80 | sed 's/^/KUBETEST: JOURNAL /'
	exit 0
}
# wait_for SECONDS CMD...: polls CMD every 0.5 s.
wait_for() {
	local until=$(($(date +%s) + $1))
	shift
	while ! "$@"; do
		[ "$(date +%s)" -ge "$until" ] && return 1
		sleep 0.5
	done
}
INSTALL=systemd
. "$S"/node.env # API_SERVER, REGISTRY, INSTALL

echo "KUBETEST: START kernel=$(uname -r) cgroupfs=$(stat -fc %T /sys/fs/cgroup)"

# --- qemu user-mode network: the guest is 10.0.2.15, the gateway 10.0.2.2
# is the host's loopback ---
modprobe -a virtio_net bridge br_netfilter veth 2>/dev/null
dev=
wait_for 30 sh -c 'ls /sys/class/net | grep -qv "^lo$"' || die "no network device"
dev=$(ls /sys/class/net | grep -v '^lo$' | grep -v '^cni' | head -1)
ip link set lo up
ip link set "$dev" up
ip addr add 10.0.2.15/24 dev "$dev"
ip route add default via 10.0.2.2
log "network: $dev $(ip -4 -o addr show dev "$dev" | awk '{print $4}')"
wait_for 30 bash -c "exec 3<>/dev/tcp/${API_SERVER%:*}/${API_SERVER#*:}" 2>/dev/null || die "API server $API_SERVER not reachable from the guest"

# --- binaries and configs ---
for f in "$S"/bin/*; do
	case "$INSTALL:${f##*/}" in
	daemonset:containerd-envsnap | daemonset:containerd-shim-envlet-v2) ;; # the installer's
	*) install -m 0755 "$f" /usr/local/bin/ ;;
	esac
done
mkdir -p /opt/cni/bin /etc/cni/net.d
install -m 0755 "$S"/cni/* /opt/cni/bin/
# One bridge for the pods, inside the guest only; no masquerading (the
# test's pods talk to nothing off the node).
cat >/etc/cni/net.d/10-pods.conflist <<'EOF'
{"cniVersion": "1.0.0", "name": "pods", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.88.0.0/16"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "loopback"}]}
EOF
mkdir -p /etc/containerd/conf.d "/etc/containerd/certs.d/$REGISTRY"
units="containerd kubelet"
if [ "$INSTALL" = systemd ]; then
	cp "$S"/deploy/systemd/containerd-envsnap.service "$S"/deploy/systemd/envsnap-arbiter.service /etc/systemd/system/
	mkdir -p /etc/envsnap
	# The shipped daemon config, with background fill off: the host counts
	# the bytes the registry served to tell a lazy pull from a full one.
	sed 's/^fill = true/fill = false/' "$S"/deploy/envsnap/config.toml >/etc/envsnap/config.toml
	cp "$S"/envlet.toml /etc/envsnap/envlet.toml
	cp "$S"/deploy/containerd/envsnap.toml /etc/containerd/conf.d/
	units="envsnap-arbiter containerd-envsnap $units"
fi
cp "$S"/deploy/containerd/systemd-cgroup.toml /etc/containerd/conf.d/
cat >"/etc/containerd/certs.d/$REGISTRY/hosts.toml" <<EOF
server = "http://$REGISTRY"
[host."http://$REGISTRY"]
  capabilities = ["pull", "resolve"]
EOF
cat >/etc/containerd/config.toml <<EOF
version = 3
imports = ["/etc/containerd/conf.d/*.toml"]
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "$REGISTRY/kube/pause:1"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "/etc/containerd/certs.d"
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
    SystemdCgroup = true
EOF
cat >/etc/systemd/system/containerd.service <<'EOF'
[Unit]
Description=containerd container runtime
After=local-fs.target
[Service]
ExecStartPre=-/sbin/modprobe overlay
ExecStart=/usr/local/bin/containerd
Type=notify
Delegate=yes
KillMode=process
Restart=always
RestartSec=5
LimitNPROC=infinity
LimitCORE=infinity
TasksMax=infinity
OOMScoreAdjust=-999
[Install]
WantedBy=multi-user.target
EOF

# kubelet: systemd cgroup driver (cgroup v2), the host's API server through
# qemu's gateway.
mkdir -p /etc/kubernetes/pki /var/lib/kubelet
cp "$S"/kube/ca.crt "$S"/kube/kubelet.crt "$S"/kube/kubelet.key /etc/kubernetes/pki/
cp "$S"/kube/kubelet.conf /etc/kubernetes/kubelet.conf
cp "$S"/kube/kubelet.yaml /etc/kubernetes/kubelet.yaml
cat >/etc/systemd/system/kubelet.service <<'EOF'
[Unit]
Description=kubelet
After=containerd.service
Wants=containerd.service
[Service]
ExecStart=/usr/local/bin/kubelet --config=/etc/kubernetes/kubelet.yaml --kubeconfig=/etc/kubernetes/kubelet.conf --node-ip=10.0.2.15 --v=2
Restart=always
RestartSec=5
[Install]
WantedBy=multi-user.target
EOF

systemctl daemon-reload
cri_up() { wait_for 120 sh -c '/usr/local/bin/crictl --runtime-endpoint unix:///run/containerd/containerd.sock info >/dev/null 2>&1'; }
systemctl enable --quiet $units
systemctl start ${units% kubelet} || die "systemctl start ${units% kubelet}"
cri_up || die "containerd's CRI did not answer"
if [ "$INSTALL" = daemonset ]; then
	ctr -n k8s.io images import "$S"/envsnap-image.tar >/dev/null || die "ctr images import the DaemonSet's image"
	log "imported $(ctr -n k8s.io images ls -q | grep envsnap)"
fi
systemctl start kubelet || die "systemctl start kubelet"
log "containerd $(containerd --version | cut -d' ' -f3), kubelet $(kubelet --version | cut -d' ' -f2) started"
echo "KUBETEST: READY"

# Until the host is done with the node. When it asks (kubelet-no-gate),
# kubelet is restarted without RuntimeClassInImageCriApi.
while ! [ -e "$S"/stop ]; do
	if [ -e "$S"/kubelet-no-gate ] && ! [ -e /run/kubelet-no-gate ]; then
		touch /run/kubelet-no-gate
		sed -i '/^featureGates:/,$d' /etc/kubernetes/kubelet.yaml
		systemctl restart kubelet
		echo "KUBETEST: EVENT kubelet-no-gate"
	fi
	# kubelet's memory eviction threshold above envlet's reserve.
	if [ -e "$S"/kubelet-evict-early ] && ! [ -e /run/kubelet-evict-early ]; then
		touch /run/kubelet-evict-early
		sed -i 's/^  memory.available: .*/  memory.available: "2Gi"/' /etc/kubernetes/kubelet.yaml
		systemctl restart kubelet
		echo "KUBETEST: EVENT kubelet-evict-early"
	fi
	# envlet's node budget and cap back to the shipped defaults (the whole
	# machine; 32Gi, so the node bounds a pod without limits).
	if [ -e "$S"/envlet-node-default ] && ! [ -e /run/envlet-node-default ]; then
		touch /run/envlet-node-default
		sed -i '/^memory = "512Mi"$/d; /^cap-memory = /d' /etc/envsnap/envlet.toml
		systemctl restart envsnap-arbiter
		wait_for 60 /usr/local/bin/containerd-envsnap envs --socket /run/envsnap/arbiter.sock >/dev/null 2>&1 || log "arbiter did not answer after its restart"
		log "envlet config: $(tr '\n' ' ' </etc/envsnap/envlet.toml); MemTotal $(awk '/^MemTotal/ {print $2 " " $3}' /proc/meminfo)"
		echo "KUBETEST: EVENT envlet-node-default"
	fi
	# The DaemonSet's installer has written the drop-in: containerd loads
	# it when restarted (the operator's step, docs/kubernetes.md).
	if [ -e "$S"/restart-containerd ] && ! [ -e /run/restart-containerd ]; then
		touch /run/restart-containerd
		log "installed by the DaemonSet: $(ls /etc/containerd/conf.d /usr/local/bin | tr '\n' ' ')"
		systemctl restart containerd
		cri_up || log "containerd's CRI did not answer after its restart"
		echo "KUBETEST: EVENT restart-containerd"
	fi
	# What the snapshotter serves, for the host (each ask writes a new file).
	for f in "$S"/status-*; do
		[ -e "$f" ] && [ "${f%.out}" = "$f" ] && ! [ -e "/run/${f##*/}" ] || continue
		touch "/run/${f##*/}"
		/usr/local/bin/containerd-envsnap status >"$f.out" 2>&1
		echo "KUBETEST: EVENT ${f##*/}"
	done
	# The snapshotter pod's log and the descriptor keeper's unit, for the
	# host (kubelet's log endpoint is not reachable from it).
	for f in "$S"/logs-*; do
		[ -e "$f" ] && [ "${f%.out}" = "$f" ] && ! [ -e "/run/${f##*/}" ] || continue
		touch "/run/${f##*/}"
		{
			for l in /var/log/pods/envsnap-system_*/*/*.log; do
				[ -e "$l" ] && echo "== $l" && tail -n 40 "$l"
			done
			echo "== kubelet and containerd on the DaemonSet's containers"
			journalctl --no-pager -u kubelet -u containerd | grep -e containerd-envsnap -e 'Killing' -e 'probe' -e 'level=error' | grep -v 'level=debug' | tail -n 40
			echo "== envsnap-fdstore"
			systemctl status --no-pager envsnap-fdstore 2>&1 | head -n 5
			journalctl --no-pager -u envsnap-fdstore | tail -n 30
		} >"$f.out" 2>&1
		echo "KUBETEST: EVENT ${f##*/}"
	done
	# The last two minutes of the node's daemons, when a step failed and the
	# host wants to know why (each ask writes a new file).
	for f in "$S"/journal-*; do
		[ -e "$f" ] && ! [ -e "/run/${f##*/}" ] || continue
		touch "/run/${f##*/}"
		journalctl --no-pager --since=-120s -u containerd -u kubelet -u envsnap-arbiter -u envsnap-fdstore |
			grep -v 'level=debug' | tail -n 300 | sed 's/^/KUBETEST: JOURNAL /'
		journalctl --no-pager --since=-120s -k | grep -i -e oom -e 'killed process' | tail -n 40 | sed 's/^/KUBETEST: JOURNAL /'
		echo "KUBETEST: EVENT ${f##*/}"
	done
	if ! systemctl is-active --quiet kubelet; then
		log "kubelet not active: $(systemctl show -p SubState --value kubelet)"
	fi
	sleep 2
done
if [ -e "$S"/dump ]; then
	journalctl --no-pager -u kubelet | tail -n 60 | sed 's/^/KUBETEST: JOURNAL /'
	journalctl --no-pager -u containerd -u containerd-envsnap -u envsnap-arbiter | tail -n 60 | sed 's/^/KUBETEST: JOURNAL /'
	for f in /var/log/pods/envsnap-system_*/*/*.log; do
		[ -e "$f" ] && tail -n 40 "$f" | sed "s|^|KUBETEST: JOURNAL ${f#/var/log/pods/}: |"
	done
fi
systemctl stop kubelet
echo "KUBETEST: DONE"
sync
