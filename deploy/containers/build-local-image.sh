#!/usr/bin/env bash
# Builds the `cpu` stage of deploy/docker/Dockerfile, unchanged, on a machine that reaches no
# image registry, from binaries that are already built:
#   1. the stage's base, `debian:<DEBIAN_RELEASE>-slim`, made locally with mmdebstrap (minbase,
#      docs, man pages and locales left out, as in Debian's slim images) and imported under the
#      name the FROM line asks for; made once and reused (--rebuild-base makes it anew);
#   2. the stage's `build-cpu` input (`COPY --from=build-cpu /out/ ...`) given as a build
#      context: a folder whose out/ holds the Dockerfile's BINARIES, taken from $VLM_BIN_DIR
#      (default target/debug) with their debug info stripped (symbols kept);
#   3. `podman build --target cpu --pull=never` of the Dockerfile itself: the stage's own RUN
#      (apt-get install ca-certificates from the Debian mirror, the vlm user), COPY, USER,
#      EXPOSE and CMD, as a user's `docker build` runs them.
# The release, the binaries and the base name are read from the Dockerfile. Runs podman
# through deploy/containers/podman.sh (its own image store). Idempotent: a second run reuses
# the base and podman's layer cache.
#
# Usage: deploy/containers/build-local-image.sh [--rebuild-base] [TAG]   (default localhost/vlm:local-cpu)
# Env:   VLM_BIN_DIR, VLM_DEBIAN_MIRROR (http://deb.debian.org/debian),
#        VLM_DEBIAN_SECURITY_MIRROR (http://deb.debian.org/debian-security), VLM_CONTAINERS_STATE
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dockerfile="$repo/deploy/docker/Dockerfile"
podman="$here/podman.sh"
state="${VLM_CONTAINERS_STATE:-/var/tmp/vlm-containers}"
bin_dir="${VLM_BIN_DIR:-$repo/target/debug}"
mirror="${VLM_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
security="${VLM_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"

rebuild_base=0
tag="localhost/vlm:local-cpu"
for a in "$@"; do
    case "$a" in
        --rebuild-base) rebuild_base=1 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        -*) echo "unknown option $a" >&2; exit 2 ;;
        *) tag="$a" ;;
    esac
done

log() { printf 'build-local-image: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
t0=$SECONDS

# What the Dockerfile says.
release="$(sed -n 's/^ARG DEBIAN_RELEASE=\([a-z]*\)$/\1/p' "$dockerfile")"
binaries="$(sed -n 's/^ARG BINARIES="\([^"]*\)"$/\1/p' "$dockerfile")"
from="$(sed -n 's/^FROM \(.*\) AS cpu$/\1/p' "$dockerfile")"
[ -n "$release" ] || die "no 'ARG DEBIAN_RELEASE=...' in $dockerfile"
[ -n "$binaries" ] || die "no 'ARG BINARIES=\"...\"' in $dockerfile"
base="${from//\$\{DEBIAN_RELEASE\}/$release}"
[ "$base" = "debian:$release-slim" ] \
    || die "the cpu stage is FROM '$from'; this script makes only a debian:<release>-slim base"
grep -q '^COPY --from=build-cpu /out/ ' "$dockerfile" \
    || die "the cpu stage no longer copies build-cpu's /out/: update this script"
base_ref="docker.io/library/$base"   # what FROM debian:... names

for t in podman mmdebstrap; do
    command -v "$t" >/dev/null 2>&1 || die "$t not found (bash deploy/ci-install.sh installs it)"
done
mkdir -p "$state/tmp"
work="$(mktemp -d "$state/tmp/build.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# 1. The base.
if [ "$rebuild_base" = 0 ] && "$podman" image exists "$base_ref"; then
    log "base $base_ref already there"
else
    log "making $base_ref with mmdebstrap ($mirror)"
    # These dpkg and apt options stay in the image (/etc/dpkg/dpkg.cfg.d, /etc/apt/apt.conf.d),
    # so the stage's own apt-get also leaves docs out, skips fsync and translations, as on the
    # Docker Hub images (their docker, docker-apt-speedup and docker-no-languages files).
    mmdebstrap --variant=minbase --format=tar --quiet \
        --dpkgopt='force-unsafe-io' \
        --aptopt='Acquire::Languages "none"' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/groff/*' \
        --dpkgopt='path-exclude=/usr/share/lintian/overrides/*' \
        "$release" "$work/base.tar" \
        "deb $mirror $release main" \
        "deb $mirror $release-updates main" \
        "deb $security $release-security main"
    "$podman" import --quiet \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["bash"]' \
        --change 'LABEL org.vlm.local-base=mmdebstrap' \
        "$work/base.tar" "$base_ref" >/dev/null
    rm -f "$work/base.tar"
    log "base made ($((SECONDS - t0)) s)"
fi

# 2. The build-cpu input: out/ with the prebuilt binaries.
mkdir -p "$work/build-cpu/out" "$work/context"
for b in $binaries; do
    [ -x "$bin_dir/$b" ] || die "$bin_dir/$b not found: build it first (cargo build --bins, or cargo test --workspace)"
    if command -v strip >/dev/null 2>&1; then
        strip --strip-debug -o "$work/build-cpu/out/$b" "$bin_dir/$b"
    else
        cp "$bin_dir/$b" "$work/build-cpu/out/$b"
    fi
done

# 3. The cpu stage of the Dockerfile (the main context is empty: the stage copies nothing from it).
log "podman build --target cpu -t $tag (binaries from $bin_dir)"
# --network=host: the stage's apt-get reaches the mirror as the host does, whatever bridges and
# NAT rules the machine has (podman's default build network, 10.88.0.0/16, clashes with a
# `cni-podman0` bridge that the machine's own CNI-configured podman may have left).
if ! "$podman" build --pull=never --target cpu --network=host \
    --build-context "build-cpu=$work/build-cpu" \
    -f "$dockerfile" -t "$tag" "$work/context" >"$work/build.log" 2>&1; then
    tail -n 60 "$work/build.log" >&2
    die "podman build failed"
fi
# Images that lost their tag to this build (older binaries); the base and the layer cache stay.
"$podman" image prune -f >/dev/null
log "built $tag ($((SECONDS - t0)) s)"
