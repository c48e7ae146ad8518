#!/bin/bash
# The guest side of tests/vm TestBenchKSMAgents, run by vmtest.service in
# place of the suite: internal/ksm's TestBenchAgents on the agent CLI of
# the benchmark workload's harness group, which the host shares read-only
# under the 9p tag "harness". One "VMTEST:" line per result.
set -u
echo "VMTEST: START kernel=$(uname -r) ksm=$(cat /sys/kernel/mm/ksm/run 2>/dev/null || echo absent)"
# Copied onto the guest's own disk: the agents then map their code from
# ext4 as on a node, not page by page over 9p.
mkdir -p /mnt/harness
t0=$(date +%s)
if ! mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,ro harness /mnt/harness ||
	! cp -a /mnt/harness /opt/harness; then
	echo "VMTEST: FAIL ksm-agents: could not copy the harness share to /opt/harness"
	echo "VMTEST: DONE 0 passed, 1 failed"
	exit 0
fi
umount /mnt/harness
echo "VMTEST: LOG harness copied to /opt/harness in $(($(date +%s) - t0)) s: $(du -sm /opt/harness | cut -f1) MiB"
ENVSNAP_BENCH=1 ENVSNAP_KSM_AGENT=/opt/harness/bin/agent ENVSNAP_KSM_AGENTS=4 \
	/mnt/host/bin/ksm.test -test.run '^TestBenchAgents$' -test.v -test.timeout 45m 2>&1 |
	sed -u 's/^/VMTEST: LOG /'
if [ "${PIPESTATUS[0]}" -eq 0 ]; then
	echo "VMTEST: PASS ksm-agents"
	echo "VMTEST: DONE 1 passed, 0 failed"
else
	echo "VMTEST: FAIL ksm-agents: internal/ksm TestBenchAgents failed (output above)"
	echo "VMTEST: DONE 0 passed, 1 failed"
fi
sync
