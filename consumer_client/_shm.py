"""A client's access to its producer's shared memory (TRANSPORT_SHM), shared by consumers and
parkers: the buffers it lends, and whether lending works at all.

`shared_buffer(nbytes)` hands out a numpy array backed by a sealed memfd (kvpark.shm). The
first time a load or a park uses one, it is lent to the producer over its `shm_socket` and the
lend id kept; the producer then copies between that memory and its pool, one copy per byte.
Memory that is not in such a buffer still works, through a staging buffer the client lends
for the purpose (one copy more, done by the client).

Shared memory is used only with the producer the client talks gRPC to: the socket's handshake
names its process epoch, and a client that knows its producer's epoch from ServerInfo refuses a
socket of another process. A socket that cannot be reached is not tried again for a while, so
a worker without shared memory pays for the attempt once, not on every load; nor does it make
a staging buffer without a socket to lend it over.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvpark.shm import (
    ALREADY_LENT,
    FETCH_ROLE,
    LEND_ENDED,
    LEND_UNKNOWN,
    SharedBuffer,
    ShmBusy,
    ShmDisconnected,
    ShmLender,
    ShmRefused,
    ShmTimedOut,
    ShmUnavailable,
    call_id,
    find_shared,
    split_call_id,
)

from ._errors import ClientClosedError, UsageError
from ._timeouts import CONCLUSIVE_TIMEOUT_S

log = logging.getLogger("kvpark.client")
# The details of a call refused for its lend alone (the producer does not hold it, or it ended):
# only such a call is worth making again without shared memory. Any other INVALID_ARGUMENT is
# about the request itself and would be refused again on every transport.
LEND_REFUSALS = (LEND_UNKNOWN, LEND_ENDED)


def lend_refused(code: grpc.StatusCode | None, details: str | None) -> bool:
    """Whether a Park or Fetch that ended with `code` and `details` was refused for its lend
    alone."""
    return code == grpc.StatusCode.INVALID_ARGUMENT and (details or "").startswith(LEND_REFUSALS)


# How long a client leaves an unreachable shm socket alone before trying again.
RETRY_AFTER_S = 10.0
HANDSHAKE_TIMEOUT_S = 2.0
# The least a cut-off call waits for the producer to say its copies are over, even with none
# of its own time left (a load cut off by its timeout): what is left of a copy under way and
# the producer seeing the cancel take milliseconds.
SETTLE_GRACE_S = 0.25


def _staging_size(nbytes: int, old: SharedBuffer | None) -> int:
    """The size of a new staging buffer for a load of `nbytes`: twice the old one's when that
    is too small, so loads that grow a little at a time do not each pay for a new buffer; the
    old one's when only a late copy retired it, so a buffer that was big enough does not grow."""
    if old is None:
        return nbytes
    if old.nbytes < nbytes:
        return max(nbytes, 2 * old.nbytes)
    return old.nbytes


