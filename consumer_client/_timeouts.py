"""`Timeout`, and the one rule for every `timeout=` argument of the clients (as in httpx).

- The client's `timeout=` is its default for every call: loads, parks and unary calls alike.
- A call's `timeout=` overrides it. Left out, it is `USE_CLIENT_DEFAULT`.
- `None` means no limit, wherever it is accepted (the client's or a call's).
- A number means that many seconds in all (`Timeout(total_s=n)`).

`Timeout` has three limits, each optional, all measured from the start of the call, each at
most a week (`kvpark.durations.MAX_SECONDS`):

- `total_s` (default 30 s, the reference's load timeout): the whole call. It travels as the
  gRPC deadline, so the producer learns it too. A unary call's deadline is this value.
- `first_chunk_s` (loads only): the first chunk, or the producer's TransferDone, must arrive by
  then. A producer that answers a late fetch in one round trip never gets near it; one that
  binds the fetch and then has nothing to send is given up on early.
- `base_s + per_gib_s * GiB` (loads only): a size-scaled budget for loads whose size is known
  (the capacity of the caller's `into`). It can only shorten `total_s`, never lengthen it.

When a load's limit fires, the RPC is cancelled (the producer's abort signal: the id goes back
to where it was) and the result says `Reason.TIMEOUT`. A load timeout should stay below the
producer's `tombstone_retention_s`, or a consumer still waiting when the tombstone is pruned
sees UNKNOWN_ID instead of the real reason; clients check it against ServerInfo.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Final

from kvpark.durations import MAX_SECONDS

from ._errors import UsageError

GiB = 1024**3
DEFAULT_LOAD_TIMEOUT_S = 30.0
# An out-of-band path's set-up (lending a buffer over the shm socket; connecting to the data
# port) gets at most this share of what is left of a load's limit, so that when the path does
# not answer the load still has most of its time for the gRPC stream.
OUT_OF_BAND_SHARE = 0.25
# A set-up that timed out with less time than this says nothing about the path (a load with
# little time left, a busy machine): the client goes on using the path.
CONCLUSIVE_TIMEOUT_S = 0.25


class _UseClientDefault(enum.Enum):
    """The type of `USE_CLIENT_DEFAULT`: a call's timeout left to the client's default."""

    USE_CLIENT_DEFAULT = "USE_CLIENT_DEFAULT"

    def __repr__(self) -> str:
        return "USE_CLIENT_DEFAULT"


USE_CLIENT_DEFAULT: Final = _UseClientDefault.USE_CLIENT_DEFAULT


def _check_seconds(name: str, value: float | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UsageError(f"Timeout.{name}: expected seconds as a number, got {value!r}")
    low_ok = value >= 0 if allow_zero else value > 0
    if not (math.isfinite(value) and low_ok):
        bound = ">= 0" if allow_zero else "> 0"
        raise UsageError(f"Timeout.{name}: expected finite seconds {bound}, got {value!r}")
    if value > MAX_SECONDS:
        raise UsageError(
            f"Timeout.{name}: expected at most {MAX_SECONDS} seconds (one week), got {value!r}"
        )


@dataclass(frozen=True, slots=True)
class Timeout:
    """Time limits in seconds; None disables a limit. `Timeout(5)` = 5 s in all."""

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

    def first_limit_s(self) -> float | None:
        """The earliest of the limits a call meets first: the first chunk's, else the total."""
        return self.first_chunk_s if self.first_chunk_s is not None else self.total_s

    def budget_s(self, nbytes: int | None = None) -> float | None:
        """Seconds a load of `nbytes` may take in all (None: size unknown / unbounded)."""
        budget = self.total_s
        if self.per_gib_s is not None and nbytes is not None:
            scaled = self.base_s + self.per_gib_s * nbytes / GiB
            budget = scaled if budget is None else min(budget, scaled)
        return budget


NO_LIMIT: Final = Timeout(total_s=None)
# A client's default when none is given: 30 s in all.
DEFAULT_TIMEOUT: Final = Timeout()

TimeoutArg = Timeout | float | int | None | _UseClientDefault


def to_timeout(value: Timeout | float | int | None, what: str = "timeout") -> Timeout:
    """A client's or a call's `timeout=` as a Timeout: None = no limit, a number = total."""
    if value is None:
        return NO_LIMIT
    if isinstance(value, Timeout):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UsageError(
            f"{what}: expected Timeout, seconds, None or USE_CLIENT_DEFAULT, got {value!r}"
        )
    return Timeout(total_s=float(value))


def resolve(value: TimeoutArg, default: Timeout) -> Timeout:
    """A call's `timeout=` against its client's default."""
    if value is USE_CLIENT_DEFAULT:
        return default
    assert not isinstance(value, _UseClientDefault)
    return to_timeout(value)
