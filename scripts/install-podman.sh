#!/bin/sh
# What `make test-deploy` needs beyond .venv: podman (with runc, see
# deploy/podman/containers.conf) and mmdebstrap, from Debian's packages, when missing.
# podman-compose comes with the dev extras.
set -eu
missing=""
for tool in podman runc mmdebstrap; do
	command -v "$tool" >/dev/null || missing="$missing $tool"
done
# Service names resolve on compose networks through CNI's dnsname plugin.
[ -e /usr/lib/cni/dnsname ] || missing="$missing dnsname"
[ -z "$missing" ] && exit 0
echo "installing:$missing" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends podman buildah runc mmdebstrap uidmap \
	slirp4netns fuse-overlayfs containernetworking-plugins \
	golang-github-containernetworking-plugin-dnsname ca-certificates
