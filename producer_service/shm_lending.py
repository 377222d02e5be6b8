"""The producer's shm socket: same-host clients lend it buffers of their own (sealed memfds,
passed with SCM_RIGHTS), which it maps and copies between and its pool, one copy per byte and
nothing of the producer's ever mapped by a client. Who may connect is the socket file's mode
(0660: operators give the prefill and decode workers the producer's group); what a connection
may lend for is the role token, checked by the `authorize` callback exactly as gRPC checks it.
Each buffer is checked before it is mapped (a memfd sealed against shrinking and growing, so
the mapping cannot fault; fully allocated, so the producer's cgroup does not pay for the
client's pages; not larger than max_lend_bytes), lives as long as the client's connection or
until it releases it, and is looked up by its unguessable lend id from the gRPC handlers
(`get`). One thread serves every connection with a selector: lends are rare and each request
is a few syscalls. The message format is kvpark.shm's.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import functools
import logging
import mmap
import os
import secrets
import selectors
import socket
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpark.shm import (
    ALREADY_LENT,
    LENGTH,
    MAX_MESSAGE_BYTES,
    PARK_ROLE,
    PROTOCOL_VERSION,
    REQUIRED_SEALS,
    ROLES,
    decode_message,
    encode_message,
    populate,
    split_call_id,
)

from .logs import LOGGER_NAME

log = logging.getLogger(LOGGER_NAME)

DEFAULT_MAX_LEND_BYTES = 64 * 1024**3
DEFAULT_MAX_CONNECTIONS = 256
# Connections at once whose hello carries no token (clients older than that rule) when tokens
# are configured: they may still lend with their token, but cannot fill the socket.
LEGACY_HELLOS = 16
# Lends mapped at once over all connections. Each holds a descriptor (Python's mmap keeps its
# own duplicate), so this bounds them below what max_connections times the per-connection
# limit would allow (16,384); the producer's descriptor budget counts them and takes fewer
# where the descriptor limit is tight (fd_budget.py).
DEFAULT_MAX_LENDS = 4096
# The server's own descriptors: its socket, its wake-up pair and its selector.
_OWN_DESCRIPTORS = 4
# What one connection holds: its socket, and the descriptor of a lend whose message is still
# arriving (one at most: a second, or one before the hello, ends the connection).
_DESCRIPTORS_PER_CONNECTION = 2
# A lend carries one descriptor; room for a few more so that extras are received (and closed)
# rather than silently dropped by the kernel with MSG_CTRUNC.
_MAX_FDS_PER_READ = 4
# Room for that many descriptors (C ints) in one SCM_RIGHTS message.
_ANCILLARY_BYTES = socket.CMSG_LEN(_MAX_FDS_PER_READ * array.array("i").itemsize)


def descriptors(max_lends: int) -> int:
    """The most descriptors a lending server with `max_lends` and the default connection limit
    holds at once: its own, each connection's, each lend's mapping, and the few its one thread
    takes in only to close them at once (one read's extra descriptors, or a connection beyond
    the limit)."""
    return (
        _OWN_DESCRIPTORS
        + DEFAULT_MAX_CONNECTIONS * _DESCRIPTORS_PER_CONNECTION
        + max_lends
        + _MAX_FDS_PER_READ
    )


SOCKET_MODE = 0o660
# The mode of each directory the producer creates on the way to its socket: group members must
# reach the socket through it.
DIRECTORY_MODE = 0o750
# The socket's name in the private directory it is bound in before it is linked into place.
_STAGING_NAME = "s"
_PAUSE_AFTER_ACCEPT_ERROR_S = 0.05


class LendGone(Exception):
    """The lend ended (released, its client disconnected, or the server stopped)."""


class LentBuffer:
    """One buffer a client lent: the producer's MAP_SHARED mapping of the client's memfd.

    Park lends are mapped read-only (the producer only reads chunks from them), Fetch lends
    read-write. Code that copies from or into `view` holds `acquire()` for the whole copy:
    when the lend ends meanwhile, the mapping stays until the last holder lets go, then it is
    unmapped; a lend that ended cannot be acquired again (LendGone). Memory safety does not
    depend on that discipline: a mapping that some memoryview or array still references when
    the lend ends cannot be closed, so it is left for the last reference to unmap.

    A Fetch that names a call id holds it as that call (`acquire(call)`), so that the client
    can wait for one call's copies without ending the lend (`release_call`, `call_idle`).
    """

    def __init__(
        self,
        lend_id: str,
        role: str,
        mapping: mmap.mmap,
        on_unmapped: Callable[[], None] = lambda: None,
    ) -> None:
        self.lend_id = lend_id
        self.role = role
        self.nbytes = len(mapping)
        # Told once the mapping (and the descriptor it holds) is gone, which may be after the
        # lend ended: a copy still running keeps it.
        self._on_unmapped = on_unmapped
        self._lock = threading.Lock()
        self._mmap: mmap.mmap | None = mapping
        self._view: memoryview | None = memoryview(mapping)
        self._holds = 0
        self._holds_by_call: dict[int, int] = {}
        # Calls numbered up to this one were released: they may not start holding it.
        self._released_calls_through = -1
        self._closed = False
        # Called (from the thread that let go) each time a hold ends, once a release of the
        # lend or of one of its calls was asked: a release waiting for that may be answerable.
        self.on_let_go: Callable[[], None] | None = None

    @property
    def closed(self) -> bool:
        """The lend ended: no new acquire; the mapping may still be held."""
        return self._closed

    @property
    def mapped(self) -> bool:
        return self._mmap is not None

    @property
    def held(self) -> bool:
        """A call (or the prefault of a new lend) holds the mapping now."""
        with self._lock:
            return self._holds > 0

    @property
    def idle(self) -> bool:
        """Ended, and no call holds it: nothing copies into or out of it any more."""
        with self._lock:
            return self._closed and self._holds == 0

    @property
    def view(self) -> memoryview:
        """The whole buffer (read-only for a Park lend). Use it under `acquire()`."""
        view = self._view
        if view is None:
            raise LendGone(f"lend {self.lend_id} ended and was unmapped")
        return view

    def call_idle(self, call: int) -> bool:
        """No hold as call `call` (acquire(call)) is left: no copy for that call runs."""
        with self._lock:
            return call not in self._holds_by_call

    def released_call(self, call: int) -> bool:
        """Call `call` (or a later-numbered one) was released: it may not start holding."""
        with self._lock:
            return call <= self._released_calls_through

    def release_call(self, call: int) -> None:
        """From now on calls numbered up to `call` cannot acquire: once `call_idle(call)`, no
        copy for that call runs or can start. The lend itself stays."""
        with self._lock:
            self._released_calls_through = max(self._released_calls_through, call)

    @contextlib.contextmanager
    def acquire(self, call: int | None = None) -> Iterator[memoryview]:
        """Keeps the mapping while the block runs, even if the lend ends meanwhile; yields
        `view`. Raises LendGone when the lend has already ended, or call `call` was
        released."""
        with self._lock:
            view = self._view
            if self._closed or view is None:
                raise LendGone(f"lend {self.lend_id} ended")
            if call is not None:
                if call <= self._released_calls_through:
                    raise LendGone(f"call {call} of lend {self.lend_id} was released")
                self._holds_by_call[call] = self._holds_by_call.get(call, 0) + 1
            self._holds += 1
        try:
            yield view
        finally:
            with self._lock:
                self._holds -= 1
                if call is not None:
                    left = self._holds_by_call.pop(call) - 1
                    if left:
                        self._holds_by_call[call] = left
                unmap = self._closed and self._holds == 0
            if unmap:
                self._unmap()
            if self.on_let_go is not None:
                self.on_let_go()

    def end(self) -> None:
        """Ends the lend: unmaps now, or when the last `acquire()` block exits. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            unmap = self._holds == 0
        if unmap:
            self._unmap()

    def _unmap(self) -> None:
        with self._lock:
            view, mapping = self._view, self._mmap
            self._view = None
            self._mmap = None
        if view is None or mapping is None:
            return
        try:
            view.release()
            mapping.close()
        except BufferError:
            # A slice or array of the view outlived acquire(): closing now would pull memory
            # from under it, so the mapping (and its descriptor) goes when the last of them
            # is collected, and only then is it no longer counted.
            weakref.finalize(mapping, self._on_unmapped)
            return
        self._on_unmapped()

    def __repr__(self) -> str:
        state = "ended" if self._closed else "lent"
        return f"LentBuffer({self.lend_id[:8]}…, {self.role}, {self.nbytes} bytes, {state})"


