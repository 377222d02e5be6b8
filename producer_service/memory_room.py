"""Whether the pool fits in the memory this process may use, checked before it is allocated.

The pool is allocated and touched page by page at start-up (pool.py). When it does not fit,
touching it does not fail politely: under a container's memory limit the kernel's OOM killer
SIGKILLs the producer half-way (exit 137, nothing in its log, and an orchestrator restarts it
into the same death), and on a host without a limit it may kill another process instead — the
prefill worker next to it. So before allocating, the producer measures its room:

- the memory cgroup(s) it runs in — cgroup v2 `memory.max` / `memory.current`, or v1
  `memory.limit_in_bytes` / `memory.usage_in_bytes` — along its cgroup path up to the mount
  (a container sees its own cgroup at the mount root), the tightest limit winning. The usage
  counts page cache the cgroup was charged for (files it read, e.g. the image's Python
  modules), which the kernel drops before it OOM-kills anyone; `memory.stat`'s file pages are
  taken off it. How much cache a container carries depends on which container happened to read
  a shared image layer first (tens of MiB here), so counting it would make the verdict flap;
- `MemAvailable` from /proc/meminfo: what the kernel can hand out without swapping.

A pool larger than the room is refused with a one-line configuration error naming `pool_bytes`
(exit 2). A pool that fits but leaves less than the README's sizing margin (gRPC's message
buffers, and about 1 KiB per remembered id, `max_tombstones`) is allowed with a warning. When
nothing can be read (no /proc, an unknown cgroup layout), nothing is refused: this check
prevents a certain failure, it never guesses one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .config_values import ConfigError
from .logs import LOGGER_NAME

log = logging.getLogger(LOGGER_NAME)

MiB = 1024 * 1024
# Beyond the pool, the process holds ~60 MiB at start and peaked ~205 MiB above the pool under
# 16 concurrent 4 MiB streams (docs/performance.md); the README sizes the limit at pool + 256.
# This check runs with the start-up part already in use (~35 MiB besides page cache, which it
# does not count), so it asks for the rest.
BURST_MARGIN_BYTES = 192 * MiB
# What one remembered id may cost once its tables are full: a tombstone and a KeepAlive intent,
# each capped at max_tombstones (~0.08 KiB and ~0.47 KiB, plus an id of up to 256 bytes).
REMEMBERED_ID_BYTES = 1024
# cgroup v1 writes "no limit" as a page-rounded LONG_MAX; anything this large is no limit.
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class MemoryRoom:
    """How many more bytes this process can take, and which limit says so."""

    free_bytes: int
    # e.g. "cgroup memory.max 512 MiB with 41 MiB in use (20 MiB page cache aside)",
    # "MemAvailable 3,072 MiB"
    source: str


def _mib(nbytes: int) -> str:
    return f"{nbytes / MiB:,.0f} MiB"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _page_cache_bytes(stat_file: Path, key_prefix: str) -> int:
    """File-backed pages charged to the cgroup, both LRU lists (0 when unreadable). Shared
    memory (tmpfs, memfds, the pool itself) sits on the anon lists, so it stays counted."""
    try:
        lines = stat_file.read_text().splitlines()
    except OSError:
        return 0
    wanted = {f"{key_prefix}active_file", f"{key_prefix}inactive_file"}
    total = 0
    for line in lines:
        key, _, value = line.partition(" ")
        if key in wanted and value.strip().isdigit():
            total += int(value)
    return total


def _cgroup_rooms(root: Path) -> list[MemoryRoom]:
    """One room per memory cgroup limit along this process's cgroup path."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    rooms = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # cgroup v2: one unified hierarchy
            mount = root / "sys/fs/cgroup"
            limit_file, usage_file = "memory.max", "memory.current"
            stat_prefix = ""  # v2's memory.stat already covers the subtree
        elif "memory" in controllers.split(","):  # cgroup v1: the memory controller's own
            mount = root / "sys/fs/cgroup/memory"
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
            stat_prefix = "total_"  # v1's hierarchical counters, like usage_in_bytes
        else:
            continue
        # The process's own cgroup and its ancestors; a container without a cgroup namespace
        # shows its host-side path but has its own cgroup mounted at the root, hence `mount`.
        here = mount / path.lstrip("/")
        for folder in dict.fromkeys([here, *here.parents, mount]):
            if folder != mount and mount not in folder.parents:
                continue
            limit = _read_int(folder / limit_file)
            usage = _read_int(folder / usage_file)
            if limit is None or limit >= _UNLIMITED or usage is None:
                continue
            cache = min(_page_cache_bytes(folder / "memory.stat", stat_prefix), usage)
            source = f"cgroup {limit_file} {_mib(limit)} with {_mib(usage - cache)} in use"
            if cache >= MiB:  # worth a mention
                source += f" ({_mib(cache)} page cache aside)"
            rooms.append(MemoryRoom(max(limit - usage + cache, 0), source))
    return rooms


def _meminfo_room(root: Path) -> list[MemoryRoom]:
    try:
        lines = (root / "proc/meminfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        key, _, value = line.partition(":")
        if key == "MemAvailable" and value.split()[1:] == ["kB"]:
            available = int(value.split()[0]) * 1024
            return [MemoryRoom(available, f"MemAvailable {_mib(available)}")]
    return []


def measure_room(root: Path = Path("/")) -> MemoryRoom | None:
    """The tightest room this process has now, or None when none can be read."""
    rooms = _cgroup_rooms(root) + _meminfo_room(root)
    return min(rooms, key=lambda room: room.free_bytes) if rooms else None


def check_pool_fits(pool_bytes: int, room: MemoryRoom | None, max_tombstones: int = 0) -> None:
    """Raises ConfigError when the pool cannot fit; warns when it leaves less than the sizing
    rule's margin: the message buffers of a burst, and the remembered-id tables once full."""
    if room is None:
        return
    if pool_bytes > room.free_bytes:
        raise ConfigError(
            f"pool_bytes: {_mib(pool_bytes)} does not fit in the memory this producer may use "
            f"({room.source}); allocating it would get the process OOM-killed. Lower "
            "pool_bytes or give the producer more memory (limit >= pool_bytes + 256 MiB)",
            keys=("pool_bytes",),
        )
    remembered_ids_bytes = max_tombstones * REMEMBERED_ID_BYTES
    if pool_bytes + BURST_MARGIN_BYTES + remembered_ids_bytes > room.free_bytes:
        log.warning(
            "pool_bytes leaves %s for gRPC's message buffers and the remembered-id tables "
            "(%s); concurrent multi-MiB streams can need ~%s and max_tombstones (%d) ids ~%s, "
            "so the kernel may OOM-kill the producer under load. Size the memory limit at "
            "pool_bytes + 256 MiB + 1 KiB per max_tombstones, or lower max_tombstones",
            _mib(room.free_bytes - pool_bytes),
            room.source,
            _mib(BURST_MARGIN_BYTES),
            max_tombstones,
            _mib(remembered_ids_bytes),
            extra={
                "kv": {
                    "pool_bytes": pool_bytes,
                    "max_tombstones": max_tombstones,
                    "free_bytes": room.free_bytes,
                }
            },
        )
