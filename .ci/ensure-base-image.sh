#!/usr/bin/env bash
# ensure-base-image.sh [TAG]   (default TAG: python:3.11-slim)
#
# Make sure the Docker image TAG exists locally, for `FROM ${BASE_IMAGE}` in the Dockerfile.
#   1. `docker image inspect TAG` works -> nothing to do (a stand-in built here is rebuilt
#      only when the host's CA bundle changed since).
#   2. else `docker pull TAG` (short timeout).
#   3. else build a LOCAL STAND-IN and tag it TAG: a Debian bookworm minbase rootfs made with
#      debootstrap from the host's own apt mirror, with python3 (3.11), python3-venv (pip via
#      ensurepip) and ca-certificates; `python` is a symlink to python3 (as in python:*-slim);
#      the host's CA bundle is copied in and pip is pointed at it (PIP_CERT), because this
#      sandbox reaches PyPI only through a TLS-intercepting egress proxy; then it is loaded
#      with `docker import`. The trimmed rootfs tarball is cached under /var/cache/kvpark so a
#      re-run takes seconds instead of ~1 minute.
#
# Knobs (environment):
#   KVPARK_DEBIAN_MIRROR   apt mirror for debootstrap (default: the host's, else deb.debian.org)
#   KVPARK_CACHE_DIR       cache dir (default /var/cache/kvpark)
#   KVPARK_PULL_TIMEOUT_S  timeout for docker pull (default 30)
#   KVPARK_NO_PULL=1       skip the pull, build the stand-in directly
#   KVPARK_HOST_CA_BUNDLE  CA bundle to copy in (default /etc/ssl/certs/ca-certificates.crt)
set -euo pipefail

TAG=${1:-python:3.11-slim}
SUITE=bookworm                  # Debian 12: python3 is 3.11
INCLUDE=python3,python3-venv,ca-certificates
RECIPE=v1                       # bump when the rootfs recipe below changes
CACHE_DIR=${KVPARK_CACHE_DIR:-/var/cache/kvpark}
PULL_TIMEOUT_S=${KVPARK_PULL_TIMEOUT_S:-30}
HOST_CA=${KVPARK_HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
CA_IN_IMAGE=/etc/ssl/certs/kvpark-host-ca-bundle.crt
T0=$SECONDS

say() { echo "ensure-base-image: $*"; }
die() { echo "ensure-base-image: ERROR: $*" >&2; exit 1; }

if ! command -v docker >/dev/null 2>&1 || ! timeout 15 docker info >/dev/null 2>&1; then
    die "no Docker engine answers; run .ci/ensure-docker.sh first"
fi

ca_sum=none
[ -r "$HOST_CA" ] && ca_sum=$(sha256sum "$HOST_CA" | cut -c1-16)

# --- 1. already there? ------------------------------------------------------------------------------
if docker image inspect "$TAG" >/dev/null 2>&1; then
    standin=$(docker image inspect -f '{{index .Config.Labels "org.kvpark.standin"}}' "$TAG" 2>/dev/null || true)
    if [ -z "$standin" ] || [ "$standin" = "<no value>" ]; then
        say "$TAG present (not a stand-in); nothing to do"
        exit 0
    fi
    have_ca=$(docker image inspect -f '{{index .Config.Labels "org.kvpark.ca-sha256"}}' "$TAG" 2>/dev/null || true)
    if [ "$have_ca" = "$ca_sum" ]; then
        say "$TAG present (local stand-in, $standin); nothing to do"
        exit 0
    fi
    say "$TAG is a stand-in built for another host CA bundle; rebuilding it"
else
    # --- 2. pull ------------------------------------------------------------------------------------
    if [ "${KVPARK_NO_PULL:-0}" != 1 ]; then
        if timeout "$PULL_TIMEOUT_S" docker pull -q "$TAG" >/tmp/kvpark-pull.log 2>&1; then
            say "pulled $TAG in $((SECONDS - T0))s"
            exit 0
        fi
        say "docker pull $TAG failed ($(tail -1 /tmp/kvpark-pull.log | cut -c1-160)); building a local stand-in"
    fi
fi

# --- 3. stand-in --------------------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || die "building the stand-in needs root (debootstrap)"

host_mirror() {
    local f uri=""
    # one-line format: deb [opts] URI SUITE COMPONENTS...
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -r "$f" ] || continue
        uri=$(awk -v s="$SUITE" '$1=="deb" { for (i=2;i<=NF;i++) if ($i ~ /^[a-z]+:\/\//) { if ($(i+1)==s) { print $i; exit } break } }' "$f")
        [ -n "$uri" ] && { echo "$uri"; return; }
    done
    # deb822 format: stanzas with URIs: and Suites:
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -r "$f" ] || continue
        uri=$(awk -v s="$SUITE" '
            BEGIN { RS=""; FS="\n" }
            { u=""; ok=0; deb=0
              for (i=1;i<=NF;i++) {
                if ($i ~ /^Types:/ && $i ~ /[ \t]deb([ \t]|$)/) deb=1
                if ($i ~ /^URIs:/) { split($i, a, /[ \t]+/); u=a[2] }
                if ($i ~ /^Suites:/) { n=split($i, b, /[ \t]+/); for (j=2;j<=n;j++) if (b[j]==s) ok=1 }
              }
              if (deb && ok && u != "") { print u; exit } }' "$f")
        [ -n "$uri" ] && { echo "$uri"; return; }
    done
    echo "http://deb.debian.org/debian"
}
MIRROR=${KVPARK_DEBIAN_MIRROR:-$(host_mirror)}