class LentCall:
    """One Fetch's use of a lend, as the Fetch named it (a call id): what `get` answers for a
    call id, used as the LentBuffer itself is. Its holds count as that call's."""

    def __init__(self, lent: LentBuffer, call: int) -> None:
        self.lent = lent
        self.call = call
        self.lend_id = lent.lend_id
        self.role = lent.role
        self.nbytes = lent.nbytes

    @property
    def closed(self) -> bool:
        return self.lent.closed or self.lent.released_call(self.call)

    @property
    def view(self) -> memoryview:
        return self.lent.view

    def acquire(self) -> contextlib.AbstractContextManager[memoryview]:
        return self.lent.acquire(self.call)


@dataclass(frozen=True)
class _Waiting:
    """A release waiting to be answered: for the whole lend (call None) or one call."""

    lent: LentBuffer
    call: int | None

    @property
    def answerable(self) -> bool:
        return self.lent.idle if self.call is None else self.lent.call_idle(self.call)

    def answer(self) -> dict[str, Any]:
        # For a call: whether its lend is still lent (one the producer ended on its own is
        # not, and the client lends the buffer anew).
        released = self.call is None or not self.lent.closed
        return {"ok": True, "released": released}


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    greeted: bool = False
    inbox: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)  # received with the message being read
    lends: dict[str, LentBuffer] = field(default_factory=dict)
    legacy_hello: bool = False  # greeted without a token: a client older than the token rule
    deadline: float | None = None  # the current message (or the hello) must be complete by
    releasing: _Waiting | None = None  # a release answered once the copies it waits for end


