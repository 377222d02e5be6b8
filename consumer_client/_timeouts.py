"""`Timeout`: how long a load may take, as one frozen value (httpx style).

Three limits, each optional, all measured from the start of the `load` call:

- `total_s` (default 30 s, the reference's `_LOAD_TIMEOUT_S`): the whole load. It travels as
  the gRPC deadline, so the producer learns it too.
- `first_chunk_s`: the first chunk (or the producer's TransferDone) must arrive by then. A
  producer that answers a late fetch in one round trip never gets near it; a producer that
  binds the fetch and then has nothing to send is given up on early.
- `base_s + per_gib_s * GiB`: a size-scaled budget for loads whose size is known (the size of
  the caller's `into` buffer). It can only shorten `total_s`, never lengthen it, so a huge
  buffer cannot lift the load past the limit the producer's tombstone retention was sized for.

When any of them fires, the RPC is cancelled (the producer's abort signal: the id goes back to
PARKED) and the result says `Reason.TIMEOUT`.

The client's default load timeout must stay below the producer's `tombstone_retention_s`
(spec §5): otherwise a consumer still waiting when the tombstone is pruned would see UNKNOWN_ID
instead of the real reason. Clients check it against ServerInfo on first contact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._errors import UsageError

GiB = 1024**3
DEFAULT_LOAD_TIMEOUT_S = 30.0


def _check_seconds(name: str, value: float | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UsageError(f"Timeout.{name}: expected seconds as a number, got {value!r}")
    low_ok = value >= 0 if allow_zero else value > 0
    if not (math.isfinite(value) and low_ok):
        bound = ">= 0" if allow_zero else "> 0"
        raise UsageError(f"Timeout.{name}: expected finite seconds {bound}, got {value!r}")


@dataclass(frozen=True, slots=True)
class Timeout:
    """Load time limits in seconds; None disables a limit. `Timeout(5)` = 5 s total."""

    total_s: float | None = DEFAULT_LOAD_TIMEOUT_S
    first_chunk_s: float | None = None
    # Size-scaled budget: base_s + per_gib_s * (into size in GiB); per_gib_s None disables it.
    base_s: float = 0.0
    per_gib_s: float | None = None

    def __post_init__(self) -> None:
        _check_seconds("total_s", self.total_s)
        _check_seconds("first_chunk_s", self.first_chunk_s)
        _check_seconds("base_s", self.base_s, allow_zero=True)
        _check_seconds("per_gib_s", self.per_gib_s)
        if self.per_gib_s is None and self.base_s:
            raise UsageError("Timeout.base_s is only used with per_gib_s (the size-scaled budget)")

    @classmethod
    def coerce(cls, value: Timeout | float | None, default: Timeout) -> Timeout:
        """`None` -> the client's default; a number -> that many seconds total."""
        if value is None:
            return default
        if isinstance(value, Timeout):
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UsageError(f"timeout: expected Timeout, seconds or None, got {value!r}")
        return cls(total_s=float(value))

    def budget_s(self, nbytes: int | None = None) -> float | None:
        """Seconds the whole load may take for a load of `nbytes` (None: size unknown)."""
        budget = self.total_s
        if self.per_gib_s is not None and nbytes is not None:
            scaled = self.base_s + self.per_gib_s * nbytes / GiB
            budget = scaled if budget is None else min(budget, scaled)
        return budget

    @property
    def longest_s(self) -> float | None:
        """The longest any load may take under this timeout (None: unbounded)."""
        return self.total_s
