"""Same-host shared memory, client side: a client never maps the producer's pool; it lends the
producer a buffer of its own instead. A `SharedBuffer` is a memfd sealed against shrinking and
growing, mapped here, whose `array` is where an engine builds KV to park or where fetched KV
lands. A `ShmLender` passes that memfd's descriptor to the producer over its `shm_socket`
(SCM_RIGHTS); the producer maps the same pages and copies between them and its pool, so each
byte is copied once, and the seals mean a client cannot make the producer's mapping fault by
truncating the file. A lend lasts until it is released or the lender's connection closes; the
gRPC Park/Fetch name it by its lend id. `find_shared` says whether an array lies inside a live
SharedBuffer, so a client can turn a source or destination into (buffer, offset, length). The
socket's message format is defined here and used by both ends (see "Wire format" below).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import fcntl
import itertools
import json
import mmap
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import numpy as np
from numpy.typing import NDArray

PARK_ROLE = "park"
FETCH_ROLE = "fetch"
ROLES = (PARK_ROLE, FETCH_ROLE)
# How a producer's INVALID_ARGUMENT begins when a Park or Fetch names a lend it does not hold
# (never lent to it, ended, or lent for the other role), or one that ended before the call used
# it. Clients send such a call's bytes again without the lend, and only such a call's: any
# other INVALID_ARGUMENT is the request's own fault, with a lend or without.
LEND_UNKNOWN = "shm_lend_id names no buffer lent"
LEND_ENDED = "the lent buffer was released"
# How the producer's refusal of a lend begins when the memfd is lent to it already (over any
# connection, for either role) and still mapped: it maps each buffer once, since every mapping
# of it costs the producer page tables of its own. Clients use the lend they hold, and a
# buffer another client lent goes without shared memory.
ALREADY_LENT = "the memfd is already lent to this producer"

# Wire format of the shm socket (a Unix stream socket, strictly request then answer):
#   every message is a 4-byte big-endian unsigned length N (1..MAX_MESSAGE_BYTES) followed by
#   N bytes of a UTF-8 JSON object.
#   client -> producer, first:  {"op": "hello", "version": 1, "token": <str>|null}
#     (with tokens configured, a hello without a park or fetch token is refused: a connection
#     that may do nothing does not hold one of the producer's connections; a hello with no
#     "token" key, from clients that send it with each lend only, is let in up to a quota)
#     answer:                   {"ok": true, "version": 1, "epoch": <int>, "calls": true}
#     ("calls": the producer takes call ids, below; an older one leaves it out)
#   client -> producer:         {"op": "lend", "role": "park"|"fetch", "token": <str>|null}
#     with exactly one descriptor as SCM_RIGHTS ancillary data on this message and no other
#     answer:                   {"ok": true, "lend_id": <32 hex>, "nbytes": <int>}
#     (refused, beginning ALREADY_LENT, while the same memfd is lent and mapped already)
#   client -> producer:         {"op": "release", "lend_id": <str>}
#     answer:                   {"ok": true, "released": <bool>}
# A call id, "<lend id>/<n>" (n a decimal integer the client numbers its calls with, in the
# order they start), names one Fetch's use of a lend: the Fetch names it in place of the lend
# id. Releasing a call id leaves the lend as it is; the answer comes once no copy for that call
# runs any more (released: whether the lend is still lent), and from then on a Fetch naming
# call n or a lower number of that lend is refused, so none can start copying afterwards.
# Releasing the lend id itself ends the lend, answered once no call at all holds it.
#   a refusal of any request:   {"ok": false, "error": <str>}
# A client sends its next request only after the answer to the previous one. A protocol
# violation (bad framing or JSON, a descriptor on a message other than lend or before the
# hello's answer, a second request before the answer, no hello first) is answered with a
# refusal when possible and then the producer closes the connection, which ends every lend
# made over it.
PROTOCOL_VERSION = 1
CALL_SEPARATOR = "/"
MAX_MESSAGE_BYTES = 16 * 1024  # far above any real message (a token is the largest field)
LENGTH = struct.Struct("!I")

# Shrinking would make the producer's mapping SIGBUS past the new end; growing would make the
# size it checked stale. SharedBuffer also adds F_SEAL_SEAL (not required of other clients) so
# no seal can be added later, such as one that stops the producer mapping it writable.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def encode_message(message: dict[str, Any]) -> bytes:
    """One framed message: length prefix and compact JSON."""
    payload = json.dumps(message, separators=(",", ":")).encode()
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return LENGTH.pack(len(payload)) + payload


def call_id(lend_id: str, call: int) -> str:
    """The id a Fetch names to use lend `lend_id` as call number `call`."""
    return f"{lend_id}{CALL_SEPARATOR}{call}"


def split_call_id(name: str) -> tuple[str, int | None]:
    """(lend id, call number) of a call id; (name, None) for a plain lend id. ValueError when
    the call number is not a decimal integer >= 0."""
    lend_id, separator, call = name.partition(CALL_SEPARATOR)
    if not separator:
        return name, None
    if not (call.isascii() and call.isdigit()) or len(call) > 20:
        raise ValueError(f"call number {call!r} is not a decimal integer >= 0")
    return lend_id, int(call)


def decode_message(payload: bytes) -> dict[str, Any]:
    """The JSON object in one message's payload; ValueError saying why when it is not one."""
    try:
        message = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        # RecursionError: arrays or objects nested deeper than the parser's stack allows.
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ValueError("not a JSON object")
    return message


