#!/usr/bin/env bash
# Builds the guest image of the VM test bed (tests/vm): a Debian bookworm
# standard node (systemd, cgroup v2 unified) booted by qemu with Debian's
# linux-image-amd64 kernel from bookworm-backports. Idempotent and cached:
# the image lands in .cache/vm/<key>/ where <key> hashes this script and
# the kernel version, so editing the recipe rebuilds it and an unchanged
# recipe costs nothing.
# Prints the image directory on its last line.
#
# Output: vmlinuz, initrd.img, root.img (ext4, sparse), kernel-version.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache="${VM_CACHE:-$root/.cache/vm}"

need_root() {
	if [ "$(id -u)" -ne 0 ]; then
		echo "vm-image: need root to install Debian packages" >&2
		exit 1
	fi
}

apt_pkgs=(qemu-system-x86 mmdebstrap e2fsprogs)
missing=()
for p in "${apt_pkgs[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	echo "vm-image: apt-get install ${missing[*]}" >&2
	need_root
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The guest's kernel: Debian's linux-image-amd64 from bookworm-backports
# (6.12 when this was written), not bookworm's 6.1, because the node's
# memory checks need Linux >= 6.4 (PR_SET_MEMORY_MERGE, whole-process KSM
# merging). The backports suite is named on apt's command line only, so
# the host's apt sources stay as they are.
backports=(-o "Dir::Etc::SourceList=$root/hack/apt/bookworm-backports.list")
case "$(dpkg-query -W -f='${Version}' linux-image-amd64 2>/dev/null)" in
*bpo*) ;;
*)
	echo "vm-image: apt-get install -t bookworm-backports linux-image-amd64" >&2
	need_root
	# apt hands its signature check a file in TMPDIR as its unprivileged
	# sandbox user: a /tmp without the sticky, world-writable mode (seen
	# on this machine kind) fails it as "not signed".
	apt_tmp=$(mktemp -d)
	chmod 1777 "$apt_tmp"
	TMPDIR=$apt_tmp apt-get "${backports[@]}" update -qq
	TMPDIR=$apt_tmp DEBIAN_FRONTEND=noninteractive apt-get "${backports[@]}" install -y -qq \
		--no-install-recommends -t bookworm-backports linux-image-amd64 >/dev/null
	rm -rf "$apt_tmp"
	;;
esac

# The newest kernel the linux-image-amd64 package pulled in.
kver=$(cd /lib/modules && ls -d [0-9]*-amd64 2>/dev/null | sort -V | tail -1)
if [ -z "$kver" ] || [ ! -f "/boot/vmlinuz-$kver" ]; then
	echo "vm-image: no Debian amd64 kernel under /boot and /lib/modules" >&2
	exit 1
fi
if [ ! -f "/boot/initrd.img-$kver" ]; then
	update-initramfs -c -k "$kver" >&2
fi

key=$( (cat "$0"; echo "$kver") | sha256sum | cut -c1-16)
out="$cache/$key"
if [ -f "$out/done" ]; then
	echo "$out"
	exit 0
fi

echo "vm-image: building guest image $key (kernel $kver) in $out" >&2
start=$(date +%s)
rm -rf "$out"
mkdir -p "$out"
work=$(mktemp -d "$cache/build.XXXXXX")
trap 'rm -rf "$work"' EXIT

# A minimal Debian with systemd as init. libseccomp2 for runc, fuse3 for
# the snapshotter's FUSE mounts, kmod for modprobe, jq to read crictl's
# JSON, procps and psmisc for the tests' process handling.
mmdebstrap --variant=minbase --quiet \
	--include=systemd,systemd-sysv,udev,kmod,libseccomp2,fuse3,jq,procps,psmisc,iproute2 \
	bookworm "$work/rootfs.tar" >&2
mkdir "$work/rootfs"
tar -C "$work/rootfs" -xf "$work/rootfs.tar"
rm "$work/rootfs.tar"
r="$work/rootfs"

# The kernel's modules (overlay, fuse, 9p), from the host's package.
mkdir -p "$r/lib/modules"
cp -a "/lib/modules/$kver" "$r/lib/modules/"

echo vmtest >"$r/etc/hostname"
printf '127.0.0.1 localhost vmtest\n' >"$r/etc/hosts"
# Nothing to wait for: no network, no getty on the serial console (the
# test's output owns it).
ln -sf /dev/null "$r/etc/systemd/system/serial-getty@ttyS0.service"
ln -sf /dev/null "$r/etc/systemd/system/getty@tty1.service"
ln -sf /dev/null "$r/etc/systemd/system/systemd-timesyncd.service"
ln -sf /dev/null "$r/etc/systemd/system/apt-daily.timer"
ln -sf /dev/null "$r/etc/systemd/system/apt-daily-upgrade.timer"

# The test unit: mounts the host's share (virtio-9p, tag "host") and runs
# the suite it carries, printing to the serial console, then powers off
# whatever happened. tests/vm writes the share.
cat >"$r/etc/systemd/system/vmtest.service" <<'EOF'
[Unit]
Description=envsnap VM test suite
After=multi-user.target
[Service]
Type=oneshot
ExecStartPre=/sbin/modprobe -a 9p 9pnet_virtio overlay fuse
ExecStartPre=/bin/mkdir -p /mnt/host
ExecStartPre=/bin/mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 host /mnt/host
ExecStart=/bin/bash /mnt/host/guest.sh
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=infinity
ExecStopPost=/bin/systemctl --no-block poweroff
[Install]
WantedBy=multi-user.target
EOF
mkdir -p "$r/etc/systemd/system/multi-user.target.wants"
ln -sf ../vmtest.service "$r/etc/systemd/system/multi-user.target.wants/vmtest.service"

cp "/boot/vmlinuz-$kver" "$out/vmlinuz"
cp "/boot/initrd.img-$kver" "$out/initrd.img"
echo "$kver" >"$out/kernel-version"
mkfs.ext4 -q -L root -d "$r" "$out/root.img" 4G >&2
touch "$out/done"
# Older builds are dead weight.
find "$cache" -mindepth 1 -maxdepth 1 -type d ! -name "$key" ! -name 'build.*' -exec rm -rf {} + 2>/dev/null || true
echo "vm-image: built in $(($(date +%s) - start))s" >&2
echo "$out"
