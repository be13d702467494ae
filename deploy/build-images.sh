#!/usr/bin/env bash
# Builds kvroute's images with podman from a base image you name (run from anywhere; the context is the repository).
#
#   deploy/build-images.sh --make-base                     # debootstrap Debian bookworm, import it as debian-base:local
#   deploy/build-images.sh --base debian-base:local        # then the gateway and the CPU worker from it
#   deploy/build-images.sh --base debian:bookworm-slim --images gateway,worker-cpu,worker-cuda
#
# Options:
#   --base IMAGE      the base of the gateway and CPU worker images: a Debian bookworm image (its python3 is the
#                     images' Python). Default: debian-base:local when it exists, else debian:bookworm-slim.
#   --make-base       build debian-base:local first: `debootstrap --variant=minbase bookworm` into a temporary
#                     directory, `podman import` of its tarball (needs root and debootstrap; about 200 MB).
#   --mirror URL      the Debian mirror debootstrap fetches from (default http://deb.debian.org/debian).
#   --images LIST     comma-separated, from gateway, worker-cpu, worker-cuda (default: gateway,worker-cpu; empty:
#                     none, e.g. with --make-base alone).
#   --wheels DIR      a folder of wheels the builds may install from (mounted read-only into each build as
#                     PIP_FIND_LINKS); torch then comes from pip's index and DIR instead of download.pytorch.org
#                     (e.g. a local torch==2.13.0+cpu wheel: the CPU worker then builds without that host).
#   --ca-bundle FILE  a CA bundle pip must trust (mounted read-only as PIP_CERT), where a proxy re-signs TLS.
#   --tag TAG         the images' tag (default: pyproject.toml's version, which the chart's appVersion follows).
#   --registry NAME   the images' repository prefix (default ghcr.io/kvroute, the chart's default).
#
# The images are ${registry}/kvroute-gateway, ${registry}/kvroute-worker-cpu and ${registry}/kvroute-worker
# (CUDA). Builds run with chroot isolation (no OCI runtime, so no cgroup or rlimit set-up), the form that works
# inside containers and sandboxes as well as on a plain host; the Docker image format keeps each HEALTHCHECK.
# Each step's time is printed.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
base=""
make_base=0
mirror=http://deb.debian.org/debian
images=gateway,worker-cpu
wheels=""
ca_bundle=""
tag=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -n 1)
registry=ghcr.io/kvroute

die() { echo "build-images: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base=${2:?--base needs an image}; shift 2 ;;
    --make-base) make_base=1; shift ;;
    --mirror) mirror=${2:?--mirror needs a URL}; shift 2 ;;
    --images) images=${2?--images needs a list (empty: none)}; shift 2 ;;
    --wheels) wheels=$(cd "${2:?--wheels needs a folder}" && pwd); shift 2 ;;
    --ca-bundle) ca_bundle=$(realpath "${2:?--ca-bundle needs a file}"); shift 2 ;;
    --tag) tag=${2:?--tag needs a tag}; shift 2 ;;
    --registry) registry=${2:?--registry needs a name}; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
command -v podman >/dev/null || die "podman is not installed (Debian: apt-get install -y podman)"

timed() {
  local label=$1 start=$SECONDS
  shift
  "$@"
  echo "build-images: $label took $((SECONDS - start)) s" >&2
}

make_debian_base() {
  command -v debootstrap >/dev/null || die "debootstrap is not installed (Debian: apt-get install -y debootstrap)"
  rootfs=$(mktemp -d /tmp/kvroute-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/dev/null
  # debootstrap leaves the mirror it used as the image's apt source.
  tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - debian-base:local >/dev/null
  rm -rf "$rootfs"
}

if [ "$make_base" = 1 ]; then
  timed "debootstrap + import of debian-base:local" make_debian_base
fi
if [ -z "$base" ]; then
  if podman image exists debian-base:local; then base=debian-base:local; else base=debian:bookworm-slim; fi
fi

build() {
  local dockerfile=$1 target=$2 image=$3
  local args=(build --isolation chroot --format docker -f "$ROOT/deploy/docker/$dockerfile" --target "$target"
    --build-arg "BASE_IMAGE=$base" -t "$image")
  if [ -n "$wheels" ]; then
    args+=(--volume "$wheels:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels
      --build-arg TORCH_CPU_INDEX= --build-arg TORCH_CUDA_INDEX=)
  fi
  if [ -n "$ca_bundle" ]; then
    args+=(--volume "$ca_bundle:/etc/kvroute-build-ca.pem:ro" --build-arg PIP_CERT=/etc/kvroute-build-ca.pem)
  fi
  # The Dockerfile's own .dockerignore narrows the context to the package's sources.
  timed "$image" podman "${args[@]}" --ignorefile "$ROOT/deploy/docker/$dockerfile.dockerignore" "$ROOT"
}

IFS=, read -r -a wanted <<<"$images"
for name in "${wanted[@]}"; do
  case "$name" in
    gateway) build gateway.Dockerfile gateway "$registry/kvroute-gateway:$tag" ;;
    worker-cpu) build worker.Dockerfile worker-cpu "$registry/kvroute-worker-cpu:$tag" ;;
    worker-cuda) build worker.Dockerfile worker-cuda "$registry/kvroute-worker:$tag" ;;
    *) die "unknown image $name (gateway, worker-cpu, worker-cuda)" ;;
  esac
done
