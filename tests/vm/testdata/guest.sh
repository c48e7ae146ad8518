#!/bin/bash
# The in-guest suite of tests/vm, run by vmtest.service (hack/vm-image.sh)
# on a Debian standard node: systemd, cgroup v2 unified. It installs the
# binaries and configs from the share (/mnt/host), runs containerd, the
# envsnap daemon and the arbiter as systemd units, and drives pods through
# CRI with crictl. Every check prints one "VMTEST: PASS name" or
# "VMTEST: FAIL name: why" line on the serial console; the host side
# parses them. Functional checks only: nothing here is timed.
set -u
S=/mnt/host
PASS=0 FAIL=0
T0=$(date +%s)
log() { echo "VMTEST: LOG [$(($(date +%s) - T0))s] $*"; }
pass() { echo "VMTEST: PASS $1"; PASS=$((PASS + 1)); }
fail() { echo "VMTEST: FAIL $1: $2"; FAIL=$((FAIL + 1)); }
check() { # check NAME WHY CMD...: PASS when CMD succeeds
	local name=$1 why=$2
	shift 2
	if "$@"; then pass "$name"; else fail "$name" "$why"; fi
}
finish() {
	if [ "$FAIL" -gt 0 ]; then
		journalctl --no-pager -u containerd | grep -i 'envlet\|arbiter' | tail -n 60 | sed 's/^/VMTEST: JOURNAL /'
		journalctl --no-pager -u containerd-envsnap -u envsnap-arbiter -u envsnap-pod -u envsnap-fdstore | tail -n 40 | sed 's/^/VMTEST: JOURNAL /'
	fi
	echo "VMTEST: DONE $PASS passed, $FAIL failed"
	sync
	exit 0
}
# wait_for SECONDS CMD...: polls CMD every 0.2 s.
wait_for() {
	local until=$(($(date +%s) + $1))
	shift
	while ! "$@"; do
		[ "$(date +%s)" -ge "$until" ] && return 1
		sleep 0.2
	done
}
crictl() { /usr/local/bin/crictl --timeout 120s "$@"; }

echo "VMTEST: START kernel=$(uname -r) cgroupfs=$(stat -fc %T /sys/fs/cgroup) controllers=[$(cat /sys/fs/cgroup/cgroup.controllers)] systemd=$(systemctl --version | head -1 | cut -d' ' -f2)"
check cgroup-v2 "/sys/fs/cgroup is not cgroup2 with cpu and memory" \
	sh -c '[ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ] && grep -qw cpu /sys/fs/cgroup/cgroup.controllers && grep -qw memory /sys/fs/cgroup/cgroup.controllers'

