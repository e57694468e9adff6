#!/usr/bin/env bash
# Fetches the guest kernel of the microVM wall: Debian's current cloud kernel
# (small, virtio drivers as modules, boots with ACPI under QEMU's microvm),
# unpacked without installing it into DEST/<version> (with an uncompressed
# copy of the image and modules.dep added), with DEST/current pointing at
# it. Also makes sure QEMU is installed. Idempotent: a kernel already
# unpacked is kept; an older one stays beside a newer one. Prints the
# kernel version.
#
# usage: scripts/kernel.sh [DEST]   (default DEST=.tools/kernel)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.tools/kernel}

die() { echo "kernel.sh: $*" >&2; exit 1; }

updated=
apt_update() {
  # The package lists are refreshed at most once per run, and only when a
  # look-up or download needs them.
  if [ -z "$updated" ]; then
    [ "$(id -u)" = 0 ] || die "the package lists need refreshing; run as root (sudo $0)"
    apt-get update -qq
    updated=1
  fi
}

if ! command -v qemu-system-x86_64 >/dev/null; then
  [ "$(id -u)" = 0 ] || die "qemu-system-x86_64 is missing; install it (apt-get install qemu-system-x86) or run as root"
  apt_update
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-system-x86 >/dev/null
fi

# The metapackage depends on exactly one versioned image package, the current one.
find_pkg() {
  apt-cache depends linux-image-cloud-amd64 2>/dev/null |
    sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*-cloud-amd64\)$/\1/p' | head -n1
}
pkg=$(find_pkg)
if [ -z "$pkg" ]; then
  apt_update
  pkg=$(find_pkg)
fi
[ -n "$pkg" ] || die "no linux-image-*-cloud-amd64 package found behind linux-image-cloud-amd64"
version=${pkg#linux-image-}

mkdir -p "$dest"
if [ ! -f "$dest/$version/boot/vmlinuz-$version" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # apt-get download writes into the current directory; a stale package list
  # makes it fail with a 404, so refresh once and retry.
  if ! (cd "$tmp" && apt-get download -qq "$pkg" 2>/dev/null); then
    apt_update
    (cd "$tmp" && apt-get download -qq "$pkg") || die "apt-get download $pkg failed"
  fi
  deb=$(ls "$tmp"/*.deb)
  # Unpack beside the final directory and rename, so an interrupted run
  # never leaves a half-unpacked kernel that a later run would accept.
  rm -rf "$dest/.$version.tmp"
  dpkg -x "$deb" "$dest/.$version.tmp"
  [ -f "$dest/.$version.tmp/boot/vmlinuz-$version" ] || die "$pkg has no boot/vmlinuz-$version"
  rm -rf "${dest:?}/$version"
  mv "$dest/.$version.tmp" "$dest/$version"
fi
# The kernel uncompressed, boot/vmlinux-VERSION: QEMU boots that ELF file
# through its PVH entry point, skipping the kernel's self-decompression
# (most of a second under TCG). The compressed payload's place is in the
# bzImage header (boot protocol 2.08+): setup sectors at 0x1f1, payload
# offset and length at 0x248 and 0x24c; its last 4 bytes are the
# uncompressed size. Without a decompressor for its format cage boots the
# compressed kernel, so a missing one is only a note.
extract_vmlinux() {
  local img=$1 out=$2
  u() { od -An -t "u$2" -j "$1" -N "$2" "$img" | tr -d ' '; }
  local sects poff plen start magic tool pkg size
  sects=$(u $((0x1f1)) 1); [ "$sects" = 0 ] && sects=4
  [ "$(u $((0x206)) 2)" -ge $((0x208)) ] || { echo "kernel.sh: $img predates boot protocol 2.08; booting it compressed" >&2; return 0; }
  poff=$(u $((0x248)) 4); plen=$(u $((0x24c)) 4)
  start=$(( (sects + 1) * 512 + poff ))
  magic=$(od -An -t x1 -j "$start" -N 4 "$img" | tr -d ' ')
  case $magic in
    02214c18) tool="lz4 -dc" pkg=lz4 ;;
    1f8b*) tool="gzip -dc" pkg=gzip ;;
    fd377a58) tool="xz -dc" pkg=xz-utils ;;
    28b52ffd) tool="zstd -dcq" pkg=zstd ;;
    *) echo "kernel.sh: unknown compression of $img (magic $magic); booting it compressed" >&2; return 0 ;;
  esac
  if ! command -v "${tool%% *}" >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
      apt_update
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg" >/dev/null
    else
      echo "kernel.sh: no ${tool%% *} to uncompress $img; booting it compressed" >&2
      return 0
    fi
  fi
  size=$(u $((start + plen - 4)) 4)
  dd if="$img" bs=1M iflag=skip_bytes,count_bytes skip="$start" count=$((plen - 4)) status=none |
    $tool >"$out.tmp" || { rm -f "$out.tmp"; die "${tool%% *} could not uncompress $img"; }
  if [ "$(stat -c %s "$out.tmp")" != "$size" ] || [ "$(head -c 4 "$out.tmp" | od -An -t x1 | tr -d ' ')" != 7f454c46 ]; then
    rm -f "$out.tmp"
    die "uncompressing $img gave no ELF kernel of $size bytes"
  fi
  mv "$out.tmp" "$out"
}
boot="$dest/$version/boot"
if [ ! -f "$boot/vmlinux-$version" ]; then
  extract_vmlinux "$boot/vmlinuz-$version" "$boot/vmlinux-$version"
fi

# Debian's package leaves modules.dep to its postinst (depmod); make it here
# so the unpacked tree looks installed. Without depmod (kmod) cage reads each
# module's own dependency list instead, so its absence is not fatal.
if [ ! -s "$dest/$version/lib/modules/$version/modules.dep" ]; then
  if ! command -v depmod >/dev/null && [ "$(id -u)" = 0 ]; then
    apt_update
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kmod >/dev/null
  fi
  if command -v depmod >/dev/null; then
    depmod -b "$dest/$version" "$version" || die "depmod failed for $version"
  fi
fi
ln -sfn "$version" "$dest/current"
echo "$version"
