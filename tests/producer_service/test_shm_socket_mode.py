"""The shm socket's file gets its 0660 mode without any chmod through a name others may
change: it is bound and given its mode inside a private directory, then linked into place.
Whoever can write the socket's directory therefore cannot pass the mode on to another file
of the producer's user by swapping a symlink in, and what the start may replace is unchanged:
a stale socket, nothing else."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for

from kvpark.producer import shm_lending
from kvpark.producer.shm_lending import ShmLendingServer

STARTS = 200


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    short = Path(tempfile.mkdtemp(prefix="kvmode", dir="/tmp" if os.path.isdir("/tmp") else None))
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


def lending_server(path: Path) -> ShmLendingServer:
    return ShmLendingServer(str(path), 1, lambda token, role: None)


def test_socket_is_0660_and_bound_in_a_private_directory(sock_dir: Path) -> None:
    path = sock_dir / "shm.sock"
    server = lending_server(path)
    server.start()
    try:
        st = os.lstat(path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
            # The address the socket was bound to: never the configured name, which anyone
            # who may write the directory could have swapped between bind and chmod.
            bound = client.getpeername()
        assert bound != str(path)
        assert os.path.dirname(os.path.dirname(bound)) == str(sock_dir)
        # The private directory is gone; beside the socket only the starts' lock file.
        assert sorted(os.listdir(sock_dir)) == ["shm.sock", "shm.sock.lock"]
    finally:
        server.stop()
    assert not path.exists()


def test_a_symlink_at_the_path_is_refused_and_not_followed(sock_dir: Path) -> None:
    secret = sock_dir / "secret.key"
    secret.write_text("k")
    secret.chmod(0o600)
    path = sock_dir / "shm.sock"
    path.symlink_to(secret)
    server = lending_server(path)
    with pytest.raises(FileExistsError, match="not a socket"):
        server.start()
    server.stop()
    assert path.is_symlink() and os.readlink(path) == str(secret)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_a_stale_socket_is_replaced_and_a_live_one_refused(sock_dir: Path) -> None:
    path = sock_dir / "shm.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens
    first = lending_server(path)
    first.start()
    try:
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o660
        second = lending_server(path)
        with pytest.raises(OSError, match="another process serves this socket"):
            second.start()
        second.stop()
        assert sorted(os.listdir(sock_dir)) == ["shm.sock", "shm.sock.lock"]
    finally:
        first.stop()


RACES = 100


def start_two_at_once(path: Path) -> tuple[list[ShmLendingServer], list[OSError]]:
    """Two lending servers on `path` whose starts run at the same moment: (those that
    started, the errors of those that did not)."""
    servers = [lending_server(path), lending_server(path)]
    ready = threading.Barrier(2)
    started: list[ShmLendingServer] = []
    refused: list[OSError] = []

    def start(server: ShmLendingServer) -> None:
        ready.wait()
        try:
            server.start()
            started.append(server)
        except OSError as exc:
            server.stop()
            refused.append(exc)

    threads = [threading.Thread(target=start, args=(server,)) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return started, refused


def test_of_two_starts_at_once_on_a_stale_socket_one_serves_it_and_one_refuses(
    sock_dir: Path,
) -> None:
    """Two producers configured with one socket path (a mistake) start at the same moment on
    a stale socket file. Each start sees a socket file nobody listens on (the stale one, or
    the other's, linked before it listens): without the start lock each could remove the
    other's, leaving one serving a file that is gone. One must serve the path, the other
    refuse to start."""
    path = sock_dir / "shm.sock"
    for _ in range(RACES):
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(path))
        stale.close()
        started, refused = start_two_at_once(path)
        try:
            assert len(started) == 1 and len(refused) == 1, refused
            assert refused[0].errno == errno.EADDRINUSE
            assert_serves_its_path(started[0], path)
        finally:
            for server in started:
                server.stop()
        assert not path.exists()


def assert_serves_its_path(server: ShmLendingServer, path: Path) -> None:
    """The socket file at `path` is `server`'s: a connection to it reaches that server."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(str(path))
        wait_for(lambda: server.connection_count == 1, what="the connection served")


def test_a_start_or_stop_that_cannot_get_the_path_lock_makes_and_removes_nothing(
    sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = sock_dir / "shm.sock"
    monkeypatch.setattr(shm_lending, "PATH_LOCK_WAIT_S", 0.2)
    with open(f"{path}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another start, stuck
        server = lending_server(path)
        with pytest.raises(OSError, match="another process has been starting or stopping"):
            server.start()
        server.stop()
        assert not path.exists()
    server = lending_server(path)  # the lock is free again
    server.start()
    with open(f"{path}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a start that may be putting its socket in place
        server.stop()
        assert path.exists()  # left for the next start, which replaces it as stale
    restarted = lending_server(path)
    restarted.start()
    assert_serves_its_path(restarted, path)
    restarted.stop()


STARTER = textwrap.dedent(
    """
    import os, sys
    from kvpark.producer.shm_lending import ShmLendingServer
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    server = ShmLendingServer(sys.argv[1], 1, lambda token, role: None)
    server.start()
    server.stop()
    print("started and stopped")
    """
)


def test_a_lock_file_left_by_another_user_does_not_stop_a_start(sock_dir: Path) -> None:
    """A producer run once as another user (root, say, while debugging) leaves its lock file,
    mode 0600: a start that may not open it goes on without the lock, as before it existed."""
    path = sock_dir / "shm.sock"
    lock = Path(f"{path}.lock")
    lock.touch(mode=0o600)
    if os.geteuid() == 0:  # the start runs as nobody, who may not open root's file
        sock_dir.chmod(0o777)
    else:  # nor may this user open a file of mode 0
        lock.chmod(0)
    started = subprocess.run(
        [sys.executable, "-c", STARTER, str(path)], capture_output=True, text=True, timeout=60
    )
    assert started.returncode == 0, started.stderr
    assert "started and stopped" in started.stdout
    assert "cannot take its lock" in started.stderr


ATTACKER = textwrap.dedent(
    """
    import os, stat, sys
    directory, secret = sys.argv[1], sys.argv[2]
    sock, n = os.path.join(directory, "shm.sock"), 0
    open(os.path.join(directory, "ready"), "w").close()
    while os.path.exists(os.path.join(directory, "ready")):
        try:
            st = os.lstat(sock)
        except FileNotFoundError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            link = os.path.join(directory, f"l{n}")
            n += 1
            try:
                os.symlink(secret, link)
                os.rename(link, sock)
            except OSError:
                pass
    """
)


def test_a_symlink_swapped_in_at_start_never_widens_another_file(sock_dir: Path) -> None:
    """Someone who may write the directory swaps a symlink to another file of the producer's
    user in for the socket as soon as it appears, start after start. The deterministic check
    of the same property is the private bind above; this one is the attack itself."""
    secret = Path(tempfile.mkdtemp(prefix="kvsecret")) / "secret.key"
    secret.write_text("k")
    secret.chmod(0o600)
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, str(sock_dir), str(secret)])
    try:
        wait_for(lambda: (sock_dir / "ready").exists(), what="the attacker running")
        for _ in range(STARTS):
            for name in os.listdir(sock_dir):
                if name.startswith("l") or name == "shm.sock":
                    # The attacker may rename its link into place meanwhile.
                    (sock_dir / name).unlink(missing_ok=True)
            server = lending_server(sock_dir / "shm.sock")
            try:
                server.start()
            except OSError:
                pass  # the swap came first and the start refused the symlink
            finally:
                server.stop()
            assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    finally:
        (sock_dir / "ready").unlink(missing_ok=True)
        attacker.wait(timeout=10)
        shutil.rmtree(secret.parent, ignore_errors=True)
