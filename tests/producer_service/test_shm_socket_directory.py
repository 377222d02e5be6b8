"""The directories a producer creates on the way to its shm socket are 0750 whatever its umask,
so that members of its group reach the socket (0660) through them: mkdir's mode is filtered by
the umask, and under 077 they would be 0700. Directories that were there already keep their
mode. A real producer process, started under umask 077."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from conftest import ChildLimits, ProducerProcess


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_directories_made_for_the_socket_are_0750_under_umask_077(
    producer_process: Callable[..., ProducerProcess], shm_socket: str
) -> None:
    existing = Path(shm_socket).parent
    existing.chmod(0o700)
    path = existing / "made" / "too" / "shm.sock"
    producer_process(shm_socket=str(path), limits=ChildLimits(umask=0o077))
    assert stat.S_ISSOCK(os.lstat(path).st_mode) and mode(path) == 0o660
    assert mode(existing / "made") == 0o750
    assert mode(existing / "made" / "too") == 0o750
    assert mode(existing) == 0o700, "a directory that was there keeps its mode"
