"""The blocking client's alarms: one thread per client fires them all.

A load with a first-chunk timeout cancels its call if nothing arrived in time; a load that
reads a data connection for long starts watching its call (`_call_watch.py`). A
`threading.Timer` per load would start a thread per load, and `Thread.start` waits until the
new thread runs, which on a busy decode host costs more than the rest of a small load. So
each client keeps one daemon thread, started on first use, that sleeps until the earliest
alarm is due.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvpark.client")

# Disarmed alarms stay in the heap until they would be due; past this many, and more than
# half of the heap, they are swept out (a client that loads fast with a long first-chunk
# timeout would otherwise keep one entry per load for that long).
_SWEEP_AT = 256


class Alarm:
    """One armed alarm: `disarm` it once it is not needed any more (a first-chunk watchdog's
    first message came); `fired` says whether it went off (for a first-chunk watchdog: the
    call was cancelled because its first chunk was late)."""

    __slots__ = ("_armed", "_fire", "fired")

    def __init__(self, fire: Callable[[], Any] | None) -> None:
        self._fire = fire
        self._armed = fire is not None
        self.fired = False


class Alarms:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Alarm]] = []
        self._armed = 0
        self._order = itertools.count()  # ties on the deadline never compare two alarms
        self._thread: threading.Thread | None = None
        self._closed = False

    def arm(self, delay_s: float | None, fire: Callable[[], Any]) -> Alarm:
        """An alarm that calls `fire()` (on the alarms' thread) after `delay_s`, unless
        disarmed first; None: never (an alarm that is not armed)."""
        if delay_s is None:
            return Alarm(None)
        alarm = Alarm(fire)
        with self._cond:
            if self._closed:
                alarm._armed = False
                return alarm
            heapq.heappush(self._heap, (time.monotonic() + delay_s, next(self._order), alarm))
            self._armed += 1
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="kvpark-alarms", daemon=True)
                try:
                    thread.start()
                except RuntimeError as exc:
                    # No thread to be had (a pids limit). The alarm stays armed and the next
                    # `arm` tries again; until then no alarm fires, and a load is bounded by
                    # its total deadline alone.
                    log.warning("kvpark: the client's alarms cannot run yet: %s", exc)
                else:
                    self._thread = thread
            elif self._heap[0][2] is alarm:
                self._cond.notify()  # due before whatever the thread sleeps until
        return alarm

    def disarm(self, alarm: Alarm) -> None:
        with self._cond:
            if alarm._armed:
                alarm._armed = False
                self._armed -= 1
                if len(self._heap) > _SWEEP_AT and len(self._heap) > 2 * self._armed:
                    self._heap = [entry for entry in self._heap if entry[2]._armed]
                    heapq.heapify(self._heap)

    def close(self) -> None:
        """No alarm fires any more; the thread ends."""
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                while self._heap and not self._heap[0][2]._armed:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                due, _, alarm = self._heap[0]
                left = due - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._heap)
                alarm._armed = False
                self._armed -= 1
                alarm.fired = True
                fire, alarm._fire = alarm._fire, None
                self._cond.release()  # fire without the lock: it may take a while
                try:
                    if fire is not None:
                        fire()
                except Exception:
                    log.exception("kvpark: a client alarm failed")
                finally:
                    self._cond.acquire()
