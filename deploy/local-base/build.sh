#!/usr/bin/env bash
# Builds a Debian base image without a registry of images: debootstrap a minimal bookworm and
# `docker import` it. The image carries this machine's CA bundle (and tells pip to use it), so
# builds from it reach the package registries wherever this machine does (through a proxy that
# re-signs TLS, too).
#   deploy/local-base/build.sh [TAG] [MIRROR]    # default stepserve-base:bookworm, deb.debian.org
# Needs root, debootstrap and a running Docker daemon. Then build the images FROM it with
# --build-arg BASE_IMAGE=TAG (deploy/README.md, "Without a registry of images").
set -euo pipefail
tag=${1:-stepserve-base:bookworm}
mirror=${2:-http://deb.debian.org/debian}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase bookworm "$root" "$mirror" >&2
# Two copies: the usual path, for tools before Debian's ca-certificates package is installed,
# and one for pip that the package's postinst (which rewrites the usual one) leaves alone.
mkdir -p "$root/etc/ssl/certs"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/pip-ca-bundle.crt"
printf '[global]\ncert = /etc/pip-ca-bundle.crt\n' > "$root/etc/pip.conf"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import - "$tag" >/dev/null
echo "$tag"