_LISTENER = "listener"
_WAKE = "wake"


# How long a start (or a stop removing its socket) waits for another on the same path.
PATH_LOCK_WAIT_S = 5.0


@contextlib.contextmanager
def _path_lock(path: str) -> Iterator[None]:
    """Held while a start clears a stale socket at `path` and puts its own in place, and
    while a stop removes its own. Without it, two producers started at once on one path (a
    configuration mistake) could each take the other's new socket, linked but not listening
    yet, for a stale one: one of them would then serve a socket file nobody can reach, and
    say nothing. With it, the second start finds the first listening and refuses to start.

    The lock file (`path` + ".lock", mode 0600) stays beside the socket: removing it would
    open the same race again. One this user may not open (left by a run as another user) is
    not an error: the start goes on without the lock, as it would without this guard."""
    lock_path = path + ".lock"
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(lock_path, flags, 0o600)
    except PermissionError as exc:
        log.warning("shm socket %s: cannot take its lock (%s); going on without it", path, exc)
        yield
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileExistsError(errno.EEXIST, "exists and is not a regular file", lock_path)
        deadline = time.monotonic() + PATH_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise OSError(
                        errno.EADDRINUSE,
                        f"another process has been starting or stopping on this socket for "
                        f"{PATH_LOCK_WAIT_S:g} s (it holds {lock_path})",
                        path,
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


class ShmLendingServer:
    """Serves `path`; `authorize(token, role)` returns None to allow a lend for `role`, else
    the refusal to answer; it runs on the serving thread, so it must be thread-safe and quick.
    `get` is safe from any thread.

    Bounds: max_connections open at once (more are answered with a refusal and closed),
    max_lends_per_connection, max_lends over all connections, max_lend_bytes per buffer, and
    message_timeout_s for a started message (and for the hello after connecting) to arrive
    whole. Each connection holds its socket and, while a lend's message arrives, that lend's
    descriptor; each lend holds one more (the mapping's own).
    """

    def __init__(
        self,
        path: str,
        epoch: int,
        authorize: Callable[[str | None, str], str | None],
        max_lends_per_connection: int = 64,
        max_lend_bytes: int = DEFAULT_MAX_LEND_BYTES,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_lends: int = DEFAULT_MAX_LENDS,
        message_timeout_s: float = 5.0,
    ) -> None:
        if min(max_lends_per_connection, max_lend_bytes, max_connections, max_lends) < 1:
            raise ValueError("limits must be >= 1")
        self.path = path
        self.epoch = epoch
        self._authorize = authorize
        self._max_lends = max_lends_per_connection
        self._max_lend_bytes = max_lend_bytes
        self._max_connections = max_connections
        self._max_total_lends = max_lends
        self._mappings = 0  # lends mapped now, ended or not (under _lock): one descriptor each
        # The files (st_dev, st_ino) of those mappings (under _lock): each memfd is mapped once.
        self._mapped_files: set[tuple[int, int]] = set()
        self._message_timeout_s = message_timeout_s
        self._lock = threading.Lock()  # guards _lends: the gRPC handlers read it
        self._lends: dict[str, LentBuffer] = {}
        self._conns: dict[socket.socket, _Connection] = {}  # the serving thread's alone
        self._selector: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._socket_identity: tuple[int, int] | None = None
        self._stopping = False
        self._stopped = False

    # --- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Creates the socket file (mode 0660; directories missing on its way 0750, whatever
        the umask) and starts serving. A stale socket file (nobody listening) is replaced;
        anything else at the path is an error, never removed."""
        if self._thread is not None or self._stopped:
            raise RuntimeError("ShmLendingServer.start() may be called once")
        parent = os.path.dirname(os.path.abspath(self.path))
        _make_directories(parent)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            with _path_lock(self.path):
                self._clear_stale_socket()
                self._socket_identity = self._bind_privately(listener, parent)
                # Only now, with the file in place at its mode: until listen() every connect
                # is refused, so no client ever gets in under a wider mode.
                listener.listen(64)
            listener.setblocking(False)
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._selector = selectors.DefaultSelector()
            self._selector.register(listener, selectors.EVENT_READ, _LISTENER)
            self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        except BaseException:
            listener.close()
            self._unlink_own_socket()
            self._close_wake()
            raise
        self._listener = listener
        self._thread = threading.Thread(target=self._serve, name="kvpark-shm-lending", daemon=True)
        self._thread.start()
        log.info("shm lending socket at %s", self.path)

    def stop(self) -> None:
        """Closes every connection, ends every lend, removes the socket file. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping = True
        thread = self._thread
        if thread is not None:
            self._wake()
            thread.join(timeout=10)
        self._close_all()
        self._unlink_own_socket()
        self._close_wake()

    def get(self, lend_id: str, role: str) -> LentBuffer | LentCall | None:
        """The live buffer lent under `lend_id` for `role`, or for a call id that call's use of
        it; None for an unknown or ended lend, one lent for the other role, or a call id that
        is malformed or was released."""
        try:
            base, call = split_call_id(lend_id)
        except ValueError:
            return None
        with self._lock:
            lent = self._lends.get(base)
        if lent is None or lent.role != role or lent.closed:
            return None
        if call is None:
            return lent
        used = LentCall(lent, call)
        return None if used.closed else used

    @property
    def connection_count(self) -> int:
        """Client connections open now (read from any thread: a length, no iteration)."""
        return len(self._conns)

    @property
    def lend_count(self) -> int:
        with self._lock:
            return len(self._lends)

    @property
    def held_lends(self) -> int:
        """Live lends that a call (or the prefault of a new lend) holds now."""
        with self._lock:
            lends = list(self._lends.values())
        return sum(lent.held for lent in lends)

    def _bind_privately(self, listener: socket.socket, parent: str) -> tuple[int, int]:
        """Binds `listener` and puts its file at self.path with SOCKET_MODE; returns the file's
        (st_dev, st_ino).

        Whoever may write `parent` may replace any name in it at any moment, so no mode is
        ever set through a name there (a symlink swapped in after bind would pass the chmod
        on to a file of ours it points at). The socket is bound inside a fresh directory only
        this user can enter, its mode set through that directory's descriptor, then
        hard-linked to self.path: link() never follows a symlink at its target and fails if
        anything is there, so nothing that appeared at the path since the stale check is
        replaced."""
        private = tempfile.mkdtemp(prefix=".kvpark-", dir=parent)
        try:
            dir_fd = os.open(private, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(dir_fd)
                # Not a directory swapped in under the name mkdtemp made: others cannot make
                # one owned by this user, and no one else may enter this one.
                if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
                    raise PermissionError(
                        errno.EPERM, "private directory was replaced; not binding", private
                    )
                # The directory's name may have been swapped for another directory since it
                # was opened: then bind lands there, and the chmod through dir_fd finds nothing.
                listener.bind(os.path.join(private, _STAGING_NAME))
                try:
                    os.chmod(_STAGING_NAME, SOCKET_MODE, dir_fd=dir_fd)
                    staged = os.stat(_STAGING_NAME, dir_fd=dir_fd, follow_symlinks=False)
                    if not stat.S_ISSOCK(staged.st_mode):
                        raise PermissionError(
                            errno.EPERM, "private directory was tampered with", private
                        )
                    os.link(_STAGING_NAME, self.path, src_dir_fd=dir_fd, follow_symlinks=False)
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(_STAGING_NAME, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(private)
        return staged.st_dev, staged.st_ino

    def _unlink_own_socket(self) -> None:
        """Removes self.path if it is still the file this server made: a successor may
        already have replaced it."""
        if self._socket_identity is None:
            return
        # Under the lock: a start that took our closed socket for a stale one may be putting
        # its own in place, and must not lose it to our unlink. A lock not had in time leaves
        # the file, which the next start replaces as stale.
        with contextlib.suppress(OSError), _path_lock(self.path):
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._socket_identity:
                os.unlink(self.path)

    def _clear_stale_socket(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(
                errno.EEXIST, "exists and is not a socket; refusing to replace it", self.path
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        probe.settimeout(1.0)
        try:
            probe.connect(self.path)
        except ConnectionRefusedError:
            # Left by a process that is gone; a live server would have accepted.
            os.unlink(self.path)
            return
        except OSError as exc:
            raise OSError(
                errno.EADDRINUSE, f"cannot tell whether the socket is in use ({exc})", self.path
            ) from None
        finally:
            probe.close()
        raise OSError(errno.EADDRINUSE, "another process serves this socket", self.path)

    def _close_wake(self) -> None:
        for sock in (self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._wake_r = self._wake_w = None

    # --- serving thread -------------------------------------------------------------------------

    def _serve(self) -> None:
        selector, wake = self._selector, self._wake_r
        assert selector is not None and wake is not None
        try:
            while not self._stopping:
                for key, _ in selector.select(self._select_timeout()):
                    if key.data == _LISTENER:
                        self._accept()
                    elif key.data == _WAKE:
                        with contextlib.suppress(OSError):
                            wake.recv(64)
                    elif isinstance(key.data, _Connection) and key.data.sock in self._conns:
                        self._serve_one(key.data)
                self._answer_releases()
                self._expire_slow_messages()
        except Exception:
            log.exception("shm lending server failed; every lend ends")
        finally:
            self._close_all()

    def _serve_one(self, conn: _Connection) -> None:
        """Reads and answers one connection. A failure nobody foresaw in its message ends
        that connection (and its lends), not the server with every client's lends."""
        try:
            self._on_readable(conn)
        except Exception:
            log.exception("shm lending: a message failed unexpectedly; its connection ends")
            self._drop(conn)

    def _select_timeout(self) -> float | None:
        deadlines = [c.deadline for c in self._conns.values() if c.deadline is not None]
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - time.monotonic())

    def _expire_slow_messages(self) -> None:
        now = time.monotonic()
        for conn in list(self._conns.values()):
            if conn.deadline is not None and now >= conn.deadline:
                self._protocol_error(conn, f"message incomplete after {self._message_timeout_s}s")

    def _accept(self) -> None:
        listener, selector = self._listener, self._selector
        assert listener is not None and selector is not None
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                # Out of descriptors, most likely: the listener stays readable, so pause
                # rather than spin; the connection waits in the backlog.
                log.warning("shm socket accept failed: %s", exc)
                time.sleep(_PAUSE_AFTER_ACCEPT_ERROR_S)
                return
            if len(self._conns) >= self._max_connections:
                with contextlib.suppress(OSError):
                    sock.setblocking(False)
                    sock.send(encode_message(_refusal("too many connections to the shm socket")))
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Connection(sock, deadline=time.monotonic() + self._message_timeout_s)
            self._conns[sock] = conn
            selector.register(sock, selectors.EVENT_READ, conn)

    def _on_readable(self, conn: _Connection) -> None:
        try:
            # recvmsg itself: socket.recv_fds (3.11) ignores its flags, and a descriptor
            # received without MSG_CMSG_CLOEXEC would be inherited by any program the producer
            # runs, keeping the client's memory (and the lend's file) open in it.
            data, ancillary, flags, _ = conn.sock.recvmsg(
                LENGTH.size + MAX_MESSAGE_BYTES, _ANCILLARY_BYTES, socket.MSG_CMSG_CLOEXEC
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        # Kept with the connection before anything else can fail: from there they are closed
        # with the message or with the connection, whatever happens.
        conn.fds.extend(_received_fds(ancillary))
        # Only a lend carries a descriptor, and only after the hello was answered: one that
        # comes earlier is refused now rather than held until its message completes, so a
        # connection that has shown no token holds nothing of the producer's but its socket.
        if conn.fds and not conn.greeted:
            self._protocol_error(conn, "a descriptor before the hello was answered")
            return
        # A lend carries one descriptor; more, even spread over a message trickled a byte at
        # a time, would pile up beyond the descriptor budget until the message completes.
        if flags & socket.MSG_CTRUNC or len(conn.fds) > 1:
            self._protocol_error(conn, "a lend carries exactly one descriptor, this one more")
            return
        if not data:
            self._drop(conn)  # the client closed: its lends end
            return
        conn.inbox += data
        if conn.deadline is None:
            conn.deadline = time.monotonic() + self._message_timeout_s
        if len(conn.inbox) < LENGTH.size:
            return
        (size,) = LENGTH.unpack_from(conn.inbox)
        if not 0 < size <= MAX_MESSAGE_BYTES:
            self._protocol_error(conn, f"message length {size} out of range")
            return
        if len(conn.inbox) < LENGTH.size + size:
            return
        if len(conn.inbox) > LENGTH.size + size:
            self._protocol_error(conn, "a request sent before the answer to the previous one")
            return
        payload = bytes(conn.inbox[LENGTH.size :])
        conn.inbox.clear()
        conn.deadline = None
        fds, conn.fds = conn.fds, []
        try:
            self._handle(conn, payload, fds)
        finally:
            _close_fds(fds)  # mapped or refused: a mapping holds its own reference

    def _handle(self, conn: _Connection, payload: bytes, fds: list[int]) -> None:
        try:
            message = decode_message(payload)
        except ValueError as exc:
            self._protocol_error(conn, str(exc))
            return
        op = message.get("op")
        if fds and op != "lend":
            self._protocol_error(conn, f"a descriptor on a {op!r} message")
            return
        if conn.releasing is not None:  # strictly request then answer
            self._protocol_error(conn, "a message before the release was answered")
            return
        if not conn.greeted:
            if op != "hello":
                self._protocol_error(conn, "the first message must be hello")
            elif message.get("version") != PROTOCOL_VERSION:
                self._protocol_error(
                    conn, f"protocol version {message.get('version')!r} (this producer: 1)"
                )
            elif (refused := self._refuse_hello(conn, message)) is not None:
                self._protocol_error(conn, refused)
            else:
                conn.greeted = True
                self._answer(
                    conn,
                    {"ok": True, "version": PROTOCOL_VERSION, "epoch": self.epoch, "calls": True},
                )
            return
        if op == "lend":
            self._answer(conn, self._lend(conn, message, fds))
        elif op == "release":
            answer = self._release(conn, message)
            if answer is not None:
                self._answer(conn, answer)
        else:
            self._protocol_error(conn, f"unknown op {op!r}")

    def _refuse_hello(self, conn: _Connection, hello: dict[str, Any]) -> str | None:
        """Why a connection with this hello may not stay, or None. Only a token of some role
        (or a role open to all) earns a connection: every connection takes one of
        max_connections, and one that may lend nothing would only keep others out. A hello
        with no "token" key at all comes from a client older than that rule, which sends its
        token with each lend only; such connections are let in, up to LEGACY_HELLOS at once.
        """
        token = hello.get("token")
        if token is not None and not isinstance(token, str):
            return "token must be a string or null"
        try:
            refusals = [self._authorize(token, role) for role in ROLES]
        except Exception:
            log.exception("shm hello authorization failed")
            return "the producer could not check the token"
        if not all(refusals):
            return None
        if "token" in hello:
            return "the hello needs a park or fetch token"
        legacy = sum(c.legacy_hello for c in self._conns.values())
        if legacy >= LEGACY_HELLOS:
            return f"{legacy} connections whose hello has no token already, the most"
        conn.legacy_hello = True
        return None

    def _lend(self, conn: _Connection, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        role, token = message.get("role"), message.get("token")
        if role not in ROLES:
            return _refusal(f"role must be one of {ROLES}")
        if token is not None and not isinstance(token, str):
            return _refusal("token must be a string or null")
        if len(fds) != 1:
            return _refusal(f"a lend carries exactly one descriptor, this one {len(fds)}")
        try:
            refused = self._authorize(token, role)
        except Exception:
            log.exception("shm lend authorization failed")
            refused = "the producer could not check the token"
        if refused is not None:
            return _refusal(refused)
        if len(conn.lends) >= self._max_lends:
            return _refusal(f"this connection already holds {self._max_lends} lends, the most")
        # Counted as mapped, not as lent: a lend that ended keeps its mapping (and descriptor)
        # while a copy still uses it.
        with self._lock:
            held = self._mappings
        if held >= self._max_total_lends:
            return _refusal(
                f"the producer holds {held} lends, the most it takes (each costs it a file "
                "descriptor); release buffers no longer used"
            )
        mapped = self._map(fds[0], role)
        if isinstance(mapped, str):
            return _refusal(mapped)
        mapping, file = mapped
        lent = LentBuffer(
            secrets.token_hex(16), role, mapping, functools.partial(self._unmapped, file)
        )
        conn.lends[lent.lend_id] = lent
        with self._lock:
            self._lends[lent.lend_id] = lent
        threading.Thread(
            target=_prefault, args=(lent,), name="kvpark-prefault", daemon=True
        ).start()
        return {"ok": True, "lend_id": lent.lend_id, "nbytes": lent.nbytes}

    def _unmapped(self, file: tuple[int, int]) -> None:
        with self._lock:
            self._mappings -= 1
            self._mapped_files.discard(file)

    def _map(self, fd: int, role: str) -> tuple[mmap.mmap, tuple[int, int]] | str:
        """The producer's mapping of a lent descriptor and its file's (st_dev, st_ino), counted
        as mapped until `_unmapped`; or why it is refused."""
        try:
            # F_GET_SEALS first: it answers from the inode for any descriptor (EINVAL unless
            # shmem/hugetlbfs), while fstat of a FUSE or hung NFS file could block this thread,
            # which serves every lend and release.
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                return "the descriptor is not a memfd (it cannot be sealed)"
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return "the descriptor is not a memfd"
            # A hugetlbfs memfd (MFD_HUGETLB; its file system's block is the huge page, a plain
            # memfd's the base page): a page its client frees under our mapping (a punched
            # hole) comes back only from the node's reserved huge pages, and with none free
            # the producer's copy would die of SIGBUS.
            if os.fstatvfs(fd).f_bsize != mmap.PAGESIZE:
                return "the memfd is backed by huge pages (MFD_HUGETLB): lend a plain memfd"
            if seals & REQUIRED_SEALS != REQUIRED_SEALS:
                return "the memfd is not sealed against shrinking and growing"
            st = os.fstat(fd)  # after the seals were seen: the size can no longer change
            if st.st_size <= 0:
                return "the memfd is empty"
            if st.st_size > self._max_lend_bytes:
                return f"{st.st_size} bytes is more than max_lend_bytes {self._max_lend_bytes}"
            # Pages the client never allocated would be allocated by the producer's first
            # touch and charged to the producer's cgroup for as long as the client keeps them.
            if st.st_blocks * 512 < st.st_size:
                return "the memfd is not fully allocated (posix_fallocate it before lending)"
            # Every lend is a mapping of its own, prefaulted: the producer builds page tables
            # for each (about 0.5 MiB per 256 MiB lent), and its RSS counts the buffer again,
            # while the client pays for its memory once. A memfd lent many times over (it may
            # be, up to max_lends) would cost the producer that many times over, so one that
            # is mapped already (lent, or ended while a copy still uses it) is refused. Only
            # this thread adds files, so nothing is mapped between the check and the mmap.
            file = (st.st_dev, st.st_ino)
            with self._lock:
                if file in self._mapped_files:
                    return (
                        f"{ALREADY_LENT} and still mapped (each buffer is mapped once): use the "
                        "lend id it was given, or release that lend before lending it again"
                    )
            prot = mmap.PROT_READ if role == PARK_ROLE else mmap.PROT_READ | mmap.PROT_WRITE
            # Not MAP_POPULATE: this thread answers every lend and release, and mapping a large
            # buffer up front would hold them all (0.26 s per 512 MiB); `_prefault` does it.
            mapping = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, prot)
        except OSError as exc:
            return f"cannot map the buffer: {exc.strerror or exc}"
        with self._lock:
            self._mappings += 1
            self._mapped_files.add(file)
        return mapping, file

    def _release(self, conn: _Connection, message: dict[str, Any]) -> dict[str, Any] | None:
        """Ends a lend, or for a call id one call's use of it. The answer waits until no call
        holds the buffer, or no copy for that call runs (None: answered later by
        `_answer_releases`): a call cut off mid-copy may still be writing into it, and the
        client must not reuse the memory before that copy is over. Waiting for one call lets
        a client settle a cut-off Fetch while other Fetches into the same buffer go on."""
        lend_id = message.get("lend_id")
        if not isinstance(lend_id, str):
            return _refusal("lend_id must be a string")
        try:
            base, call = split_call_id(lend_id)
        except ValueError as exc:
            return _refusal(str(exc))
        lent = conn.lends.get(base)  # only the lending connection may release a lend
        if lent is None:
            return {"ok": True, "released": False}
        if call is None:
            del conn.lends[base]
            self._forget(lent)
        else:
            lent.release_call(call)
        waiting = _Waiting(lent, call)
        lent.on_let_go = self._wake
        if waiting.answerable:
            return waiting.answer()
        conn.releasing = waiting
        return None

    def _answer_releases(self) -> None:
        for conn in list(self._conns.values()):
            waiting = conn.releasing
            if waiting is not None and waiting.answerable:
                conn.releasing = None
                self._answer(conn, waiting.answer())

    def _wake(self) -> None:
        wake = self._wake_w
        if wake is not None:
            with contextlib.suppress(OSError):
                wake.send(b"x")

    def _forget(self, lent: LentBuffer) -> None:
        with self._lock:
            self._lends.pop(lent.lend_id, None)
        lent.end()

    def _answer(self, conn: _Connection, answer: dict[str, Any]) -> None:
        frame = encode_message(answer)
        try:
            # Strict request/answer keeps at most one small answer in flight, so the socket
            # buffer always has room; not sending it whole means the client is broken.
            sent = conn.sock.send(frame)
        except OSError:
            sent = 0
        if sent != len(frame):
            self._drop(conn)

    def _protocol_error(self, conn: _Connection, reason: str) -> None:
        log.debug("shm socket: closing a connection: %s", reason)
        with contextlib.suppress(OSError):
            conn.sock.send(encode_message(_refusal(f"protocol error: {reason}")))
        self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        if self._selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
        conn.sock.close()
        _close_fds(conn.fds)
        conn.fds = []
        for lent in conn.lends.values():
            self._forget(lent)
        conn.lends.clear()

    def _close_all(self) -> None:
        """Ends everything; from the serving thread's exit and from stop(), whichever first."""
        for conn in list(self._conns.values()):
            self._drop(conn)
        with self._lock:
            leftover = list(self._lends.values())
            self._lends.clear()
        for lent in leftover:
            lent.end()
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def _make_directories(path: str) -> None:
    """Creates the directory `path` and any missing above it, each DIRECTORY_MODE whatever the
    umask (mkdir's mode is filtered by it: under 077 the group could not reach the socket).
    Directories that exist are left as they are. Each mode is set through a descriptor opened
    without following a symlink, and only on a directory this user owns: whoever may write a
    directory above may swap the new name for something else before the chmod."""
    missing: list[str] = []
    while not os.path.isdir(path):
        path, name = os.path.split(path)
        missing.append(name)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    fd = os.open(path, flags)
    try:
        for name in reversed(missing):
            try:
                os.mkdir(name, DIRECTORY_MODE, dir_fd=fd)
                made = True
            except FileExistsError:
                made = False  # made by someone else meanwhile: its mode is theirs
            child = os.open(name, flags | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
            if made:
                if os.fstat(fd).st_uid != os.geteuid():
                    raise PermissionError(
                        errno.EPERM, "directory was replaced after it was made", name
                    )
                os.fchmod(fd, DIRECTORY_MODE)
    finally:
        os.close(fd)


def _refusal(error: str) -> dict[str, Any]:
    return {"ok": False, "error": error}


def _received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors in recvmsg's ancillary data (SCM_RIGHTS); anything else is ignored."""
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            # Whole descriptors only: a control message cut short (MSG_CTRUNC) may end
            # part-way through one, and the kernel closed what did not fit.
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return fds.tolist()


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _prefault(lent: LentBuffer) -> None:
    """Maps every page of a new lend, on a thread of its own and without the GIL (ctypes
    releases it), so the first copy through the buffer does not take a page fault per 4 KiB
    page (~2 µs each on a VM: 0.27 s per 580 MB, more than the copy). Holding the lend keeps
    it mapped meanwhile; a release waits for this like for a copy. Best effort: an older
    kernel refuses the advice, and the pages then fault in on first use as before."""
    try:
        with lent.acquire() as view:
            address = np.frombuffer(view, dtype=np.uint8).ctypes.data
            populate(address, len(view), writable=not view.readonly)
    except LendGone:
        pass
