"""The pool-fits check (producer_service/memory_room.py): how the room is read from cgroup v1,
cgroup v2 and /proc/meminfo laid out as a container or a host shows them, what is refused and
what is only warned about, and the real process refusing a pool that cannot fit."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ChildLimits

from kvpark.producer.config_values import ConfigError
from kvpark.producer.memory_room import (
    BURST_MARGIN_BYTES,
    MemoryRoom,
    check_pool_fits,
    measure_room,
)

MiB = 1024 * 1024
GiB = 1024 * MiB
V1_UNLIMITED = "9223372036854771712"


def fake_root(
    tmp_path: Path,
    cgroup: str,
    files: dict[str, str],
    mem_available_kib: int | None = 20 * 1024 * 1024,
) -> Path:
    """A filesystem root with /proc/self/cgroup, /proc/meminfo and the given cgroup files."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    meminfo = "MemTotal:       24683656 kB\nMemFree:         1000000 kB\n"
    if mem_available_kib is not None:
        meminfo += f"MemAvailable:   {mem_available_kib} kB\n"
    (tmp_path / "proc/meminfo").write_text(meminfo)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    return tmp_path


def test_cgroup_v2_container_limit(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        "0::/\n",
        {"sys/fs/cgroup/memory.max": str(512 * MiB), "sys/fs/cgroup/memory.current": str(40 * MiB)},
    )
    room = measure_room(root)
    assert room == MemoryRoom(472 * MiB, "cgroup memory.max 512 MiB with 40 MiB in use")


def test_cgroup_v2_tightest_ancestor_wins(tmp_path: Path) -> None:
    base = "sys/fs/cgroup/kubepods/pod1"
    root = fake_root(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            f"{base}/ctr/memory.max": "max",
            f"{base}/ctr/memory.current": str(30 * MiB),
            f"{base}/memory.max": str(GiB),
            f"{base}/memory.current": str(100 * MiB),
            "sys/fs/cgroup/kubepods/memory.max": str(8 * GiB),
            "sys/fs/cgroup/kubepods/memory.current": str(2 * GiB),
        },
    )
    room = measure_room(root)
    assert room is not None and room.free_bytes == GiB - 100 * MiB
    assert "1,024 MiB" in room.source


def test_cgroup_v1_container_without_cgroup_namespace(tmp_path: Path) -> None:
    # Docker on cgroup v1: /proc/self/cgroup names the host-side path, which does not exist
    # inside the container; the container's own cgroup is mounted at the controller's root.
    root = fake_root(
        tmp_path,
        "9:name=systemd:/docker/abc\n4:memory:/docker/abc\n3:cpuset:/docker/abc\n",
        {
            "sys/fs/cgroup/memory/memory.limit_in_bytes": str(192 * MiB),
            "sys/fs/cgroup/memory/memory.usage_in_bytes": str(2 * MiB),
        },
    )
    room = measure_room(root)
    assert room == MemoryRoom(190 * MiB, "cgroup memory.limit_in_bytes 192 MiB with 2 MiB in use")


def test_page_cache_is_not_counted_as_used_v1(tmp_path: Path) -> None:
    # Files the container read (its Python modules) are charged to it as page cache, more or
    # less depending on which container read a shared image layer first; the kernel drops them
    # before OOM-killing. Shared memory (the pool, memfds) is not file-backed and stays counted.
    stat = {
        "total_cache": 300 * MiB,
        "total_shmem": 256 * MiB,
        "total_active_file": 15 * MiB,
        "total_inactive_file": 5 * MiB,
        "active_file": 1 * MiB,  # this cgroup alone: v1 counts the subtree under total_
        "total_rss": 32 * MiB,
    }
    root = fake_root(
        tmp_path,
        "4:memory:/docker/abc\n",
        {
            "sys/fs/cgroup/memory/memory.limit_in_bytes": str(512 * MiB),
            "sys/fs/cgroup/memory/memory.usage_in_bytes": str(64 * MiB),
            "sys/fs/cgroup/memory/memory.stat": "\n".join(f"{k} {v}" for k, v in stat.items()),
        },
    )
    room = measure_room(root)
    assert room == MemoryRoom(
        468 * MiB,
        "cgroup memory.limit_in_bytes 512 MiB with 44 MiB in use (20 MiB page cache aside)",
    )
    check_pool_fits(256 * MiB, room)  # the compose demo's pool and limit: enough margin