# --- install: binaries, shipped units and configs ---
install -m 0755 "$S"/bin/* /usr/local/bin/
cp "$S"/deploy/systemd/containerd-envsnap.service "$S"/deploy/systemd/envsnap-arbiter.service /etc/systemd/system/
mkdir -p /etc/envsnap /etc/containerd/conf.d /etc/containerd/certs.d/127.0.0.1:5000 /var/lib/vmtest/mem /var/log/vmpods
# The shipped daemon config, with background fill off so reads stay lazy
# (what the restart checks need).
sed 's/^fill = true/fill = false/' "$S"/deploy/envsnap/config.toml >/etc/envsnap/config.toml
cp "$S"/envlet.toml /etc/envsnap/envlet.toml

# --- BPF LSM rules (internal/lsm): Debian's kernel has bpf in its active
# LSMs, so the programs must load and deny here ---
log "active LSMs: $(cat /sys/kernel/security/lsm 2>/dev/null || echo 'securityfs not mounted')"
lsm_test() {
	ENVSNAP_LSM_REQUIRED=1 /usr/local/bin/lsm.test -test.run '^TestGuard$' -test.v >/tmp/lsm.out 2>&1
	local rc=$?
	sed 's/^/VMTEST: LOG lsm.test: /' /tmp/lsm.out
	return $rc
}
check bpf-lsm "internal/lsm TestGuard failed in the guest (output above)" lsm_test
# How many guards the kernel attaches (ErrHookFull past its limit per
# hook), and what 32 of them cost every other process's opens (logged,
# not asserted: a time under emulation).
lsm_many() {
	ENVSNAP_BENCH=1 ENVSNAP_LSM_REQUIRED=1 /usr/local/bin/lsm.test -test.run '^(TestGuardsPerHook|TestOpenCostOfGuards)$' -test.v >/tmp/lsm-many.out 2>&1
	local rc=$?
	sed 's/^/VMTEST: LOG lsm.test: /' /tmp/lsm-many.out
	return $rc
}
check lsm-many "internal/lsm TestGuardsPerHook or TestOpenCostOfGuards failed in the guest (output above)" lsm_many

# --- background work at idle priority (internal/idleprio) on cgroup v2:
# SCHED_IDLE and I/O class idle, no thread moved between cgroups ---
idleprio_test() {
	/usr/local/bin/idleprio.test -test.run '^(TestJobRunsLowered|TestBoost)$' -test.v >/tmp/idleprio.out 2>&1
	local rc=$?
	sed 's/^/VMTEST: LOG idleprio.test: /' /tmp/idleprio.out
	return $rc
}
check idleprio "internal/idleprio tests failed in the guest (output above)" idleprio_test

# --- pause/resume of an idle environment (internal/pause) on cgroup v2:
# freeze, memory.reclaim out to compressed swap, thaw. zram first, then
# zswap in front of a swap file; the swap exists only for these checks
# and is gone after them. The test logs the numbers (seconds per GiB to
# pause against writing the same memory to a file, time to the first
# instruction after the thaw); nothing here asserts a time. ---
pause_test() { # pause_test LABEL
	# Streamed: the test logs each stage as it goes.
	ENVSNAP_PAUSE_REQUIRED=1 ENVSNAP_PAUSE_MIB=128 /usr/local/bin/pause.test -test.run '^TestPauseResume$' -test.v -test.timeout 8m 2>&1 |
		sed -u "s/^/VMTEST: LOG pause.test ($1): /"
	return "${PIPESTATUS[0]}"
}
if modprobe zram num_devices=1 && echo 1G >/sys/block/zram0/disksize && mkswap /dev/zram0 >/dev/null && swapon /dev/zram0; then
	check pause-zram "internal/pause TestPauseResume failed with zram swap (output above)" pause_test zram
	log "zram after the pause test: $(cat /sys/block/zram0/mm_stat)"
	swapoff /dev/zram0 && echo 1 >/sys/block/zram0/reset && rmmod zram
else
	fail pause-zram "could not set up zram swap (modprobe zram, disksize, mkswap, swapon)"
fi
if fallocate -l 1G /var/tmp/pause.swap && chmod 600 /var/tmp/pause.swap && mkswap /var/tmp/pause.swap >/dev/null &&
	echo Y >/sys/module/zswap/parameters/enabled && swapon /var/tmp/pause.swap; then
	check pause-zswap "internal/pause TestPauseResume failed with zswap in front of a swap file (output above)" pause_test zswap
	swapoff /var/tmp/pause.swap
	echo N >/sys/module/zswap/parameters/enabled
else
	fail pause-zswap "could not set up zswap and a swap file"
fi
rm -f /var/tmp/pause.swap
log "swap after the pause checks: $(tail -n +2 /proc/swaps | wc -l) devices"
cp "$S"/deploy/containerd/envsnap.toml /etc/containerd/conf.d/envsnap.toml
cat >/etc/containerd/certs.d/127.0.0.1:5000/hosts.toml <<'EOF'
server = "http://127.0.0.1:5000"
[host."http://127.0.0.1:5000"]
  capabilities = ["pull", "resolve"]
EOF
cat >/etc/crictl.yaml <<'EOF'
runtime-endpoint: unix:///run/containerd/containerd.sock
image-endpoint: unix:///run/containerd/containerd.sock
EOF
# containerd's own unit, as its release ships it.
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
# driver systemd|cgroupfs: the main config (runc's driver, as kubeadm
# sets it) and, for systemd, the shipped drop-in that gives the envlet
# handler runc's SystemdCgroup option.
write_containerd_config() {
	local sd=false
	[ "$1" = systemd ] && sd=true
	cat >/etc/containerd/config.toml <<EOF
version = 3
imports = ["/etc/containerd/conf.d/*.toml"]
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "127.0.0.1:5000/vm/pause:1"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "/etc/containerd/certs.d"
[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
    SystemdCgroup = $sd
EOF
	rm -f /etc/containerd/conf.d/systemd-cgroup.toml
	if [ "$1" = systemd ]; then
		cp "$S"/deploy/containerd/systemd-cgroup.toml /etc/containerd/conf.d/
	fi
}
write_containerd_config systemd

# The registry with the test images the host pushed into its storage.
mkdir -p /var/lib/registry
cp -a "$S"/registry/. /var/lib/registry/
cat >/etc/registry.yml <<'EOF'
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: /var/lib/registry
  delete:
    enabled: true
http:
  addr: 127.0.0.1:5000
EOF
systemd-run --quiet --unit=vm-registry -p Type=exec /usr/local/bin/registry serve /etc/registry.yml
wait_for 30 bash -c 'exec 3<>/dev/tcp/127.0.0.1/5000' 2>/dev/null || fail registry "registry did not listen on 127.0.0.1:5000"

systemctl daemon-reload
systemctl enable --quiet envsnap-arbiter containerd-envsnap containerd
if ! systemctl start envsnap-arbiter containerd-envsnap containerd; then
	fail units "systemctl start of the shipped units failed"
	finish
fi
wait_for 60 crictl info >/dev/null 2>&1
# Every containerd event, for the loud-failure checks.
ctr events >/tmp/events.log 2>&1 &
check units "containerd, containerd-envsnap and envsnap-arbiter active" \
	systemctl is-active --quiet containerd containerd-envsnap envsnap-arbiter
log "units up: $(systemctl show -p MainPID --value containerd-envsnap) envsnap, containerd $(containerd --version | cut -d' ' -f3)"

IMG=127.0.0.1:5000/vm/env:1
pod_json() { # name uid cgroup_parent
	cat <<EOF
{"metadata": {"name": "$1", "namespace": "default", "uid": "$2"},
 "log_directory": "/var/log/vmpods/$1",
 "linux": {"cgroup_parent": "$3", "security_context": {"namespace_options": {"network": 2}}}}
EOF
}
ctr_json() { # name command [annotations-json]
	cat <<EOF
{"metadata": {"name": "$1"}, "image": {"image": "$IMG"},
 "command": ["/bin/sh", "-c", "$2"], "log_path": "$1.log",
 "annotations": ${3:-{\}},
 "mounts": [{"container_path": "/mem", "host_path": "/var/lib/vmtest/mem"},
            {"container_path": "/dev/termination-log", "host_path": "/var/lib/vmtest/term-$1"}]}
EOF
}
cd /var/lib/vmtest
run_ctr() { # pod-id name command [annotations]: prints the container id
	: >"/var/lib/vmtest/term-$2"
	ctr_json "$2" "$3" "${4:-}" >"$2.json"
	local id
	id=$(crictl create "$1" "$2.json" pod-"$1".json 2>/tmp/run_ctr.err) || return 1
	crictl start "$id" >/dev/null 2>/tmp/run_ctr.err || return 1
	echo "$id"
}
cgdir() { # container id: its cgroup directory, read from its init's /proc/PID/cgroup
	local pid
	pid=$(crictl inspect "$1" | jq -r .info.pid)
	echo "/sys/fs/cgroup$(sed -n 's/^0:://p' "/proc/$pid/cgroup")"
}

# --- lazy pull through envsnap (FUSE in the guest) ---
echo '{"metadata": {"name": "pull", "namespace": "default", "uid": "pull"}, "annotations": {"io.containerd.cri.runtime-handler": "envlet"}}' >pull.json
if crictl pull --pod-config pull.json "$IMG" >/dev/null; then
	log "pulled $IMG: $(grep -c ' fuse' /proc/self/mountinfo) FUSE mounts, envsnap cache $(du -smx /var/lib/containerd-envsnap | cut -f1) MiB"
	check lazy-pull "no envsnap FUSE mount after the pull, or the unread 64 MiB file was downloaded" \
		sh -c '[ "$(grep -c " fuse" /proc/self/mountinfo)" -gt 0 ] && [ "$(du -smx /var/lib/containerd-envsnap | cut -f1)" -lt 48 ]'
else
	fail lazy-pull "crictl pull failed"
fi

# --- a pod under the systemd driver: the cgroup is a scope in a .slice ---
PODUID=vm1
pod_json envpod $PODUID kubepods-burstable-pod$PODUID.slice >pod-envpod.json
POD=$(crictl runp --runtime envlet pod-envpod.json)
if [ -z "$POD" ]; then
	fail slice-cgroup "crictl runp --runtime envlet failed"
	finish
fi
log "pod $POD runtime envlet, cgroup_parent kubepods-burstable-pod$PODUID.slice"
cp pod-envpod.json pod-"$POD".json
C1=$(run_ctr "$POD" agent "cat /msg; exec sleep 100000")
if [ -z "$C1" ]; then
	fail slice-cgroup "container did not start under the envlet handler"
	finish
fi
D1=$(cgdir "$C1")
log "container $C1 cgroupsPath=$(crictl inspect "$C1" | jq -r .info.runtimeSpec.linux.cgroupsPath) cgroup=$D1"
check slice-cgroup "cgroup $D1 is not the expanded kubepods slice scope" \
	test "$D1" = "/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod$PODUID.slice/cri-containerd-$C1.scope"
check envlet-initial "cpu.max/memory.high not at the initial 0.5 cores/128 MiB: $(cat "$D1"/cpu.max) $(cat "$D1"/memory.high)" \
	wait_for 20 sh -c "[ \"\$(cat $D1/cpu.max)\" = '50000 100000' ] && [ \"\$(cat $D1/memory.high)\" = 134217728 ]"
log "initial: cpu.max=$(cat "$D1"/cpu.max) cpu.max.burst=$(cat "$D1"/cpu.max.burst) memory.high=$(cat "$D1"/memory.high) memory.max=$(cat "$D1"/memory.max) memory.oom.group=$(cat "$D1"/memory.oom.group)"
check lazy-read "the container did not read /msg from the lazy image" \
	sh -c "[ \"\$(crictl exec $C1 cat /msg)\" = envlet-vm ]"
# The guest's kernel runs BPF LSM programs (check bpf-lsm above proved what
# they refuse): the shim attaches its rules to every envlet container.
journalctl --no-pager -u containerd | grep -E 'lsm: (rules attached|no BPF LSM)' | tail -n 2 | sed 's/^/VMTEST: LOG shim: /'
check shim-lsm "the shim did not attach its BPF LSM rules to the envlet container $C1" \
	sh -c "journalctl --no-pager -u containerd | grep 'lsm: rules attached' | grep -q '$C1'"

# --- the writable layer's hard cap, on by default: its upper directory
# is on a loop-mounted ext4, and the shim's statfs watcher ends a layer
# past the guard's disk cap (lowered to 8 MiB by annotation) ---
UPPER=$(sed -n 's/.* - overlay .*upperdir=\([^,]*\).*/\1/p' "/proc/$(crictl inspect "$C1" | jq -r .info.pid)/mountinfo" | head -n 1)
log "writable layer of $C1: $UPPER on $(findmnt -n -o SOURCE,FSTYPE,SIZE --target "$UPPER")"
check disk-cap-mounted "the writable layer '$UPPER' of $C1 is not on a loop-mounted ext4" \
	sh -c "findmnt -n -o SOURCE,FSTYPE --target '$UPPER' | grep -q '^/dev/loop[0-9]* *ext4'"