mkdir -p "$CACHE_DIR"
CACHE_TAR="$CACHE_DIR/standin-rootfs-$SUITE-$RECIPE.tar"
WORK=$(mktemp -d /var/tmp/kvpark-standin.XXXXXX)
cleanup() {
    # debootstrap mounts /proc and /sys inside the target while it runs; never rm -rf through them
    local m
    for m in proc sys dev/pts dev; do
        if mountpoint -q "$WORK/root/$m" 2>/dev/null; then umount -l "$WORK/root/$m" || true; fi
    done
    rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT
ROOT="$WORK/root"

if [ -s "$CACHE_TAR" ]; then
    say "using cached rootfs $CACHE_TAR"
    mkdir -p "$ROOT"
    tar -C "$ROOT" -xpf "$CACHE_TAR"
else
    if ! command -v debootstrap >/dev/null 2>&1 || [ ! -e /usr/share/keyrings/debian-archive-keyring.gpg ]; then
        say "installing debootstrap with apt-get"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null || die "apt-get update failed"
        apt-get install -y -qq debootstrap debian-archive-keyring >/tmp/kvpark-apt-debootstrap.log 2>&1 \
            || die "apt-get install debootstrap failed (log: /tmp/kvpark-apt-debootstrap.log)"
    fi
    say "debootstrap $SUITE from $MIRROR (about a minute)"
    t=$SECONDS
    keyring=()
    [ -e /usr/share/keyrings/debian-archive-keyring.gpg ] && keyring=(--keyring=/usr/share/keyrings/debian-archive-keyring.gpg)
    debootstrap --variant=minbase "${keyring[@]}" --include="$INCLUDE" "$SUITE" "$ROOT" "$MIRROR" \
        >"$WORK/debootstrap.log" 2>&1 || {
        cp "$WORK/debootstrap.log" /tmp/kvpark-debootstrap.log
        tail -20 /tmp/kvpark-debootstrap.log >&2
        die "debootstrap failed (log: /tmp/kvpark-debootstrap.log)"
    }
    for m in proc sys dev/pts; do
        if mountpoint -q "$ROOT/$m" 2>/dev/null; then umount -l "$ROOT/$m" || true; fi
    done
    say "debootstrap took $((SECONDS - t))s; trimming"
    # What python:*-slim also leaves out: package caches, indexes, docs, man pages, translations.
    rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/lib/apt/lists/* \
        "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/* \
        "$ROOT"/var/log/*.log "$ROOT"/var/log/apt/* "$ROOT"/var/cache/debconf/*-old "$ROOT"/tmp/* "$ROOT"/root/.cache
    find "$ROOT/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
    # python:*-slim has `python` too
    ln -sf /usr/bin/python3 "$ROOT/usr/local/bin/python"
    # same dpkg excludes as Debian's docker images, so later apt-get installs stay small as well
    mkdir -p "$ROOT/etc/dpkg/dpkg.cfg.d"
    printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
        'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' \
        'path-exclude /usr/share/locale/*' 'path-include /usr/share/locale/locale.alias' \
        >"$ROOT/etc/dpkg/dpkg.cfg.d/docker-minimal"
    tar -C "$ROOT" -cf "$CACHE_TAR.tmp.$$" . && mv "$CACHE_TAR.tmp.$$" "$CACHE_TAR"
    say "cached rootfs at $CACHE_TAR ($(du -h "$CACHE_TAR" | cut -f1))"
fi

# Host CA bundle: added at import time (not cached) so a changed bundle is picked up.
if [ -r "$HOST_CA" ]; then
    cp "$HOST_CA" "$ROOT$CA_IN_IMAGE"
    # also make it the system bundle, so openssl/curl/python's default context trust it too
    cp "$HOST_CA" "$ROOT/etc/ssl/certs/ca-certificates.crt"
else
    say "warning: no host CA bundle at $HOST_CA; pip in containers may fail TLS behind a proxy"
    ln -sf ca-certificates.crt "$ROOT$CA_IN_IMAGE"
fi

py_ver=$(chroot "$ROOT" /usr/bin/python3 -c 'import platform; print(platform.python_version())' 2>/dev/null || echo unknown)
tar -C "$ROOT" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change "ENV PIP_CERT=$CA_IN_IMAGE" \
    --change "ENV SSL_CERT_FILE=$CA_IN_IMAGE" \
    --change 'ENV PIP_DISABLE_PIP_VERSION_CHECK=1' \
    --change 'ENV PIP_DEFAULT_TIMEOUT=180' \
    --change "LABEL org.kvpark.standin=debian-$SUITE-debootstrap org.kvpark.python=$py_ver" \
    --change "LABEL org.kvpark.ca-sha256=$ca_sum" \
    --change 'CMD ["python3"]' \
    -m "kvpark local stand-in for $TAG (debootstrap $SUITE minbase, python $py_ver)" \
    - "$TAG" >/dev/null || die "docker import failed"

size=$(docker image inspect -f '{{.Size}}' "$TAG" | awk '{ printf "%.0f MB", $1/1e6 }')
say "built local stand-in $TAG (Debian $SUITE, python $py_ver, $size) in $((SECONDS - T0))s"
