"""The blocking client's watch on a Fetch call while the load reads its data connection.

The blocking client reads a Fetch call on the caller's own thread (the channel's
SingleThreadedUnaryStream option, `_channel.py`), so grpc learns what happens to the call
only when that thread reads it. While the thread reads a TCP data connection instead, a call
that fails goes unnoticed: a producer that stops answering (its process frozen, its host gone,
the network between cut) fails the call within the channel's keepalive (about 4 s), but a
frozen process's data connection stays open and silent, and the read would wait out the load's
deadline, or for ever without one.

So a load still reading its data connection WATCH_AFTER_S after it began gets a thread that
reads the call meanwhile. When the call fails, the thread stops the read (the load then ends
with the call's status, as one over the gRPC stream would); when the call brings a message
(the TransferDone that follows the bytes), the thread keeps it for the load to take. Loads
that read for less time (580 MB take about 0.2 s on loopback) start no thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvpark.client")

# Late enough that nearly every load is over before it, early enough to add little to the
# channel's keepalive (a ping every 2 s, 2 s to answer) before a frozen producer is noticed.
WATCH_AFTER_S = 1.0


class CallWatch:
    """Reads `call` on a thread of its own from `start()` until `finish()`; calls
    `stop_reading()` when the call fails meanwhile."""

    def __init__(self, call: Any, stop_reading: Callable[[], None]) -> None:
        self._call = call
        self._stop_reading = stop_reading
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._finished = False  # the load took the call back: no watch starts any more
        self._message: Any = None

    def start(self) -> None:
        """Starts the watch, unless the load finished reading first (an alarm may fire just
        as it does)."""
        with self._lock:
            if self._finished:
                return
            thread = threading.Thread(target=self._watch, name="kvpark-call-watch", daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had (a pids limit): go on unwatched
                log.debug("kvpark: the load's call goes unwatched: %s", exc)
                return
            self._thread = thread

    def finish(self, *, cancel: bool) -> Any:
        """Takes the call back for the load: the message the watch read from it, or None.
        Returns once the watch no longer reads the call, so only one thread ever does.
        `cancel`: the load gives up on the call, which is cancelled first so that the watch's
        read ends at once; otherwise the read ends with the call's next message or its end,
        both due once the producer sent the bytes."""
        with self._lock:
            self._finished = True
            thread = self._thread
        if thread is None:
            return None
        if cancel:
            self._call.cancel()
        thread.join()
        return self._message

    def _watch(self) -> None:
        try:
            self._message = next(self._call)
        except StopIteration:  # the call ended without another message: the load sees that
            pass
        except Exception:  # an RpcError, or the call unusable: the load meets it next, too
            self._stop_reading()