# --- the writable layer is mounted volatile (writable_volatile, on by
# default): overlayfs skips the sync after each copy-up. Linux 6.1 shows
# the option as "volatile", later kernels as "fsync=volatile". ---
check volatile-upper "the root of $C1 is not an overlay mounted volatile" \
	sh -c "grep ' - overlay .*upperdir=' '/proc/$(crictl inspect "$C1" | jq -r .info.pid)/mountinfo' | head -n 1 | grep -Eq ',(fsync=)?volatile(,|\$)'"
CF=$(run_ctr "$POD" filler "dd if=/dev/zero of=/fill bs=1M count=32; exec sleep 100000" '{"io.envsnap.shim.disk-limit": "8388608"}')
check disk-cap-failure "the filler did not end with DISK_CAP_EXCEEDED: $(cat /var/lib/vmtest/term-filler 2>/dev/null)" \
	wait_for 120 grep -q DISK_CAP_EXCEEDED /var/lib/vmtest/term-filler
log "filler: $(cat /var/lib/vmtest/term-filler 2>/dev/null)"
[ -n "$CF" ] && crictl rm -f "$CF" >/dev/null 2>&1

# watch_file FILE SECONDS SEEN: logs every distinct value of a cgroup
# file and appends it to SEEN.
watch_file() {
	local f=$1 until=$(($(date +%s) + $2)) seen=$3 last="" v
	while [ "$(date +%s)" -lt "$until" ]; do
		v=$(cat "$f" 2>/dev/null) || break
		if [ "$v" != "$last" ]; then
			log "$(basename "$(dirname "$f")") $(basename "$f")=$v"
			echo "$v" >>"$seen"
			last=$v
		fi
		sleep 0.1
	done
}
stop_watch() { kill "$1" 2>/dev/null; wait "$1" 2>/dev/null; }

