#!/bin/sh
# `make image`: builds the node image from the Containerfile with buildah.
#
# The base is $BASE_IMAGE (a slim Debian Python image by default). When it is neither in local
# storage nor pullable (no registry access), a Debian bookworm base is built with debootstrap
# (Python from Debian) and used instead. The debootstrap root file system is kept in $IMAGE_CACHE,
# outside the repository, and the image layers in buildah's storage (`--layers`), so a warm build
# redoes only the layer of the project's own code.
#
# Environment: IMAGE (the tag), BASE_IMAGE, IMAGE_CACHE, DEBIAN_MIRROR.
set -eu

IMAGE=${IMAGE:-localhost/ztunnel-py:latest}
BASE_IMAGE=${BASE_IMAGE:-docker.io/library/python:3.11-slim-bookworm}
IMAGE_CACHE=${IMAGE_CACHE:-/var/cache/ztunnel-image}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Bump the suffix when the package list changes: the cached base is then rebuilt.
LOCAL_BASE_PACKAGES=python3,python3-venv,ca-certificates
LOCAL_BASE=localhost/ztunnel-py-base:bookworm-1
ROOTFS=$IMAGE_CACHE/bookworm-1

cd "$(dirname "$0")/.."

say() { echo "make image: $*" >&2; }

for tool in buildah; do
  command -v "$tool" >/dev/null 2>&1 || { say "needs $tool (apt-get install buildah)"; exit 1; }
done

have_image() { buildah inspect --type image "$1" >/dev/null 2>&1; }

local_base() {
  if have_image "$LOCAL_BASE"; then
    return 0
  fi
  command -v debootstrap >/dev/null 2>&1 || { say "needs debootstrap (apt-get install debootstrap)"; exit 1; }
  mkdir -p "$IMAGE_CACHE"
  (
    # One builder at a time per cache: a half-written root file system is never used.
    flock 9
    if [ ! -e "$ROOTFS/.complete" ]; then
      say "building a Debian bookworm base with debootstrap in $ROOTFS"
      rm -rf "$ROOTFS.tmp"
      if ! debootstrap --variant=minbase --include="$LOCAL_BASE_PACKAGES" bookworm "$ROOTFS.tmp" \
        "$DEBIAN_MIRROR" >"$IMAGE_CACHE/debootstrap.log" 2>&1; then
        tail -n 20 "$IMAGE_CACHE/debootstrap.log" >&2
        say "debootstrap failed (log: $IMAGE_CACHE/debootstrap.log)"
        exit 1
      fi
      rm -rf "$ROOTFS.tmp"/var/cache/apt/archives/*.deb "$ROOTFS.tmp"/var/lib/apt/lists/*
      rm -rf "$ROOTFS"
      mv "$ROOTFS.tmp" "$ROOTFS"
      touch "$ROOTFS/.complete"
    fi
    if ! have_image "$LOCAL_BASE"; then
      ctr=$(buildah from scratch)
      mnt=$(buildah mount "$ctr")
      tar -C "$ROOTFS" --exclude=./.complete -cf - . | tar -C "$mnt" -xf -
      buildah umount "$ctr" >/dev/null
      buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --cmd /bin/bash "$ctr"
      buildah commit --quiet "$ctr" "$LOCAL_BASE" >/dev/null
      buildah rm "$ctr" >/dev/null
    fi
  ) 9>"$IMAGE_CACHE/.lock"
}

if have_image "$BASE_IMAGE"; then
  base=$BASE_IMAGE
elif timeout 60 buildah pull --quiet "$BASE_IMAGE" >/dev/null 2>&1; then
  base=$BASE_IMAGE
else
  say "cannot pull $BASE_IMAGE: using a local Debian bookworm base ($LOCAL_BASE)"
  local_base
  base=$LOCAL_BASE
fi

# A host that reaches the registries through a TLS-inspecting proxy trusts that proxy's CA in its
# system bundle; the RUN steps get the bundle for pip (mounted for the build only, never in the image).
set --
if [ -s /etc/ssl/certs/ca-certificates.crt ]; then
  set -- --volume /etc/ssl/certs/ca-certificates.crt:/run/host-ca-certificates.crt:ro \
    --build-arg PIP_CERT=/run/host-ca-certificates.crt
fi

say "building $IMAGE from $base"
buildah bud --isolation chroot --layers --quiet \
  --build-arg BASE_IMAGE="$base" "$@" \
  -t "$IMAGE" -f Containerfile . >/dev/null
say "built $IMAGE"
