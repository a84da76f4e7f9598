#!/usr/bin/env bash
# The CPU image of sapo-node, built and checked on this machine without an image registry (docs/CONTAINER.md):
#   base   a Debian base made here (mmdebstrap, else debootstrap) and imported with `podman import`
#   image  the repository's Dockerfile built on that base with buildah (--isolation chroot)
#   check  `sapo-node --help`; a 3-round silo on the embedded model with a host directory mounted as the
#          container's volume /data (run dir /data/run, model cache /data/model-cache); one more round in a
#          new container, resumed from that directory (the volume outlives the container)
# `podman run` needs cgroups that some machines (CI sandboxes) do not give; `buildah run --isolation chroot`
# does without. Not part of CI: it takes minutes and a Debian mirror.
#
#   sudo bash scripts/container/build.sh [base|image|check|all]      (default: all)
#
# Settings (environment):
#   SAPO_IMAGE            the image's name (localhost/sapo-node:cpu)
#   SAPO_BASE_IMAGE       build on this image instead of a local base (python:3.11-slim where a registry answers)
#   SAPO_DEBIAN_SUITE     the local base's Debian release (bookworm: Python 3.11)
#   SAPO_DEBIAN_MIRROR    its mirror (http://deb.debian.org/debian)
#   SAPO_TORCH_INDEX_URL  where torch comes from (default: the Dockerfile's, the PyTorch CPU index)
#   SAPO_WHEELS           a directory of wheels mounted into the build as pip's find-links, e.g. a torch CPU
#                         wheel where the PyTorch index is out of reach (with SAPO_TORCH_INDEX_URL=https://pypi.org/simple)
#   SAPO_CA_BUNDLE        a CA bundle pip trusts during the build (behind a TLS-inspecting proxy: the host's,
#                         e.g. /etc/ssl/certs/ca-certificates.crt); mounted for the build only
#   SAPO_CONTAINER_WORK   where the base tarball and the check's volume go (/var/tmp/sapo-container)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
IMAGE=${SAPO_IMAGE:-localhost/sapo-node:cpu}
LOCAL_BASE=localhost/sapo-debian-base:${SAPO_DEBIAN_SUITE:-bookworm}
BASE=${SAPO_BASE_IMAGE:-$LOCAL_BASE}
SUITE=${SAPO_DEBIAN_SUITE:-bookworm}
MIRROR=${SAPO_DEBIAN_MIRROR:-http://deb.debian.org/debian}
WORK=${SAPO_CONTAINER_WORK:-/var/tmp/sapo-container}
NODE_UID=10001  # the Dockerfile's user
# What the Dockerfile expects of a base without Python: python3 with venv and ensurepip, bash, useradd
BASE_PACKAGES=python3,python3-venv,ca-certificates,passwd

say() { printf '[container] %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

need() {
  command -v "$1" >/dev/null || die "$1 not found: apt-get install ${2:-$1}"
}

make_base() {
  if [[ "$BASE" != "$LOCAL_BASE" ]]; then
    say "base: $BASE (SAPO_BASE_IMAGE), nothing to make"
    return
  fi
  if podman image exists "$BASE"; then
    say "base: $BASE already here (podman rmi $BASE to make it again)"
    return
  fi
  need podman
  mkdir -p "$WORK"
  local tarball="$WORK/debian-$SUITE.tar"
  say "base: Debian $SUITE (minbase + $BASE_PACKAGES) from $MIRROR into $tarball"
  if command -v mmdebstrap >/dev/null; then
    mmdebstrap --variant=minbase --include="$BASE_PACKAGES" --aptopt='APT::Install-Recommends "false"' \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
      "$SUITE" "$tarball" "$MIRROR"
  else
    need debootstrap "mmdebstrap (or debootstrap)"
    local root="$WORK/debian-$SUITE-root"
    rm -rf "$root"
    debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$root" "$MIRROR"
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
    tar -C "$root" -cf "$tarball" .
    rm -rf "$root"
  fi
  podman import --change 'CMD ["/bin/bash"]' "$tarball" "$BASE" >/dev/null
  rm -f "$tarball"
  say "base: $BASE imported ($(podman image inspect --format '{{.Size}}' "$BASE" | numfmt --to=iec))"
}

build_image() {
  need buildah
  # docker format: the OCI one drops SHELL and HEALTHCHECK
  local args=(--isolation chroot --format docker --layers -f "$REPO/Dockerfile" -t "$IMAGE"
              --build-arg "BASE_IMAGE=$BASE")
  [[ -n "${SAPO_TORCH_INDEX_URL:-}" ]] && args+=(--build-arg "TORCH_INDEX_URL=$SAPO_TORCH_INDEX_URL")
  if [[ -n "${SAPO_WHEELS:-}" ]]; then
    [[ -d "$SAPO_WHEELS" ]] || die "SAPO_WHEELS=$SAPO_WHEELS is not a directory"
    args+=(--volume "$SAPO_WHEELS:/wheels:ro" --build-arg "PIP_FIND_LINKS=/wheels")
  fi
  if [[ -n "${SAPO_CA_BUNDLE:-}" ]]; then
    [[ -f "$SAPO_CA_BUNDLE" ]] || die "SAPO_CA_BUNDLE=$SAPO_CA_BUNDLE is not a file"
    args+=(--volume "$SAPO_CA_BUNDLE:/etc/sapo-build-ca.pem:ro" --build-arg "REQUESTS_CA_BUNDLE=/etc/sapo-build-ca.pem")
  fi
  say "image: buildah bud ${args[*]} $REPO"
  local t0=$SECONDS
  buildah bud "${args[@]}" "$REPO"
  say "image: $IMAGE built in $((SECONDS - t0)) s, $(podman image inspect --format '{{.Size}}' "$IMAGE" | numfmt --to=iec)"
}

# One command in a fresh container of the image (its user, its environment), with `data`'s run/ and model-cache/
# as the volume's /data/run and /data/model-cache (buildah run puts a volume of its own on the image's VOLUME
# /data itself, over a bind mount there).
in_container() {
  local data=$1
  shift
  local ctr
  ctr=$(buildah from --pull-never "$IMAGE")
  local rc=0
  buildah run --isolation chroot --volume "$data/run:/data/run" --volume "$data/model-cache:/data/model-cache" \
    "$ctr" -- "$@" || rc=$?
  buildah rm "$ctr" >/dev/null
  return $rc
}

rounds_in() {
  python3 -c 'import json, sys; print(len([l for l in open(sys.argv[1]) if l.strip()]))' "$1/metrics.jsonl"
}

check_image() {
  need buildah
  local data="$WORK/check-data"
  local run_dir="$data/run"
  rm -rf "$data"
  mkdir -p "$run_dir" "$data/model-cache"
  chown -R "$NODE_UID:$NODE_UID" "$data"  # the image runs as uid 10001 (a bind mount: docs/CONTAINER.md)
  say "check: sapo-node --help"
  in_container "$data" sapo-node --help | head -n 3
  # the embedded model, a silo, small rounds: the image's own defaults otherwise (SAPO_RESUME=1, run dir /data/run)
  local args=(--model default --tasks smoke --generations 4 --num-local 2 --max-new-tokens 32 --eval-every 0
              --checkpoint-every 1)
  say "check: a 3-round silo on the embedded model, $data/{run,model-cache} mounted in the volume /data"
  local t0=$SECONDS
  in_container "$data" sapo-node "${args[@]}" --rounds 3
  [[ "$(rounds_in "$run_dir")" == 3 ]] || die "expected 3 rounds in $run_dir/metrics.jsonl"
  say "check: 3 rounds in $((SECONDS - t0)) s; a new container resumes from the volume"
  t0=$SECONDS
  in_container "$data" sapo-node "${args[@]}" --rounds 4
  [[ "$(rounds_in "$run_dir")" == 4 ]] || die "expected the resumed run to add round 3 in $run_dir/metrics.jsonl"
  grep -q "resumed from round-000002" "$run_dir/node.log" || die "the second container did not resume"
  say "check: resumed and ran round 3 in $((SECONDS - t0)) s (the converted model from /data/model-cache)"
  ls -l "$run_dir" >&2
  say "check: passed ($IMAGE, $(podman image inspect --format '{{.Size}}' "$IMAGE" | numfmt --to=iec))"
}

[[ $EUID -eq 0 ]] || die "run as root (buildah and podman keep their images in /var/lib/containers)"
case "${1:-all}" in
  base) make_base ;;
  image) build_image ;;
  check) check_image ;;
  all) make_base; build_image; check_image ;;
  *) die "usage: $0 [base|image|check|all]" ;;
esac