class ShmUnavailable(OSError):
    """The producer's shm socket cannot be used: missing, refusing, silent, or not speaking
    this protocol. The message says which."""


class ShmTimedOut(ShmUnavailable):
    """The producer's shm socket did not answer within the time a request was given."""


class ShmBusy(ShmTimedOut):
    """The connection was busy with another request, or still owed an answer to one, for all
    the time this request had. Nothing was sent: the connection and its lends are as they
    were, and a later request may find it free."""


class ShmDisconnected(ShmUnavailable):
    """The lender is not connected: it was closed, or a request failed and closed it (which
    ended its lends). Connecting anew gives a fresh connection."""


class ShmRefused(ShmUnavailable):
    """The producer answered and refused a lend (bad token, the other role's token, an
    unsuitable descriptor, a buffer too large or lent already, too many lends); `reason` is
    its answer."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"producer refused: {reason}")
        self.reason = reason


# --- shared buffers ---------------------------------------------------------------------------

# Live buffers by the start address of their mapping: start -> (end, buffer, serial). Weak, so
# a buffer dropped without close() leaves the registry when it is collected; the serial tells a
# stale entry from a newer buffer mapped at the same address.
_registry_lock = threading.Lock()
_starts: list[int] = []
_entries: dict[int, tuple[int, weakref.ref[SharedBuffer], int]] = {}
_serials = itertools.count()


def _data_address(array: NDArray[Any]) -> int:
    return int(array.__array_interface__["data"][0])


def _register(buffer: SharedBuffer, start: int, serial: int) -> None:
    with _registry_lock:
        if start not in _entries:
            bisect.insort(_starts, start)
        _entries[start] = (start + buffer.nbytes, weakref.ref(buffer), serial)


def _forget(fd: int, start: int, serial: int) -> None:
    """Closes a buffer's descriptor and drops its registry entry (once, from close() or when
    the buffer is collected). Deliberately holds no reference to the buffer."""
    with _registry_lock:
        entry = _entries.get(start)
        if entry is not None and entry[2] == serial:
            del _entries[start]
            del _starts[bisect.bisect_left(_starts, start)]
    os.close(fd)


# A client maps every page of its shared buffer at once, so the first transfer through a new
# buffer does not take a page fault per 4 KiB page on this side (~2 µs each on a VM: 0.27 s
# per 580 MB, more than the copy itself). Not with MAP_POPULATE: Python's mmap() holds the GIL
# through it (~0.1 s per 256 MiB), which stalls an asyncio client's event loop even when the
# buffer is made on a worker thread. madvise(MADV_POPULATE_WRITE) (Linux 5.14) through ctypes,
# which lets go of the GIL, does the same; where the kernel lacks it, pages fault in on use.
MAP_FLAGS = mmap.MAP_SHARED
_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def populate(address: int, nbytes: int, *, writable: bool = True) -> None:
    """Maps every page of the mapping at `address` now, without the GIL (ctypes lets go of
    it). Best effort: a kernel older than Linux 5.14 refuses the advice, and the pages then
    fault in on first use."""
    _libc.madvise(address, nbytes, _MADV_POPULATE_WRITE if writable else _MADV_POPULATE_READ)


class SharedBuffer:
    """`nbytes` of memory in a sealed memfd, mapped read-write here, to lend a producer.

    Every page is allocated up front (posix_fallocate): the memory is charged to this process
    and a shortage fails here, rather than when the producer first touches a page (which would
    charge the producer's cgroup, and which the producer refuses for that reason). And mapped
    up front (`populate`).

    `close()` releases the descriptor and this process's claim on the memory. Arrays taken
    from `array` before must not be used afterwards: they no longer count as shared
    (`find_shared` ignores them) and what a producer still holding a lend writes into them is
    unspecified. They stay safe to touch, though: the mapping is not unmapped while an array
    still references it (numpy holds it through the buffer protocol); it goes with the last
    such array. The producer's own mapping keeps the pages alive until its lend ends.
    """

    def __init__(self, nbytes: int, name: str = "kvpark-shm") -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
            mapping = mmap.mmap(fd, nbytes, MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.nbytes = nbytes
        self.name = name
        self._fd = fd
        self._mmap: mmap.mmap | None = mapping
        self._array: NDArray[np.uint8] | None = np.frombuffer(mapping, dtype=np.uint8)
        self._start = _data_address(self._array)
        populate(self._start, nbytes)
        serial = next(_serials)
        _register(self, self._start, serial)
        self._forget = weakref.finalize(self, _forget, fd, self._start, serial)

    @property
    def closed(self) -> bool:
        return self._array is None

    @property
    def array(self) -> NDArray[np.uint8]:
        """The whole buffer as a writable 1-D uint8 array over the mapping (no copy)."""
        if self._array is None:
            raise ValueError("SharedBuffer is closed")
        return self._array

    @property
    def fd(self) -> int:
        if self._array is None:
            raise ValueError("SharedBuffer is closed")
        return self._fd

    def close(self) -> None:
        """Idempotent. Lends of this buffer are not ended by this: a lend is the lender's."""
        if self._array is None:
            return
        self._forget()  # first, so find_shared stops answering with this buffer
        mapping = self._mmap
        self._array = None
        self._mmap = None
        if mapping is not None:
            # Arrays still referencing the mapping refuse its close: it goes with the last one.
            with contextlib.suppress(BufferError):
                mapping.close()

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self._fd}"
        return f"SharedBuffer({self.nbytes} bytes, {state})"