class ShmAccess:
    def __init__(
        self,
        socket_path: str | None,
        token: str | None,
        role: str,
        producer_epoch: Callable[[], int | None],
        advertised_path: Callable[[], str | None],
    ) -> None:
        self._path = socket_path
        self._token = token
        self._role = role
        self._producer_epoch = producer_epoch
        self._advertised_path = advertised_path
        self._lender: ShmLender | None = None
        # id(SharedBuffer) -> (the buffer, weakly, its lend id). The weak reference tells a
        # buffer from a later one at the same address; lends of buffers closed or collected
        # (one owned by another client) are released on the next lend, not kept for ever.
        self._lends: dict[int, tuple[weakref.ref[SharedBuffer], str]] = {}
        self._buffers: list[SharedBuffer] = []  # handed out by shared_buffer(), closed with us
        self._staging: SharedBuffer | None = None
        # A cut-off call into the staging buffer did not settle: replace it before reuse.
        self._staging_tainted = False
        self._staging_busy = False
        # Lends to end whose release could not be sent in the time a call had: the next lend
        # sends them (else the producer would keep their memory until the connection ends).
        self._unreleased: list[str] = []
        # Buffers the producer would not take because they are lent to it already (by another
        # client of this process, or over a connection that ended while a copy still used
        # it): not offered again before the time given.
        self._lent_elsewhere: weakref.WeakKeyDictionary[SharedBuffer, float] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._connecting = threading.Lock()
        # One lend at a time: a buffer that two loads want at once is lent once, since the
        # producer maps each buffer once and refuses a second lend of it.
        self._lending = threading.Lock()
        self._down_until = 0.0
        self._closed = False
        # Numbers the Fetches that name a call id, in the order their loads start.
        self._calls = itertools.count()

    # ------------------------------------------------------------------------------ buffers
    def shared_buffer(self, nbytes: int) -> npt.NDArray[np.uint8]:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise UsageError(f"shared_buffer: expected a size in bytes > 0, got {nbytes!r}")
        buffer = SharedBuffer(nbytes)
        with self._lock:
            closed = self._closed
            if not closed:
                self._buffers.append(buffer)
        if closed:
            # close() has run: nothing would ever close this buffer but the garbage collector.
            buffer.close()
            raise ClientClosedError("shared_buffer: the client is closed")
        return buffer.array

    @property
    def has_buffers(self) -> bool:
        """Whether the caller made shared buffers (shared_buffer()) on this client."""
        return bool(self._buffers)

    @property
    def has_socket(self) -> bool:
        """Whether the client was given its shm socket (else it uses the one its producer
        advertises in ServerInfo)."""
        return bool(self._path)

    def lend_of(
        self, obj: Any, timeout_s: float | None = None
    ) -> tuple[str, memoryview, int, int] | None:
        """(lend id, the whole lent buffer, offset, length) when `obj` lies in one of this
        client's shared buffers and lending works; None otherwise. A lend still to be made
        takes at most `timeout_s` (None: HANDSHAKE_TIMEOUT_S). For a Fetch the id is a call
        id of the lend when the producer takes them (`settle`)."""
        found = find_shared(obj)
        if found is None:
            return None
        buffer, offset, length = found
        view = _mapping_of(buffer)
        lend_id = None if view is None else self._lend(buffer, timeout_s)
        if view is None or lend_id is None:
            return None
        return self._for_one_call(lend_id), view, offset, length

    def sole_lend(self, timeout_s: float | None = None) -> str | None:
        """The lend id of this client's only shared buffer (lent now if it was not yet);
        None when it made none or several, or lending does not work. A lend still to be made
        takes at most `timeout_s` (None: HANDSHAKE_TIMEOUT_S)."""
        with self._lock:
            buffers = list(self._buffers)
        return self._lend(buffers[0], timeout_s) if len(buffers) == 1 else None

    def staging(
        self, nbytes: int, timeout_s: float | None = None
    ) -> tuple[str, memoryview, SharedBuffer] | None:
        """A lent buffer of at least `nbytes` for one call at a time (memory that is not in a
        shared buffer goes through it), or None when lending does not work or it is busy.
        Give it back with `unstage`."""
        deadline = _deadline(timeout_s)
        with self._lock:
            if self._staging_busy or self._closed:
                return None
            self._staging_busy = True
            old = self._staging
            tainted = self._staging_tainted
        # A buffer is made (and its every page allocated) only with a socket to lend it over:
        # a worker whose producer offers no shared memory, or whose socket it cannot reach (a
        # decode host across the network), would otherwise keep one the size of its largest
        # load for nothing, and pay for the allocation inside a load's time.
        if self._connected(_left(deadline)) is None:
            self.unstage()
            return None
        buffer = old
        if buffer is None or buffer.nbytes < nbytes or tainted:
            try:
                buffer = SharedBuffer(_staging_size(nbytes, old), "kvpark-staging")
            except (OSError, MemoryError) as exc:
                # Out of descriptors or memory: staging only saves copies, so this call goes
                # over another path, which needs neither a new descriptor nor a second buffer.
                self.unstage()
                log.info("kvpark: shared memory not used for this call: no staging buffer: %s", exc)
                return None
            except BaseException:
                self.unstage()  # not busy for ever
                raise
            with self._lock:
                closed = self._closed
                if not closed:
                    # Only now: a replacement that failed leaves the old buffer retired.
                    self._staging, self._staging_tainted = buffer, False
            if closed:  # close() ran meanwhile and would not see this buffer
                buffer.close()
                self.unstage()
                return None
            if old is not None:
                self._forget(old, deadline)
        view = _mapping_of(buffer)
        lend_id = None if view is None else self._lend(buffer, _left(deadline))
        if view is None or lend_id is None:
            self.unstage()
            return None
        return self._for_one_call(lend_id), view, buffer

    def unstage(self) -> None:
        with self._lock:
            self._staging_busy = False

    def settle(self, lend_id: str, timeout_s: float | None = None) -> None:
        """After a Fetch naming `lend_id` was cut off (timeout, cancel): returns once the
        producer says no copy for that call runs any more, so the caller may reuse the memory
        the call owned without a late copy landing in it.

        For a call id only that call's copies are waited for and the lend stays, so other
        loads into the same buffer go on over shared memory. For a lend id the lend ends,
        which waits for every call holding it, and the buffer is lent again on its next use;
        so is one the producer says it no longer holds. The wait takes `timeout_s` (what is
        left of the load), at least SETTLE_GRACE_S and at most HANDSHAKE_TIMEOUT_S. When the
        producer cannot say so in time, the fact is logged: it may then still finish one copy
        into that memory. The connection and the other lends made over it stay either way."""
        lent, call = split_call_id(lend_id)
        self.expect_late_copies(lend_id)
        if call is None:
            self._forget_lend(lent)
        with self._lock:
            lender = self._lender
        if lender is None:
            return
        wait = HANDSHAKE_TIMEOUT_S if timeout_s is None else max(timeout_s, SETTLE_GRACE_S)
        try:
            still_lent = lender.release(lend_id, wait)
        except ShmUnavailable as exc:
            if call is None and isinstance(exc, ShmBusy):
                # Not sent: the next lend sends it first. A lend left in place would keep the
                # buffer lent, and the producer lends no buffer twice.
                with self._lock:
                    self._unreleased.append(lent)
            log.warning(
                "kvpark: a call cut off while the producer might copy into shared memory did "
                "not settle: a late copy may still land in the memory it owned: %s",
                exc,
            )
            return
        self._retire_staging(lent, False)  # settled: no late copy can land any more
        if not still_lent:
            self._forget_lend(lent)

    def expect_late_copies(self, lend_id: str) -> None:
        """A call naming `lend_id` was cut off: until `settle` hears from the producer that no
        copy of it runs any more, a load that takes the staging buffer meanwhile (an async
        load's caller cancelled the wait for the settle) stages through a new one."""
        self._retire_staging(split_call_id(lend_id)[0], True)

    def _retire_staging(self, lend_id: str, retired: bool) -> None:
        """Whether a late copy may still land in the buffer lent as `lend_id`: while it may and
        that is the staging buffer, the next load stages through a new one (and the old one is
        closed and its lend ended then), so no copy of a cut-off call lands under a later
        load's chunks after they were verified."""
        with self._lock:
            staging = self._staging
            entry = None if staging is None else self._lends.get(id(staging))
            if entry is not None and entry[1] == lend_id:
                self._staging_tainted = retired

    def forget_refused(self, lend_id: str) -> None:
        """After a Park naming `lend_id` was refused for its lend (the producer does not hold
        it): the buffer is lent anew on its next use, and the old lend's release goes with
        that lend. Nothing waits for the release now: the producer maps a Park lend read-only,
        so no late copy can land in the caller's memory, and the park keeps its time for
        sending the chunks inline."""
        self._forget_lend(lend_id)
        with self._lock:
            self._unreleased.append(lend_id)

    def _for_one_call(self, lend_id: str) -> str:
        """The id one Fetch names: a call id of the lend when the producer takes them, so a
        cut-off load waits for its own copies only (`settle`)."""
        lender = self._lender
        if self._role != FETCH_ROLE or lender is None or not lender.takes_call_ids:
            return lend_id
        return call_id(lend_id, next(self._calls))

    def _forget_lend(self, lend_id: str) -> None:
        """The buffer lent as `lend_id` is lent anew on its next use."""
        with self._lock:
            for key, (_, known) in list(self._lends.items()):
                if known == lend_id:
                    del self._lends[key]

    # ------------------------------------------------------------------------------ lending
    def _lend(self, buffer: SharedBuffer, timeout_s: float | None = None) -> str | None:
        """The lend id of `buffer`, lent now if it was not yet; None when lending does not
        work, or the client or the buffer closed meanwhile. Ending lends nobody uses any more
        counts in `timeout_s` (None: HANDSHAKE_TIMEOUT_S for each request)."""
        deadline = _deadline(timeout_s)
        with self._lock:
            if self._lender is not None and not self._lender.connected:
                self._lends.clear()  # the connection ended, and every lend made over it
                self._unreleased.clear()
            unused = [*self._unreleased, *self._stale_lends()]
            self._unreleased.clear()
            entry = self._lends.get(id(buffer))
            known = entry[1] if entry is not None else None
            lender = self._lender
        if unused and lender is not None:
            self._release_unused(lender, unused, deadline)
        if self._closed:
            return None
        if known is not None and lender is not None and self._of_our_producer(lender):
            return known
        lender = self._connected(_left(deadline))
        if lender is None:
            return None
        left = _left(deadline)
        if not self._lending.acquire(timeout=-1 if left is None else left):
            return None  # another lend held it all this call's time
        try:
            return self._lend_once(lender, buffer, deadline)
        finally:
            self._lending.release()

    def _lend_once(
        self, lender: ShmLender, buffer: SharedBuffer, deadline: float | None
    ) -> str | None:
        """`_lend` once it may lend: the lend id another thread got for `buffer` meanwhile,
        else a new one."""
        with self._lock:
            entry = self._lends.get(id(buffer))
            if entry is not None and entry[0]() is buffer:
                return entry[1]
            if self._lent_elsewhere.get(buffer, 0.0) > time.monotonic():
                return None
        left = _left(deadline)
        try:
            lend_id = lender.lend(buffer, self._role, left)
        except (ShmBusy, ShmDisconnected) as exc:
            # Nothing said about the socket: another request held the connection all this
            # call's time, or another thread's failed request closed it (the next call
            # connects anew). Lends made over it, and other loads, are unaffected.
            log.info("kvpark: shared memory not used for this call: %s", exc)
            return None
        except ShmRefused as exc:
            if not exc.reason.startswith(ALREADY_LENT):
                self._down(f"lending a buffer failed: {exc}", exc, left)
                return None
            # Lent by another client of this process (a parker's buffer a consumer loads
            # into), or over a connection that ended while a copy still used it. Shared memory
            # works: only this buffer goes without it (loads stage through the staging buffer)
            # for a while, rather than asking for every call or chunk in vain.
            log.info(
                "kvpark: a shared buffer not lent for %.0fs: it is lent to the producer "
                "already: %s",
                RETRY_AFTER_S,
                exc,
            )
            with self._lock:
                self._lent_elsewhere[buffer] = time.monotonic() + RETRY_AFTER_S
            return None
        except ShmUnavailable as exc:
            self._down(f"lending a buffer failed: {exc}", exc, left)
            return None
        except ValueError:
            if buffer.closed:  # closed meanwhile (its client closed): nothing was sent
                return None
            raise
        with self._lock:
            self._lends[id(buffer)] = (weakref.ref(buffer), lend_id)
        return lend_id

    def _release_unused(
        self, lender: ShmLender, lend_ids: list[str], deadline: float | None
    ) -> None:
        """Ends lends nobody uses any more, within what is left until `deadline` (None: each
        request takes at most HANDSHAKE_TIMEOUT_S). A release that could not be sent in that
        time is sent by the next lend; one sent and not answered in time is answered before
        the connection's next request."""
        for lend_id in lend_ids:
            try:
                lender.release(lend_id, _left(deadline))
            except ShmBusy:
                with self._lock:
                    self._unreleased.append(lend_id)
            except ShmUnavailable:
                pass  # unanswered in time, or the connection ended and every lend with it

    def _stale_lends(self) -> list[str]:
        """Drops (with the lock held) the lends of buffers closed or collected; their ids."""
        stale = []
        for key, (ref, lend_id) in list(self._lends.items()):
            buffer = ref()
            if buffer is None or buffer.closed:
                del self._lends[key]
                stale.append(lend_id)
        return stale

    def _connected(self, timeout_s: float | None = None) -> ShmLender | None:
        # One thread connects at a time: two connections made at once would each replace the
        # other, ending the lends made over the loser. Waiting for it counts in `timeout_s`.
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._connecting.acquire(timeout=wait):
            return None  # another thread is still connecting: this call goes without
        try:
            with self._lock:
                kept = self._lender
            if kept is not None and kept.connected:
                if self._of_our_producer(kept):
                    return kept
                # Connected before the producer's epoch was known, or to a process that has
                # gone since: a new connection, checked as any, tells which.
                kept.close()
            with self._lock:
                if time.monotonic() < self._down_until or self._closed:
                    return None
                path = self._path or self._advertised_path()
                if not path:
                    return None
                lender = ShmLender(path, self._token, HANDSHAKE_TIMEOUT_S)
            left = None if deadline is None else deadline - time.monotonic()
            try:
                epoch = lender.connect(left)
            except ShmUnavailable as exc:
                self._down(f"shm socket {path}: {exc}", exc, left)
                return None
            if not self._of_our_producer(lender):
                lender.close()
                self._down(f"shm socket {path} belongs to another producer (epoch {epoch})")
                return None
            with self._lock:
                # A new connection: the lends made over the last one ended with it.
                self._lender, self._lends, self._unreleased = lender, {}, []
            return lender
        finally:
            self._connecting.release()

    def _of_our_producer(self, lender: ShmLender) -> bool:
        """Whether `lender` is connected to the producer the client talks gRPC to, as far as
        the client knows: a socket of another process is never lent to."""
        expected = self._producer_epoch()
        return expected is None or lender.epoch == expected

    def _down(self, why: str, exc: Exception | None = None, timeout_s: float | None = None) -> None:
        # A request that had too little time to tell says nothing of the socket: the next
        # call tries it again.
        inconclusive = timeout_s is not None and timeout_s < CONCLUSIVE_TIMEOUT_S
        if isinstance(exc, ShmTimedOut) and inconclusive:
            log.info("kvpark: shared memory not used for this call: %s", why)
            return
        log.info("kvpark: shared memory not used for %.0fs: %s", RETRY_AFTER_S, why)
        with self._lock:
            self._down_until = time.monotonic() + RETRY_AFTER_S

    def _forget(self, buffer: SharedBuffer, deadline: float | None) -> None:
        """Closes `buffer` and ends its lend, within what is left until `deadline`."""
        with self._lock:
            entry = self._lends.pop(id(buffer), None)
            lend_id = entry[1] if entry is not None else None
            lender = self._lender
        if lend_id is not None and lender is not None:
            self._release_unused(lender, [lend_id], deadline)
        buffer.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lender, self._lender = self._lender, None
            buffers, self._buffers = self._buffers, []
            staging, self._staging = self._staging, None
        if lender is not None:
            lender.close()  # ends every lend
        for buffer in [*buffers, *([staging] if staging else [])]:
            buffer.close()


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def _left(deadline: float | None) -> float | None:
    """The time left until `deadline` (never negative); None when there is none."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _mapping_of(buffer: SharedBuffer) -> memoryview | None:
    """The whole of `buffer`, or None once it is closed (its client closed meanwhile). Taken
    before a lend, the view keeps the mapping alive for the call that uses it."""
    try:
        return buffer.array.data
    except ValueError:
        return None