# --- CPU: a burst grows cpu.max, and it shrinks back ---
watch_file "$D1/cpu.max" 60 /tmp/cpu.seen &
W=$!
crictl exec "$C1" sh -c 'timeout 10 sh -c "while :; do :; done" & timeout 10 sh -c "while :; do :; done" & wait' >/dev/null 2>&1
check cpu-grow "cpu.max never rose above 50000 during the burst: $(tr '\n' ' ' </tmp/cpu.seen)" \
	sh -c "awk '\$1 != \"max\" && \$1 > 50000' /tmp/cpu.seen | grep -q ."
check cpu-shrink "cpu.max did not come back to 50000 100000 after the burst: $(cat "$D1"/cpu.max)" \
	wait_for 45 sh -c "[ \"\$(cat $D1/cpu.max)\" = '50000 100000' ]"
stop_watch $W

# memtrace DIR: what the controller samples, as the kernel shows it.
memtrace() {
	echo "memory.current=$(cat "$1"/memory.current) memory.high=$(cat "$1"/memory.high) memory.max=$(cat "$1"/memory.max)" \
		"$(grep -E '^(anon|file|inactive_file|file_dirty|workingset_refault_file) ' "$1"/memory.stat | tr ' \n' '= ')" \
		"events[$(tr '\n' ' ' <"$1"/memory.events)] pressure[$(head -1 "$1"/memory.pressure)]"
}

# --- memory: page cache is not working set; anonymous memory grows the grant ---
# 160 MiB written to a file at the grant (128 MiB, or less once idle
# reclaim has lowered it): memory.high reclaims the written (inactive)
# file pages and counts its hits in memory.events, and the working set
# (memory.current - inactive_file) stays small, so the controller grants
# nothing.
log "before: $(memtrace "$D1")"
H0=$(cat "$D1"/memory.high)
crictl exec "$C1" dd if=/dev/zero of=/mem/cache bs=1M count=160 >/dev/null 2>&1
log "after 160 MiB of page cache: $(memtrace "$D1")"
check mem-cache-no-grow "memory.high moved from $H0 for page cache, or memory.events high did not count the reclaim: $(memtrace "$D1")" \
	sh -c "[ \"\$(cat $D1/memory.high)\" -le $H0 ] && [ \"\$(sed -n 's/^high //p' $D1/memory.events)\" -gt 0 ]"
crictl exec "$C1" rm -f /mem/cache
# 160 MiB of anonymous memory (dd's buffer, filled from /dev/zero and held
# while dd blocks writing it into a pipe nobody reads) grows memory.high;
# once released, memory.high shrinks back to the initial 128 MiB (and
# idle reclaim may take it lower).
watch_file "$D1/memory.high" 360 /tmp/mem.seen &
W=$!
crictl exec "$C1" sh -c 'dd if=/dev/zero bs=167772160 count=1 2>/dev/null | { while [ ! -e /mem/release ]; do sleep 0.2; done; }' >/dev/null 2>&1 &
X=$!
check mem-grow "memory.high did not grow above 160 MiB with 160 MiB of anonymous memory: $(memtrace "$D1")" \
	wait_for 240 sh -c "[ \"\$(cat $D1/memory.current)\" -ge 162529280 ] && [ \"\$(cat $D1/memory.high)\" -gt 167772160 ]"
log "holding 160 MiB: $(memtrace "$D1")"
touch /var/lib/vmtest/mem/release
wait $X
check mem-shrink "memory.high did not grow, or did not come back to 128 MiB after the memory was released: $(tr '\n' ' ' </tmp/mem.seen)" \
	wait_for 60 sh -c "awk '\$1 > 167772160' /tmp/mem.seen | grep -q . && [ \"\$(cat $D1/memory.high)\" -le 134217728 ]"
