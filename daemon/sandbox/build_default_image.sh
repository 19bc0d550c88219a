#!/usr/bin/env bash
# Builds rolloutd's default sandbox image: Debian 12 minbase with bash, coreutils, git, python3,
# ipykernel and pytest, as an Apptainer sandbox folder (and a SIF with --sif). The result is cached
# under OUT_DIR/<hash of this recipe>/, so a second call returns at once.
#   build_default_image.sh OUT_DIR [--sif]     prints the sandbox folder's path on stdout
set -euo pipefail

out_dir=${1:?usage: build_default_image.sh OUT_DIR [--sif]}
want_sif=${2:-}
SUITE=bookworm
PACKAGES_BOOTSTRAP=python3,git,ca-certificates,procps
PACKAGES_APT="python3-ipykernel python3-pytest"

die() { echo "build-image: $*" >&2; exit 1; }
log() { echo "build-image: $*" >&2; }

recipe_hash=$( { cat "$0"; echo "$SUITE $PACKAGES_BOOTSTRAP $PACKAGES_APT"; } | sha256sum | cut -c1-16)
target="$out_dir/debian-$SUITE-$recipe_hash"
sandbox="$target/sandbox"

if [ -f "$target/.complete" ]; then
  if [ "$want_sif" = --sif ] && [ ! -f "$target/image.sif" ]; then
    apptainer build --force "$target/image.sif" "$sandbox" >/dev/null 2>&1 || die "SIF build failed"
  fi
  echo "$sandbox"; exit 0
fi

command -v apptainer >/dev/null || die "apptainer is not installed: run scripts/install-apptainer first"
[ "$(id -u)" = 0 ] || die "building the default image needs root (debootstrap); ask for a prebuilt image or pass your own SIF/sandbox folder"
export DEBIAN_FRONTEND=noninteractive
if ! command -v debootstrap >/dev/null; then
  apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends debootstrap >/dev/null 2>&1 \
    || die "cannot install debootstrap"
fi
mirror=""
[ -r /etc/apt/sources.list.d/debian.sources ] && mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
[ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
[ -n "$mirror" ] || die "no Debian mirror configured in /etc/apt/sources.list.d/debian.sources"

mkdir -p "$out_dir"
work=$(mktemp -d "$out_dir/.build.XXXXXX")
cleanup() {
  for m in proc dev/pts dev sys; do umount "$work/rootfs/$m" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
rootfs="$work/rootfs"

log "debootstrap $SUITE (minbase) from $mirror"
debootstrap --variant=minbase --include="$PACKAGES_BOOTSTRAP" "$SUITE" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
  || { tail -20 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
# debootstrap cannot pull python3-ipykernel (virtual packages behind python3-zmq): apt inside the chroot can.
mount -t proc proc "$rootfs/proc"
log "apt-get install $PACKAGES_APT"
chroot "$rootfs" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
  sh -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends $PACKAGES_APT && apt-get clean && rm -rf /var/lib/apt/lists/*" \
  >"$work/apt.log" 2>&1 || { tail -20 "$work/apt.log" >&2; die "apt-get inside the image failed"; }
umount "$rootfs/proc"
# /etc/passwd and /etc/group ship with the image (Apptainer skips its identity mounts otherwise);
# a world-writable /workspace is where tasks put their files.
mkdir -p "$rootfs/workspace" && chmod 1777 "$rootfs/workspace"

log "apptainer build --sandbox"
rm -rf "$target"; mkdir -p "$target"
apptainer build --force --sandbox "$sandbox" "$rootfs" >"$work/build.log" 2>&1 \
  || { tail -20 "$work/build.log" >&2; die "apptainer build --sandbox failed"; }
if [ "$want_sif" = --sif ]; then
  apptainer build --force "$target/image.sif" "$sandbox" >"$work/sif.log" 2>&1 || die "SIF build failed"
fi
# Readable by every user: cluster users and the tests' unprivileged user start instances from it.
chmod 755 "$out_dir" "$target"
touch "$target/.complete"
echo "$sandbox"