def test_page_cache_is_not_counted_as_used_v2(tmp_path: Path) -> None:
    counters = {"anon": 30, "file": 40, "shmem": 10, "active_file": 21, "inactive_file": 9}
    stat = "\n".join(f"{key} {mib * MiB}" for key, mib in counters.items())
    root = fake_root(
        tmp_path,
        "0::/\n",
        {
            "sys/fs/cgroup/memory.max": str(512 * MiB),
            "sys/fs/cgroup/memory.current": str(70 * MiB),
            "sys/fs/cgroup/memory.stat": stat,
        },
    )
    room = measure_room(root)
    assert room == MemoryRoom(
        472 * MiB, "cgroup memory.max 512 MiB with 40 MiB in use (30 MiB page cache aside)"
    )


def test_page_cache_larger_than_the_usage_frees_no_more_than_the_limit(tmp_path: Path) -> None:
    # The counters are read one after the other, not atomically: a stat read after pages were
    # charged may exceed the usage read before. The room never exceeds the limit.
    root = fake_root(
        tmp_path,
        "0::/\n",
        {
            "sys/fs/cgroup/memory.max": str(512 * MiB),
            "sys/fs/cgroup/memory.current": str(10 * MiB),
            "sys/fs/cgroup/memory.stat": f"active_file {12 * MiB}\ninactive_file garbage",
        },
    )
    room = measure_room(root)
    assert room is not None and room.free_bytes == 512 * MiB


def test_unlimited_cgroups_leave_mem_available(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        "4:memory:/process_api/x\n0::/\n",
        {
            "sys/fs/cgroup/memory/process_api/x/memory.limit_in_bytes": V1_UNLIMITED,
            "sys/fs/cgroup/memory/process_api/x/memory.usage_in_bytes": str(400 * MiB),
            "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
            "sys/fs/cgroup/memory/memory.usage_in_bytes": str(GiB),
        },
        mem_available_kib=3 * 1024 * 1024,
    )
    assert measure_room(root) == MemoryRoom(3 * GiB, "MemAvailable 3,072 MiB")


def test_mem_available_below_the_cgroup_limit_wins(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        "0::/\n",
        {"sys/fs/cgroup/memory.max": str(16 * GiB), "sys/fs/cgroup/memory.current": "0"},
        mem_available_kib=1024 * 1024,
    )
    assert measure_room(root) == MemoryRoom(GiB, "MemAvailable 1,024 MiB")


def test_nothing_readable_refuses_nothing(tmp_path: Path) -> None:
    assert measure_room(tmp_path) is None  # no /proc, no /sys
    root = fake_root(tmp_path, "garbage\n\n0::/\n", {}, mem_available_kib=None)
    assert measure_room(root) is None  # malformed lines skipped, no limit files, no MemAvailable
    check_pool_fits(64 * GiB, None)  # no room known: no refusal


def test_pool_larger_than_the_room_is_a_config_error() -> None:
    room = MemoryRoom(472 * MiB, "cgroup memory.max 512 MiB with 40 MiB in use")
    with pytest.raises(ConfigError) as err:
        check_pool_fits(512 * MiB, room)
    assert err.value.keys == ("pool_bytes",)
    assert str(err.value).startswith("pool_bytes: 512 MiB does not fit")
    assert "(cgroup memory.max 512 MiB with 40 MiB in use)" in str(err.value)
    assert "\n" not in str(err.value)


def test_pool_without_burst_margin_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvpark")
    room = MemoryRoom(300 * MiB, "cgroup memory.max 320 MiB with 20 MiB in use")
    check_pool_fits(256 * MiB, room)
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("pool_bytes leaves 44 MiB for gRPC's message buffers")
    caplog.clear()
    check_pool_fits(300 * MiB - BURST_MARGIN_BYTES, room)  # exactly the margin: quiet
    assert caplog.records == []


def test_producer_refuses_a_pool_larger_than_mem_available() -> None:
    available_kib = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemAvailable:")
    )
    pool = available_kib * 1024 + GiB

    # Were the check missing, the pool's mmap fails on this cap (exit 1) instead of touching
    # more memory than the machine has.
    cap = ChildLimits(address_space=available_kib * 1024)
    result = subprocess.run(
        cap.wrap([sys.executable, "-m", "producer_service", "--pool-bytes", str(pool)]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("kvpark-producer: config error: pool_bytes: ")
    assert "does not fit" in line and "MemAvailable" in line