stop_watch $W
rm -f /var/lib/vmtest/mem/*
containerd-envsnap envs --timeline "k8s.io/$C1" | awk -F, 'NR > 1 && $10 != "" {print $2 "s", "cpu=" $3, "mem=" $4, "ws=" $7, "usage=" $8, $9, $10}' |
	tail -n 12 | sed 's/^/VMTEST: LOG timeline: /'

# --- the admission reserve holds; node exhaustion ends in a loud failure ---
# The node gives envlet 512 MiB with a 15% reserve (435 MiB to grant). The
# hog holds 200 MiB of anonymous memory and has been granted the whole
# 435 MiB. Admission is by use (docs/envlet.md): a 64 MiB newcomer is
# admitted, and the arbiter restores the reserve for it from the hog's
# idle burst, lowering the hog's memory.high. Then the hog asks for 300 MiB
# more, which the node does not have: denied while squeezed at
# memory.high, it is frozen and killed with its reason.
C2=$(run_ctr "$POD" hog "dd if=/dev/zero bs=209715200 count=1 2>/dev/null | { while [ ! -e /mem/go ]; do sleep 0.2; done; dd if=/dev/zero bs=314572800 count=1 2>/dev/null | exec sleep 100000; }")
D2=$(cgdir "$C2")
log "hog $C2 cgroup=$D2"
watch_file "$D2/memory.high" 600 /tmp/hog.seen &
W=$!
wait_for 300 sh -c "[ \$(cat $D2/memory.current) -ge 209715200 ] && [ \$(cat $D2/memory.high) -gt 419430400 ]"
sleep 2
H2=$(cat "$D2"/memory.high)
log "hog holds: $(memtrace "$D2")"
C3=$(run_ctr "$POD" small "exec sleep 100000" '{"io.envsnap.envlet.initial-memory": "64Mi"}')
check admission-reserve "a 64 MiB environment was not admitted next to the hog, or the hog's idle burst was not reclaimed (memory.high $H2, seen: $(tr '\n' ' ' </tmp/hog.seen))" \
	wait_for 60 sh -c "[ -n '$C3' ] && [ \$(cat $D2/memory.high) -lt $H2 ]"
log "after the admission: $(memtrace "$D2")"
touch /var/lib/vmtest/mem/go
wait_for 300 sh -c "[ \"\$(crictl inspect $C2 | jq -r .status.state)\" = CONTAINER_EXITED ]"
stop_watch $W
ST=$(crictl inspect "$C2" | jq -c '.status | {state, exitCode, reason, message}')
log "hog status: $ST"
log "termination message: $(cat /var/lib/vmtest/term-hog)"
journalctl --no-pager -u containerd | grep -E 'envlet: (environment failed|froze|memory working set)' | tail -n 4 | sed 's/^/VMTEST: LOG shim: /'
check loud-failure "hog did not end with exit 137, OOMKilled and MEM_NODE_EXHAUSTED: $ST $(cat /var/lib/vmtest/term-hog)" \
	sh -c "echo '$ST' | jq -e '.exitCode == 137 and .reason == \"OOMKilled\"' >/dev/null && grep -q MEM_NODE_EXHAUSTED /var/lib/vmtest/term-hog"
check loud-failure-frozen "the shim did not freeze the failed environment before killing it" \
	sh -c "journalctl --no-pager -u containerd | grep -q 'froze failed environment'"
check loud-failure-event "no /envlet/env/failed event with MEM_NODE_EXHAUSTED for the hog" \
	sh -c "grep -q 'MEM_NODE_EXHAUSTED' /tmp/events.log && grep -q '/tasks/oom' /tmp/events.log"

# --- an in-place resize (kubelet's UpdateContainerResources) moves the cap ---
# The shim keeps runc away from cpu.max (envlet owns it) and makes the new
# limit envlet's cap: 0.2 cores, below the 0.5 granted, forces cpu.max down.
if [ -n "$C3" ]; then
	D3=$(cgdir "$C3")
	crictl update --cpu-period 100000 --cpu-quota 20000 "$C3" >/dev/null
	check resize-cap "cpu.max of $C3 did not follow an in-place resize to 0.2 cores: $(cat "$D3"/cpu.max)" \
		wait_for 30 sh -c "[ \"\$(cat $D3/cpu.max)\" = '20000 100000' ]"
	log "after crictl update --cpu-quota 20000: cpu.max=$(cat "$D3"/cpu.max)"
	crictl stop -t 1 "$C3" >/dev/null
	crictl rm "$C3" >/dev/null
else
	fail resize-cap "no container to resize"
fi
crictl rm "$C2" >/dev/null
rm -f /var/lib/vmtest/mem/*

# --- CPU tiers on cgroup v2: best-effort is cpu.idle, latency weighs 1000 ---
# A latency-tier environment times a fixed shell loop alone, then while a
# best-effort one, started first (the order that used to hurt on v1),
# spins on both vCPUs. The slowdown is logged, not asserted: the guest's
# vCPUs share the host with whatever else runs there.
CL=$(run_ctr "$POD" latency "exec sleep 100000" '{"io.envsnap.envlet.tier": "latency"}')
CB=$(run_ctr "$POD" besteffort "exec sleep 100000" '{"io.envsnap.envlet.tier": "besteffort"}')
if [ -n "$CL" ] && [ -n "$CB" ]; then
	DL=$(cgdir "$CL")
	DB=$(cgdir "$CB")
	log "tiers: latency cpu.weight=$(cat "$DL"/cpu.weight) cpu.idle=$(cat "$DL"/cpu.idle); best-effort cpu.weight=$(cat "$DB"/cpu.weight) cpu.idle=$(cat "$DB"/cpu.idle)"
	check tier-v2 "latency's cpu.weight is not 1000 or best-effort's cpu.idle is not 1: $(cat "$DL"/cpu.weight) $(cat "$DB"/cpu.idle)" \
		sh -c "[ \"\$(cat $DL/cpu.weight)\" = 1000 ] && [ \"\$(cat $DB/cpu.idle)\" = 1 ] && [ \"\$(cat $DL/cpu.idle)\" = 0 ]"
	# tier_loop: seconds the latency environment takes for its loop, by
	# its own /proc/uptime.
	tier_loop() {
		crictl exec "$CL" sh -c 'read s _ </proc/uptime; i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; read e _ </proc/uptime; echo "$s $e"' |
			awk '{printf "%.2f", $2 - $1}'
	}
	ALONE=$(tier_loop)
	crictl exec "$CB" sh -c 'for n in 1 2; do (while [ ! -e /mem/stop-spin ]; do :; done) & done; wait' >/dev/null 2>&1 &
	X=$!
	sleep 3
	BUSY=$(tier_loop)
	touch /var/lib/vmtest/mem/stop-spin
	wait $X
	log "tiers: latency loop alone ${ALONE} s, beside 2 best-effort spinners started first ${BUSY} s ($(awk -v a="$ALONE" -v b="$BUSY" 'BEGIN {if (a > 0) printf "%+.1f%%", (b / a - 1) * 100}'))"
	crictl rm -f "$CL" "$CB" >/dev/null 2>&1
	rm -f /var/lib/vmtest/mem/*
else
	fail tier-v2 "the latency or best-effort container did not start: $(cat /tmp/run_ctr.err)"
fi

# --- start order on cgroup v2: a start behind a busy one runs at a
# quarter of its cpu.weight, and gets it back once the one ahead is gone.
# The one ahead may stay at the head for 10 minutes (start-max): creating
# the second container can take half a minute in the TCG guest. ---
CA=$(run_ctr "$POD" start-a "while :; do :; done" '{"io.envsnap.envlet.start-max": "10m"}')
CB=$(run_ctr "$POD" start-b "while :; do :; done")
if [ -n "$CA" ] && [ -n "$CB" ]; then
	DA=$(cgdir "$CA")
	DB=$(cgdir "$CB")
	check start-order "the start behind a busy one did not run at a quarter of the default cpu.weight (100): a=$(cat "$DA"/cpu.weight) b=$(cat "$DB"/cpu.weight)" \
		wait_for 10 sh -c "[ \"\$(cat $DB/cpu.weight)\" = 25 ] && [ \"\$(cat $DA/cpu.weight)\" = 100 ]"
	log "start order: a (ahead, busy) cpu.weight=$(cat "$DA"/cpu.weight), b (behind) cpu.weight=$(cat "$DB"/cpu.weight)"
	crictl rm -f "$CA" >/dev/null 2>&1
	check start-order-head "the start left at the head of the queue did not get its cpu.weight back: $(cat "$DB"/cpu.weight)" \
		wait_for 10 sh -c "[ \"\$(cat $DB/cpu.weight)\" = 100 ]"
	crictl rm -f "$CB" >/dev/null 2>&1
else
	fail start-order "the two busy containers did not start: $(cat /tmp/run_ctr.err)"
fi

# --- a task paused through containerd parks its environment on cgroup v2
# with zram swap: once paused for pause-push-out-after (2 s), the shim
# pushes its memory out (a shell holding 32 MiB of base64 text); resumed,
# every byte comes back. Idle reclaim is off for it, so only the pause
# can move its memory. zram exists for this check only. ---
if modprobe zram num_devices=1 && echo 1G >/sys/block/zram0/disksize && mkswap /dev/zram0 >/dev/null && swapon /dev/zram0; then
	M=/var/lib/vmtest/mem
	rm -f $M/parked.*
	# No double quotes in the command: ctr_json pastes it into JSON as is.
	# Unquoted, $x's lines are joined by spaces, the same way both times.
	CP=$(run_ctr "$POD" parked 'x=$(head -c 25165824 /dev/urandom | base64); echo $x | md5sum >/mem/parked.want; while :; do if [ -e /mem/parked.ask ]; then echo $x | md5sum >/mem/parked.got; rm -f /mem/parked.ask; fi; sleep 0.5; done' \
		'{"io.envsnap.envlet.idle-reclaim-after": "0s"}')
	if [ -n "$CP" ] && wait_for 180 test -s $M/parked.want; then
		DP=$(cgdir "$CP")
		HELD=$(cat "$DP"/memory.current)
		P0=$(date +%s.%N)
		ctr -n k8s.io task pause "$CP"
		pushed() { [ "$(cat "$DP"/memory.swap.current)" -ge 25165824 ]; }
		wait_for 120 pushed
		check pause-push-out "the paused environment's memory did not go out to swap: memory.current $(cat "$DP"/memory.current) (before $HELD), memory.swap.current $(cat "$DP"/memory.swap.current)" \
			pushed
		log "task pause: memory.current $HELD -> $(cat "$DP"/memory.current), memory.swap.current $(cat "$DP"/memory.swap.current) after $(awk -v a="$P0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}') s (push-out after 2 s); zram mm_stat $(cat /sys/block/zram0/mm_stat); shim: $(journalctl --no-pager -u containerd | grep -o 'paused environment.s memory pushed out.*' | tail -1)"
		ctr -n k8s.io task resume "$CP"
		touch $M/parked.ask
		wait_for 120 test -s $M/parked.got
		check pause-resume-intact "after the resume the shell's 32 MiB did not come back intact: want $(cat $M/parked.want) got $(cat $M/parked.got 2>/dev/null)" \
			cmp -s $M/parked.want $M/parked.got
		log "after the resume: memory.current $(cat "$DP"/memory.current), memory.swap.current $(cat "$DP"/memory.swap.current)"
	else
		fail pause-push-out "the parked container did not start or fill its memory: $(cat /tmp/run_ctr.err)"
	fi
	crictl rm -f "$CP" >/dev/null 2>&1
	rm -f $M/parked.*
	swapoff /dev/zram0 && echo 1 >/sys/block/zram0/reset && rmmod zram
else
	fail pause-push-out "could not set up zram swap (modprobe zram, disksize, mkswap, swapon)"
fi

# --- KSM: [shim] memory-merge (tests/vm's envlet.toml) marks every
# container the envlet shim starts mergeable (Linux >= 6.4); with ksmd
# scanning, the identical pages of two environments are merged, and a
# process the shim did not start stays unmarked. ksmd runs for this check
# only. Each environment's shell holds 32 MiB of one repeated page. ---
KSM=/sys/kernel/mm/ksm
ksm_pages() { # pid: pages of it that are merged
	local n
	n=$(awk '$1 == "ksm_merging_pages" {print $2}' "/proc/$1/ksm_stat" 2>/dev/null)
	echo "${n:-0}"
}
ksm_any() { # pid: yes, no, or unreported (Linux 6.12 does not report it)
	local v
	v=$(awk '$1 == "ksm_merge_any:" {print $2}' "/proc/$1/ksm_stat" 2>/dev/null)
	echo "${v:-unreported}"
}
ksmd_ticks() { # ksmd's utime + stime in clock ticks
	local p
	p=$(pgrep -x ksmd | head -1)
	[ -n "$p" ] && awk '{sub(/.*\) /, ""); print $12 + $13}' "/proc/$p/stat"
}
FILL='x=$(yes kkkkkkkkkkkkkkk | head -c 33554432); while :; do sleep 3600; done'
K1=$(run_ctr "$POD" merge1 "$FILL")
K2=$(run_ctr "$POD" merge2 "$FILL")
setsid sh -c "$FILL" &
KH=$!
if [ -n "$K1" ] && [ -n "$K2" ]; then
	P1=$(crictl inspect "$K1" | jq -r .info.pid)
	P2=$(crictl inspect "$K2" | jq -r .info.pid)
	sleep 5 # the shells fill their 32 MiB
	T0K=$(ksmd_ticks)
	echo 5000 >$KSM/pages_to_scan
	echo 20 >$KSM/sleep_millisecs
	echo 1 >$KSM/run
	S0=$(date +%s)
	# 8192 pages of 4 KiB each; most of each shell's are the same page.
	ksm_merged() { [ "$(ksm_pages "$P1")" -gt 6000 ] && [ "$(ksm_pages "$P2")" -gt 6000 ]; }
	# ksm_merge_any, where the kernel reports it, must say the same.
	ksm_ok() { ksm_merged && [ "$(ksm_pages "$KH")" -eq 0 ] && [ "$(ksm_any "$P1")" != no ] && [ "$(ksm_any "$KH")" != yes ]; }
	wait_for 240 ksm_merged
	log "KSM after $(($(date +%s) - S0)) s of ksmd: merged pages $(ksm_pages "$P1") and $(ksm_pages "$P2") in the environments (ksm_merge_any $(ksm_any "$P1"), $(ksm_any "$P2")), $(ksm_pages "$KH") in the unmarked process (ksm_merge_any $(ksm_any "$KH")); node: pages_shared $(cat $KSM/pages_shared), pages_sharing $(cat $KSM/pages_sharing), general_profit $(cat $KSM/general_profit) bytes, full_scans $(cat $KSM/full_scans); ksmd CPU $(($(ksmd_ticks) - T0K)) ticks of 1/$(getconf CLK_TCK) s"
	check ksm-merge "the environments' pages were not merged or the unmarked process's were: $(ksm_pages "$P1") $(ksm_pages "$P2") $(ksm_pages "$KH"), ksm_merge_any $(ksm_any "$P1") $(ksm_any "$KH")" \
		ksm_ok
else
	fail ksm-merge "the merge containers did not start: $(cat /tmp/run_ctr.err)"
fi
echo 2 >$KSM/run # unmerge everything, then stop
echo 0 >$KSM/run
kill -- -"$KH" 2>/dev/null
wait "$KH" 2>/dev/null
crictl rm -f "$K1" "$K2" >/dev/null 2>&1

# --- the envsnap daemon restarts under a container reading a lazy layer ---
WANT=$(cat "$S"/big.sha256)
C4=$(run_ctr "$POD" reader "while :; do sha256sum /data/big.bin | cut -c1-64; sleep 1; done")
LOGF=/var/log/vmpods/envpod/reader.log
sums() { local n; n=$(grep -c "$WANT" "$LOGF" 2>/dev/null); echo "${n:-0}"; }
wait_for 180 sh -c "grep -q $WANT $LOGF 2>/dev/null"
before=$(sums)
log "reader read the lazy 64 MiB file $before time(s); restarting containerd-envsnap"
systemctl restart containerd-envsnap
check restart-unit "containerd-envsnap not active after systemctl restart" systemctl is-active --quiet containerd-envsnap
wait_for 120 sh -c "[ \$(grep -c $WANT $LOGF) -ge $((before + 2)) ]"
mid=$(sums)
log "after restart: $mid good reads; SIGKILL containerd-envsnap"
kill -KILL "$(systemctl show -p MainPID --value containerd-envsnap)"
sleep 3
wait_for 60 systemctl is-active --quiet containerd-envsnap
wait_for 120 sh -c "[ \$(grep -c $WANT $LOGF) -ge $((mid + 2)) ]"
after=$(sums)
bad=$(grep -vc "$WANT" "$LOGF" || true)
log "after SIGKILL: $after good reads, $bad other lines: $(grep -v "$WANT" "$LOGF" | tail -2 | tr '\n' ' ')"
check restart-reads "reads through restart and SIGKILL: $before -> $mid -> $after good, $bad bad" \
	sh -c "[ $mid -gt $before ] && [ $after -gt $mid ] && [ $bad -eq 0 ]"

# --- the DaemonSet layout: the daemon in a cgroup that dies whole, as a
# pod's container does, launching its keeper on the host as a systemd unit
# with the DaemonSet's own --keeper-command (staged from daemonset.yaml).
# Each pod end (a stop: SIGTERM, then SIGKILL to whatever is left in the
# cgroup; and a SIGKILL of the whole cgroup) must leave the keeper and the
# containers reading lazy layers running.
KCMD=$(cat "$S"/keeper-command)
crictl stop -t 1 "$C4" >/dev/null
systemctl stop containerd-envsnap
# The shipped unit's keeper (KillMode=process) is still in its cgroup,
# holding the layers: end it, so the pod-like daemon must launch its own.
# The layers are remounted by the next daemon; no container reads them now.
for p in $(cat /sys/fs/cgroup/system.slice/containerd-envsnap.service/cgroup.procs 2>/dev/null); do kill -KILL "$p"; done
systemctl disable --quiet containerd-envsnap
podd() { # start the daemon as a pod's container would run: everything in one cgroup
	systemd-run --quiet --collect --unit envsnap-pod -p Type=exec -p KillMode=control-group -p Delegate=no \
		/usr/local/bin/containerd-envsnap serve --config /etc/envsnap/config.toml --keeper-command "$KCMD"
	wait_for 120 containerd-envsnap status --address /run/containerd-envsnap/containerd-envsnap.sock >/dev/null 2>&1
}
podd
KPID=$(systemctl show -p MainPID --value envsnap-fdstore)
log "pod-like daemon $(systemctl show -p MainPID --value envsnap-pod) in $(sed -n 's/^0:://p' /proc/"$(systemctl show -p MainPID --value envsnap-pod)"/cgroup); keeper $KPID in $(sed -n 's/^0:://p' /proc/"$KPID"/cgroup 2>/dev/null)"
check keeper-unit "the keeper was not launched as envsnap-fdstore.service: pid $KPID" \
	sh -c "[ '$KPID' -gt 0 ] && grep -q '^0::/system.slice/envsnap-fdstore.service$' /proc/$KPID/cgroup"
C6=$(run_ctr "$POD" reader2 "while :; do sha256sum /data/big.bin | cut -c1-64; sleep 1; done")
LOGF=/var/log/vmpods/envpod/reader2.log
wait_for 180 sh -c "grep -q $WANT $LOGF 2>/dev/null"
before=$(sums)
systemctl stop envsnap-pod
podd
wait_for 120 sh -c "[ \$(grep -c $WANT $LOGF) -ge $((before + 2)) ]"
mid=$(sums)
log "after the pod's stop and a new daemon: $mid good reads; SIGKILL of the whole pod cgroup"
systemctl kill --signal=KILL envsnap-pod
wait_for 30 sh -c '! systemctl is-active --quiet envsnap-pod'
podd
wait_for 120 sh -c "[ \$(grep -c $WANT $LOGF) -ge $((mid + 2)) ]"
after=$(sums)
bad=$(grep -vc "$WANT" "$LOGF" || true)
KPID2=$(systemctl show -p MainPID --value envsnap-fdstore)
log "after the SIGKILL: $after good reads, $bad other lines; keeper $KPID -> $KPID2"
check keeper-outlives-pod "reads through two pod ends: $before -> $mid -> $after good, $bad bad; keeper $KPID -> $KPID2" \
	sh -c "[ $mid -gt $before ] && [ $after -gt $mid ] && [ $bad -eq 0 ] && [ '$KPID' = '$KPID2' ]"

crictl stopp "$POD" >/dev/null
crictl rmp "$POD" >/dev/null

# --- the cgroupfs driver: the basic pod life cycle ---
systemctl stop containerd
write_containerd_config cgroupfs
systemctl start containerd
wait_for 60 crictl info >/dev/null 2>&1
pod_json fspod vm2 /kubepods/burstable/podvm2 >pod-fspod.json
POD2=$(crictl runp --runtime envlet pod-fspod.json)
cp pod-fspod.json pod-"$POD2".json
C5=$(run_ctr "$POD2" fsagent "cat /msg; exec sleep 100000")
if [ -n "$C5" ]; then
	D5=$(cgdir "$C5")
	log "cgroupfs container $C5 cgroupsPath=$(crictl inspect "$C5" | jq -r .info.runtimeSpec.linux.cgroupsPath) cgroup=$D5 cpu.max=$(cat "$D5"/cpu.max) memory.high=$(cat "$D5"/memory.high)"
	check cgroupfs-cgroup "cgroup $D5 is not /sys/fs/cgroup/kubepods/burstable/podvm2/$C5" \
		test "$D5" = "/sys/fs/cgroup/kubepods/burstable/podvm2/$C5"
	check cgroupfs-envlet "cpu.max not at the initial quota under the cgroupfs driver: $(cat "$D5"/cpu.max)" \
		wait_for 20 sh -c "[ \"\$(cat $D5/cpu.max)\" = '50000 100000' ]"
	# crictl stop's own answer goes into the failure: once the rm below
	# found the container still running after it.
	stopped=$(crictl stop -t 1 "$C5" 2>&1; echo "(exit $?)")
	# Through the crictl function (120 s timeout): under sh -c the bare
	# binary's 2 s default timed out on a loaded host.
	if out=$({ crictl rm "$C5" && crictl stopp "$POD2" && crictl rmp "$POD2"; } 2>&1); then
		pass cgroupfs-lifecycle
	else
		fail cgroupfs-lifecycle "rm/stopp/rmp failed: $out (crictl stop said: $stopped)"
		# Seen twice in about 30 runs: crictl stop succeeded and rm still
		# found the container running, which is what containerd's CRI does
		# when the shim's connection reads as closed at the stop (the task
		# looks gone, the status stays). Its journal and the shims alive
		# say whether the shim had gone.
		journalctl --no-pager -u containerd | grep -E "$C5|$POD2|ttrpc" | tail -n 30 | sed 's/^/VMTEST: JOURNAL /'
		ps -eo pid,ppid,lstart,args | grep '[s]him-envlet' | sed 's/^/VMTEST: LOG shims: /'
	fi
else
	fail cgroupfs-cgroup "container did not start under the cgroupfs driver (pod ${POD2:-not created}): $(tr '\n' ' ' </tmp/run_ctr.err 2>/dev/null)"
fi
finish