def find_shared(obj: object) -> tuple[SharedBuffer, int, int] | None:
    """(buffer, byte offset, byte length) when `obj` (a numpy array, a memoryview, or another
    buffer) is a C-contiguous, non-empty range inside a live SharedBuffer, else None. Views,
    slices and reshapes of `buffer.array` qualify; copies and strided views do not."""
    if isinstance(obj, np.ndarray):
        array: NDArray[Any] = obj
    else:
        try:
            array = np.asarray(memoryview(obj))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
    if array.nbytes == 0 or not array.flags.c_contiguous:
        return None
    start = _data_address(array)
    with _registry_lock:
        index = bisect.bisect_right(_starts, start) - 1
        if index < 0:
            return None
        base = _starts[index]
        end, ref, _ = _entries[base]
    buffer = ref()
    if buffer is None or buffer.closed or start + array.nbytes > end:
        return None
    return buffer, start - base, int(array.nbytes)


# --- lending ----------------------------------------------------------------------------------


class ShmLender:
    """The client end of one connection to a producer's shm socket.

    Lends made over it last until `release` or until the connection closes (`close`, process
    exit, or an error on the connection: a request that fails midway leaves the stream out of
    step, so the lender closes and its lends end). Every request is bounded by `timeout_s`.
    Thread-safe: one request at a time. A release whose answer is late is the exception: the
    producer answers it once the copies it waits for are over, so the connection stays, and
    the answer is read before the next request is sent.
    """

    def __init__(self, path: str, token: str | None, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.path = path
        self._token = token
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.epoch: int | None = None
        # Whether the producer takes call ids (call_id()), from its hello.
        self.takes_call_ids = False
        self._inbox = bytearray()  # an answer read in part: the rest follows on the stream
        self._owed = 0  # answers to releases whose caller stopped waiting, still to be read

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self, timeout_s: float | None = None) -> int:
        """Connects and greets the producer; returns its epoch, so the caller can check that
        this socket belongs to the producer it talks gRPC to. Already connected: the epoch.
        `timeout_s` (at most the lender's own) bounds the whole of it."""
        with self._lock:
            if self._sock is not None and self.epoch is not None:
                return self.epoch
            limit = self._limit(timeout_s)
            if limit <= 0:
                raise ShmTimedOut(f"no time left to connect to {self.path}")
            deadline = time.monotonic() + limit
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            except OSError as exc:  # out of descriptors, say: the call goes without shm
                raise ShmUnavailable(f"cannot open a socket for {self.path}: {exc}") from None
            sock.settimeout(limit)
            try:
                sock.connect(self.path)
            except FileNotFoundError:
                sock.close()
                raise ShmUnavailable(f"no shm socket at {self.path}") from None
            except ConnectionRefusedError:
                sock.close()
                raise ShmUnavailable(f"nothing listens on {self.path} (refused)") from None
            except PermissionError:
                sock.close()
                raise ShmUnavailable(
                    f"permission denied on {self.path}: the socket is for its owner and group"
                ) from None
            except TimeoutError:
                sock.close()
                raise ShmTimedOut(f"connecting to {self.path} timed out after {limit:g}s") from None
            except OSError as exc:
                sock.close()
                raise ShmUnavailable(f"cannot connect to {self.path}: {exc}") from None
            self._sock = sock
            hello = {"op": "hello", "version": PROTOCOL_VERSION, "token": self._token}
            answer = self._exchange(hello, (), "handshake", deadline)
            epoch = answer.get("epoch")
            if not answer.get("ok"):
                self._drop()
                raise ShmUnavailable(f"handshake refused by {self.path}: {answer.get('error')}")
            if not isinstance(epoch, int) or isinstance(epoch, bool):
                self._drop()
                raise ShmUnavailable(f"handshake with {self.path} failed: no epoch in the answer")
            self.epoch = epoch
            self.takes_call_ids = answer.get("calls") is True
            return epoch

    def lend(self, buffer: SharedBuffer, role: str, timeout_s: float | None = None) -> str:
        """Lends `buffer` to the producer for Park ("park": it reads chunks from it) or Fetch
        ("fetch": it writes chunks into it); returns the lend id. Raises ShmRefused when the
        producer says no, ShmUnavailable when the connection fails (the lender is closed).
        `timeout_s` (at most the lender's own) bounds the request."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        fd = buffer.fd  # ValueError when the buffer is closed, before anything is sent
        deadline = time.monotonic() + self._limit(timeout_s)
        with self._turn("lend", deadline):
            answer = self._exchange(
                {"op": "lend", "role": role, "token": self._token}, (fd,), "lend", deadline
            )
        if not answer.get("ok"):
            raise ShmRefused(str(answer.get("error")))
        lend_id = answer.get("lend_id")
        if not isinstance(lend_id, str) or not lend_id:
            self.close()
            raise ShmUnavailable(f"lend over {self.path} failed: no lend id in the answer")
        return lend_id

    def release(self, lend_id: str, timeout_s: float | None = None) -> bool:
        """Ends one lend, or one call's use of it for a call id (see the wire format); returns
        once the producer says no copy it waits for runs any more: True if the lend was still
        lent. `timeout_s` (at most the lender's own) bounds the whole of it. ShmBusy: not
        sent. ShmTimedOut: sent, and the answer did not come in time; the connection and its
        lends stay, and the late answer is read before the next request."""
        deadline = time.monotonic() + self._limit(timeout_s)
        with self._turn("release", deadline):
            answer = self._exchange(
                {"op": "release", "lend_id": lend_id}, (), "release", deadline, may_owe=True
            )
        if not answer.get("ok"):
            raise ShmRefused(str(answer.get("error")))
        return answer.get("released") is True

    def close(self) -> None:
        """Closes the connection, which ends every lend made over it. Idempotent."""
        with self._lock:
            self._drop()

    def __enter__(self) -> ShmLender:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @contextlib.contextmanager
    def _turn(self, what: str, deadline: float) -> Iterator[None]:
        """Holds the connection for one request. Waiting for another request on it counts
        against `deadline`; a request that cannot start in time leaves the connection (and
        the lends made over it) as it is."""
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise ShmBusy(f"{what} over {self.path}: the connection stayed busy")
        try:
            if deadline <= time.monotonic():
                raise ShmBusy(f"{what} over {self.path}: no time left")
            yield
        finally:
            self._lock.release()

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        self.epoch = None
        self.takes_call_ids = False
        self._inbox.clear()
        self._owed = 0
        if sock is not None:
            sock.close()

    def _limit(self, timeout_s: float | None) -> float:
        return self._timeout_s if timeout_s is None else max(0.0, min(self._timeout_s, timeout_s))

    def _exchange(
        self,
        message: dict[str, Any],
        fds: tuple[int, ...],
        what: str,
        deadline: float | None = None,
        *,
        may_owe: bool = False,
    ) -> dict[str, Any]:
        """One request and its answer by `deadline` (default: timeout_s from now). Called with
        the lock held. Answers still owed to earlier releases are read first; when they do not
        come in time nothing is sent (ShmBusy). With `may_owe`, an answer that does not come
        in time is owed (read before the next request) and the connection stays. Any other
        failure closes the connection: a half-sent request cannot be resumed."""
        sock = self._sock
        if sock is None:
            raise ShmDisconnected(
                f"{what} over {self.path}: not connected (closed, or a request failed)"
            )
        if deadline is None:
            deadline = time.monotonic() + self._timeout_s
        sent = False
        try:
            while self._owed:
                try:
                    self._read_answer(sock, deadline)
                except TimeoutError:
                    raise ShmBusy(
                        f"{what} over {self.path}: an earlier release is not answered yet"
                    ) from None
                self._owed -= 1
            frame = encode_message(message)
            # A producer that answered and closed before reading (too many connections) makes
            # the send fail, but its answer is still there to read and says why.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                _send(sock, frame, fds, deadline)
            sent = True
            return self._read_answer(sock, deadline)
        except ShmUnavailable:
            raise
        except TimeoutError:
            if may_owe and sent:
                self._owed += 1
                raise ShmTimedOut(
                    f"{what} over {self.path}: not answered in time (the answer is read "
                    "before the next request)"
                ) from None
            self._drop()
            raise ShmTimedOut(f"{what} over {self.path} timed out") from None
        except ValueError as exc:
            self._drop()
            raise ShmUnavailable(
                f"{what} over {self.path} failed: malformed answer: {exc}"
            ) from None
        except OSError as exc:
            self._drop()
            raise ShmUnavailable(f"{what} over {self.path} failed: {exc}") from None

    def _read_answer(self, sock: socket.socket, deadline: float) -> dict[str, Any]:
        """The next answer on the stream by `deadline`. What arrived of it before a timeout
        stays in the inbox, so a later read resumes where this one stopped."""
        inbox = self._inbox
        while True:
            if len(inbox) >= LENGTH.size:
                (size,) = LENGTH.unpack_from(inbox)
                if not 0 < size <= MAX_MESSAGE_BYTES:
                    raise ValueError(f"answer length {size} out of range")
                if len(inbox) >= LENGTH.size + size:
                    payload = bytes(inbox[LENGTH.size : LENGTH.size + size])
                    del inbox[: LENGTH.size + size]
                    return decode_message(payload)
                wanted = LENGTH.size + size - len(inbox)
            else:
                wanted = LENGTH.size - len(inbox)
            sock.settimeout(_remaining(deadline))
            piece = sock.recv(wanted)
            if not piece:
                raise ConnectionError("the producer closed the connection")
            inbox += piece


def _send(sock: socket.socket, frame: bytes, fds: tuple[int, ...], deadline: float) -> None:
    sock.settimeout(_remaining(deadline))
    if not fds:
        sock.sendall(frame)
        return
    sent = socket.send_fds(sock, [frame], list(fds))
    if sent < len(frame):
        sock.settimeout(_remaining(deadline))
        sock.sendall(frame[sent:])


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    return remaining
