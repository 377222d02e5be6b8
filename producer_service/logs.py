"""Logging set-up (text or JSON lines) and rate-limited warnings.

Structured fields travel as `extra={"kv": {...}}` so the JSON formatter emits them as keys
(id, reason, peer, ...). Payload bytes and tokens are never passed to a logger.

A warning per event (say, every late Park or Fetch for an ended id) would make log volume grow
with load. `RateLimitedWarnings` logs the first warning of a kind per id, then at most one per
interval, and counts the ones it suppressed (exported as `kvpark_suppressed_warnings_total`).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

LOGGER_NAME = "kvpark.producer"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(getattr(record, "kv", {}))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "kv", None)
        if fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return text


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("kvpark")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


class RateLimitedWarnings:
    """At most one warning per (kind, id) per `interval_s`, and one per kind per interval
    across ids beyond that; the rest are counted through `on_suppressed(kind)`."""

    def __init__(
        self,
        logger: logging.Logger,
        on_suppressed: Callable[[str], None],
        interval_s: float = 10.0,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._on_suppressed = on_suppressed
        self._interval = interval_s
        self._max_keys = max_keys
        self._clock = clock
        self._last: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._kind_last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, kind: str, key: str, message: str, fields: Callable[[], dict[str, Any]]) -> bool:
        """Logs unless the same (kind, key) or too many of `kind` were logged recently.
        `fields` builds the structured fields, called only when the warning is logged."""
        now = self._clock()
        last = self._last.get((kind, key))
        kind_last = self._kind_last.get(kind)
        if (last is not None and now - last < self._interval) or (
            kind_last is not None and now - kind_last < self._interval / 100
        ):
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            self._on_suppressed(kind)
            return False
        self._last[(kind, key)] = now
        self._last.move_to_end((kind, key))
        while len(self._last) > self._max_keys:
            self._last.popitem(last=False)
        self._kind_last[kind] = now
        extra = fields()
        suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            extra["suppressed_since_last"] = suppressed
        self._logger.warning(message, extra={"kv": extra})
        return True
