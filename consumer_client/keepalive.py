"""Keeping leases alive while requests wait in the decode queue (docs/protocol.md, KeepAlive).

A prefill parks a request's KV; the decode worker may admit the request only seconds later.
The producer's lease (`unbound_store_timeout_s`, started by the id's first commit) must not run
out meanwhile, so the worker sends KeepAlive for every queued id, a few times per lease (for an
id not committed yet, KeepAlive records an intent its first commit's lease honours):

    with client.keep_alive(queued_ids) as ka:      # sync: a daemon thread
        ...  ka.add(new_id) ... ka.discard(admitted_id) ...
    async with client.keep_alive(queued_ids) as ka:  # async: a task on the running loop

A keep-alive runs from the moment `keep_alive()` returns it (there is no unstarted state that
would silently do nothing); leaving the block, `stop()`, or closing the client ends it at once.

Each round extends every id's lease to at least `extend_s` from now (0 = the producer's
`unbound_store_timeout_s`); the default interval is a third of the shortest lease the producer
reported in the last round, so two rounds may fail before a lease is at risk. Only leases a
round can extend count: a DELIVERED id's grace only shrinks, and following it would spin the
loop ever faster for nothing. An id the
producer reports TOMBSTONED (consumed, reaped, released) is dropped from the set and recorded in
`ended` with its reason — renewing it cannot help.
Errors never escape the background loop: they are counted, kept in `last_error` and logged
once per change, and the loop keeps trying (the producer may be restarting). Stopping waits for
the loop; a KeepAlive call in flight is bounded by the interval, so a round ends within its own
deadline even against a producer that accepts connections and never answers. After a failed
round the leases last reported are stale, so the next round is paced by the lease a round
grants instead: a short lease (an id at its `max_lease_s` cap) that made a round too short to
renew a large set does not keep every later round that short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from kvpark.durations import MAX_SECONDS

from ._core import extend_seconds, valid_id
from ._errors import ClientClosedError, KVParkError, UsageError
from ._models import IdStatus, State
from ._result import Reason

if TYPE_CHECKING:
    from ._async import AsyncKVConsumer
    from ._sync import KVConsumer

log = logging.getLogger("kvpark.client")

# Interval when the producer's lease is not known yet (it was unreachable so far).
_UNKNOWN_LEASE_INTERVAL_S = 1.0
# Never hammer the producer, even with a tiny lease.
_MIN_INTERVAL_S = 0.05
# One KeepAlive call may take at most this long (and at most one interval).
_MAX_CALL_S = 5.0
# The states whose lease a KeepAlive round extends: a parked id's lease, and the intent of an id
# not committed yet (UNKNOWN with time left).
_EXTENDABLE = (State.PARKED, State.UNKNOWN)


@dataclass(frozen=True, slots=True)
class KeepAliveStatistics:
    rounds: int  # KeepAlive rounds completed (every id answered)
    errors: int  # rounds that failed
    ids: int  # ids being kept alive now
    ended: int  # ids dropped because the producer reported them ended


class _KeepAliveState:
    """The id set and bookkeeping, shared by the thread and the task runners."""

    def __init__(self, ids: Iterable[str], interval_s: float | None, extend_s: float) -> None:
        # bool is an int subclass: `True` is a bug, not one second.
        if interval_s is not None and not (
            isinstance(interval_s, int | float)
            and not isinstance(interval_s, bool)
            and 0 < interval_s <= MAX_SECONDS
        ):
            raise UsageError(
                f"interval_s: expected seconds > 0 and <= {MAX_SECONDS} (one week), "
                f"got {interval_s!r}"
            )
        self.interval_s = interval_s
        self.extend_s = extend_seconds(extend_s)
        # Insertion-ordered set of ids to renew; mutated by add/discard (any thread) and by
        # `record` (the runner) when the producer says an id ended.
        self._ids: dict[str, None] = dict.fromkeys(valid_id(kid) for kid in ids)
        self._lock = threading.Lock()
        self.ended: dict[str, Reason | None] = {}
        self.last_states: dict[str, IdStatus] = {}
        self.last_error: BaseException | None = None
        self.rounds = 0
        self.errors = 0

    def add(self, ids: Iterable[str]) -> None:
        checked = [valid_id(kid) for kid in ids]
        with self._lock:
            for kid in checked:
                self._ids[kid] = None
                self.ended.pop(kid, None)

    def discard(self, ids: Iterable[str]) -> None:
        with self._lock:
            for kid in ids:
                self._ids.pop(kid, None)
                self.last_states.pop(kid, None)

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self._ids)

    def record(self, states: list[IdStatus]) -> None:
        with self._lock:
            for s in states:
                if s.kv_request_id not in self._ids:
                    continue  # discarded while the call was in flight
                if s.ended:
                    del self._ids[s.kv_request_id]
                    self.last_states.pop(s.kv_request_id, None)
                    self.ended[s.kv_request_id] = s.reason
                else:
                    self.last_states[s.kv_request_id] = s
            if self.last_error is not None:
                log.info("keep-alive recovered after %d failed rounds", self.errors)
            self.last_error = None
            self.rounds += 1

    def record_error(self, exc: BaseException) -> None:
        if self.last_error is None or type(exc) is not type(self.last_error):
            log.warning("keep-alive round failed (will retry): %s", exc)
        self.last_error = exc
        self.errors += 1

    def call_timeout(self, info: Any) -> float:
        """Deadline of one KeepAlive call: never longer than a round, the interval worked out
        from the leases included."""
        return min(self.interval(info), _MAX_CALL_S)

    def interval(self, info: Any) -> float:
        """Seconds until the next round, asked after a round: a third of the shortest lease
        the producer just reported (or of `extend_s`, or of its unbound_store_timeout_s from
        ServerInfo), so the loop follows real leases without asking for anything else. After
        a failed round nothing was just reported."""
        if self.interval_s is not None:
            return self.interval_s
        with self._lock:
            reported = [
                s.lease_remaining_s
                for s in self.last_states.values()
                if s.state in _EXTENDABLE and self.last_error is None
            ]
        leases = [lease for lease in reported if lease > 0]
        if self.extend_s:
            leases.append(self.extend_s)
        elif info is not None:
            leases.append(info.unbound_store_timeout_s)
        return max(_MIN_INTERVAL_S, min(leases) / 3) if leases else _UNKNOWN_LEASE_INTERVAL_S

    def statistics(self) -> KeepAliveStatistics:
        with self._lock:
            return KeepAliveStatistics(self.rounds, self.errors, len(self._ids), len(self.ended))


class _KeepAliveBase:
    """The public surface both runners share."""

    _state: _KeepAliveState

    @property
    def ids(self) -> list[str]:
        return self._state.snapshot()

    @property
    def ended(self) -> dict[str, Reason | None]:
        """Ids the producer reported ended (dropped from the set), with their reason."""
        return dict(self._state.ended)

    @property
    def last_states(self) -> dict[str, IdStatus]:
        return dict(self._state.last_states)

    @property
    def last_error(self) -> BaseException | None:
        return self._state.last_error

    def add(self, *kv_request_ids: str) -> None:
        self._state.add(kv_request_ids)

    def discard(self, *kv_request_ids: str) -> None:
        self._state.discard(kv_request_ids)

    def statistics(self) -> KeepAliveStatistics:
        return self._state.statistics()


class KeepAlive(_KeepAliveBase):
    """Renews leases from a daemon thread. Made by `KVConsumer.keep_alive`."""

    def __init__(
        self, client: KVConsumer, ids: Iterable[str], *, interval_s: float | None, extend_s: float
    ) -> None:
        self._client = client
        self._state = _KeepAliveState(ids, interval_s, extend_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpark-keepalive", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def client_closed(self) -> None:
        """Called by the client's close: the loop ends now, not at its next round (with no
        id in the set it would never make the call that finds the client closed)."""
        self._stop.set()

    def stop(self) -> None:
        """Stops the loop and waits for it (at most one KeepAlive call). Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> KeepAlive:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.stop()

    def _run(self) -> None:
        state = self._state
        while not self._stop.is_set():
            ids = state.snapshot()
            try:
                if ids:
                    timeout = state.call_timeout(self._client.info)
                    states = self._client.extend_leases(ids, state.extend_s, timeout=timeout)
                    state.record(states)
            except ClientClosedError:
                return
            except KVParkError as exc:
                state.record_error(exc)
            self._stop.wait(state.interval(self._client.info))


