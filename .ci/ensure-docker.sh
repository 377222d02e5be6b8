#!/usr/bin/env bash
# Make sure a Docker engine answers `docker info`; start one in the background if not.
#
# Idempotent: if an engine already answers, it does nothing. Otherwise it installs what is
# missing (docker.io, docker-compose, iptables) with apt, starts dockerd under nohup
# (log: /tmp/kvpark-dockerd.log, pid: /tmp/kvpark-dockerd.pid) and waits for it, trying
# fallback flags when the default start fails (vfs storage, then no iptables).
#
# Knobs (environment):
#   KVPARK_DOCKERD_ARGS     extra dockerd flags; when set, used as-is with no fallback chain
#   KVPARK_DOCKERD_WAIT_S   seconds to wait for the engine (default 60)
#   KVPARK_DOCKERD_LOG      log file (default /tmp/kvpark-dockerd.log)
#   KVPARK_DOCKERD_PIDFILE  pid file (default /tmp/kvpark-dockerd.pid)
# After a start, the flags in use are written to /tmp/kvpark-dockerd.flags (empty = defaults),
# so later steps can tell e.g. that the engine runs with --iptables=false.
set -euo pipefail

LOG=${KVPARK_DOCKERD_LOG:-/tmp/kvpark-dockerd.log}
PIDFILE=${KVPARK_DOCKERD_PIDFILE:-/tmp/kvpark-dockerd.pid}
FLAGSFILE=/tmp/kvpark-dockerd.flags
WAIT_S=${KVPARK_DOCKERD_WAIT_S:-60}

say() { echo "ensure-docker: $*"; }
die() { echo "ensure-docker: ERROR: $*" >&2; exit 1; }

engine_ok() { timeout 15 docker info >/dev/null 2>&1; }

describe() {
    docker info --format 'server {{.ServerVersion}}, storage {{.Driver}}, cgroup {{.CgroupDriver}} v{{.CgroupVersion}}' 2>/dev/null \
        || echo "server up"
}

if command -v docker >/dev/null 2>&1 && engine_ok; then
    say "engine already running ($(describe)); nothing to do"
    exit 0
fi

[ "$(id -u)" = 0 ] || die "no Docker engine answers and this is not root: cannot install or start dockerd"

# --- install what is missing -------------------------------------------------------------------
need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v docker >/dev/null 2>&1 || need+=(docker.io)
command -v containerd >/dev/null 2>&1 || need+=(containerd)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
if ! command -v docker-compose >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1; then
    need+=(docker-compose)
fi
installed=""
if [ ${#need[@]} -gt 0 ]; then
    mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
    say "installing ${need[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || die "apt-get update failed"
    apt-get install -y -qq -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        "${need[@]}" >/tmp/kvpark-apt-docker.log 2>&1 \
        || { tail -20 /tmp/kvpark-apt-docker.log >&2; die "apt-get install ${need[*]} failed (log: /tmp/kvpark-apt-docker.log)"; }
    installed=" after installing ${need[*]}"
fi
command -v dockerd >/dev/null 2>&1 || die "dockerd still missing after install"

# --- an engine may be starting already (ours from an earlier call, or someone else's) ----------
wait_engine() {  # wait_engine SECONDS [PID]: 0 when `docker info` works; 1 on timeout or if PID died
    local deadline=$((SECONDS + $1)) pid=${2:-}
    while [ $SECONDS -lt "$deadline" ]; do
        engine_ok && return 0
        if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
            return 1
        fi
        sleep 1
    done
    engine_ok
}

if [ -s "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    pid=$(cat "$PIDFILE")
    say "dockerd pid $pid (from $PIDFILE) is alive but not answering yet; waiting"
    wait_engine "$WAIT_S" "$pid" && { say "engine up: dockerd pid $pid ($(describe))"; exit 0; }
    die "dockerd pid $pid did not answer within ${WAIT_S}s; see $LOG"
fi
other=$(pgrep -x dockerd | head -1 || true)
if [ -n "$other" ]; then
    say "a dockerd (pid $other) not started by this script is running; waiting for it"
    wait_engine "$WAIT_S" "$other" && { say "engine up: dockerd pid $other ($(describe))"; exit 0; }
    die "dockerd pid $other is running but does not answer; see its own log, or stop it and rerun"
fi

# --- start dockerd, with fallbacks ---------------------------------------------------------------
if [ -n "${KVPARK_DOCKERD_ARGS+x}" ]; then
    attempts=("${KVPARK_DOCKERD_ARGS}")
else
    # 1. defaults (overlay2 + iptables NAT: works in this sandbox)
    # 2. vfs storage (overlay not usable, e.g. / is itself overlayfs)
    # 3. vfs and no iptables/bridge NAT (no netfilter); containers then need --network host
    attempts=("" "--storage-driver=vfs" "--storage-driver=vfs --iptables=false --ip6tables=false")
fi

deadline=$((SECONDS + WAIT_S))
: >"$LOG"
for flags in "${attempts[@]}"; do
    left=$((deadline - SECONDS))
    [ $left -gt 5 ] || break
    echo "=== $(date -Is) starting: dockerd $flags" >>"$LOG"
    # shellcheck disable=SC2086  # flags are words on purpose
    nohup dockerd $flags >>"$LOG" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$PIDFILE"
    if wait_engine "$left" "$pid"; then
        echo "$flags" >"$FLAGSFILE"
        say "started dockerd pid $pid${flags:+ with $flags}${installed} ($(describe)); log $LOG"
        exit 0
    fi
    if kill -0 "$pid" 2>/dev/null; then  # alive but never answered: stop it before the next try
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 10); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    echo "=== dockerd ${flags:-(defaults)} failed" >>"$LOG"
    rm -f "$PIDFILE"
done

tail -20 "$LOG" >&2 || true
die "could not get a Docker engine within ${WAIT_S}s (tried: $(printf '[%s] ' "${attempts[@]}")); full log: $LOG"