class AsyncKeepAlive(_KeepAliveBase):
    """Renews leases from a task on the running loop. Made by `AsyncKVConsumer.keep_alive`."""

    def __init__(
        self,
        client: AsyncKVConsumer,
        ids: Iterable[str],
        *,
        interval_s: float | None,
        extend_s: float,
    ) -> None:
        self._client = client
        self._state = _KeepAliveState(ids, interval_s, extend_s)
        self._stop = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvpark-keepalive")

    @property
    def running(self) -> bool:
        return not self._task.done()

    def client_closed(self) -> None:
        """As `KeepAlive.client_closed`, on the loop's thread (aclose runs there)."""
        self._stop.set()

    async def stop(self) -> None:
        """Stops the loop and waits for it. Idempotent."""
        self._stop.set()
        if not self._task.done():
            await self._task

    async def __aenter__(self) -> AsyncKeepAlive:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        await self.stop()

    async def _run(self) -> None:
        state = self._state
        while not self._stop.is_set():
            ids = state.snapshot()
            try:
                if ids:
                    timeout = state.call_timeout(self._client.info)
                    states = await self._client.extend_leases(ids, state.extend_s, timeout=timeout)
                    state.record(states)
            except ClientClosedError:
                return
            except KVParkError as exc:
                state.record_error(exc)
            with contextlib.suppress(TimeoutError):  # asyncio.timeout keeps a cancel (3.11)
                async with asyncio.timeout(state.interval(self._client.info)):
                    await self._stop.wait()
