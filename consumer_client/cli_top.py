"""`kvpark top`: a live view of one producer, refreshed every `--interval` seconds.

Each refresh reads ServerInfo and shows the pool's use, the ids by state, and rates per second
of parks, fetches, reaps, late rejections and bytes: the growth of each ProducerStats counter
since the previous refresh divided by the time measured between the two answers. Rates are
only computed between two answers of the same process (same epoch); a restarted producer's
counters start again from zero.

On a terminal the screen is redrawn in place (ANSI cursor-home and erase, no curses) and keys
are read without Enter: `q` quits, any other key refreshes at once. Elsewhere (a pipe, a file)
each refresh prints one block, or one JSON object per line with `--json`. A producer that does
not answer is shown as an error line above its last answer and asked again at the next
refresh. Ctrl-C, `q` and the end of `--count` end it; the terminal's settings are restored.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import sys
import termios
import time
import tty
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, TextIO

from ._errors import RPCError
from ._models import ProducerStats
from .cli_connect import Connection, positive_seconds
from .cli_format import human_bytes, percent
from .cli_snapshot import Snapshot

HELP = "a live view of one producer: pool use, ids by state, rates per second"

# (label, ProducerStats counter, counts bytes)
RATE_COUNTERS: tuple[tuple[str, str, bool], ...] = (
    ("parks", "parks_total", False),
    ("fetches", "fetches_total", False),
    ("reaped", "reaped_total", False),
    ("late fetch rejections", "late_fetch_rejections_total", False),
    ("late park rejections", "late_park_rejections_total", False),
    ("bytes parked", "parked_bytes_total", True),
    ("bytes sent", "sent_bytes_total", True),
)
KEY_HINT = "q quits, any other key refreshes now"

# ANSI: cursor home, erase to the end of the line, erase below, whole screen, cursor off/on.
HOME, ERASE_LINE, ERASE_BELOW, CLEAR = "\x1b[H", "\x1b[K", "\x1b[J", "\x1b[2J"
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--interval",
        type=positive_seconds,
        default=1.0,
        metavar="SECONDS",
        help="time between refreshes (default %(default)s)",
    )
    parser.add_argument(
        "--count",
        type=_positive_int,
        metavar="N",
        help="stop after N refreshes (default: until q or Ctrl-C)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {text!r}")
    return value


# --------------------------------------------------------------------------------- rates
@dataclass(frozen=True, slots=True)
class Rate:
    label: str
    counter: str
    is_bytes: bool
    delta: int
    per_s: float


def rates_between(before: Snapshot, after: Snapshot) -> list[Rate] | None:
    """Each counter's growth from `before` to `after` and per second of the time between the
    two answers; None when they cannot be compared (another process, no counters, no time)."""
    if before.info.producer_epoch != after.info.producer_epoch:
        return None
    if before.stats is None or after.stats is None:
        return None
    elapsed = after.taken_at - before.taken_at
    if elapsed <= 0:
        return None
    rates = []
    for label, counter, is_bytes in RATE_COUNTERS:
        delta = getattr(after.stats, counter) - getattr(before.stats, counter)
        rates.append(Rate(label, counter, is_bytes, delta, delta / elapsed))
    return rates


# ---------------------------------------------------------------------------------- view
class TopView:
    """What the screen shows: the last answer, the rates since the one before, or the error of
    the last refresh."""

    def __init__(self, target: str, interval_s: float) -> None:
        self.target = target
        self.interval_s = interval_s
        self.refresh = 0
        self.last: Snapshot | None = None
        self.rates: list[Rate] | None = None
        self.rates_over_s = 0.0
        self.note = ""
        self.error: RPCError | None = None

    def observe(self, snapshot: Snapshot) -> None:
        self.refresh += 1
        self.error = None
        before, self.last = self.last, snapshot
        self.rates = None if before is None else rates_between(before, snapshot)
        if self.rates is not None:
            assert before is not None
            self.rates_over_s = snapshot.taken_at - before.taken_at
            self.note = ""
        elif before is None:
            self.note = "from the next refresh"
        elif before.info.producer_epoch != snapshot.info.producer_epoch:
            self.note = (
                f"producer restarted (epoch {before.info.producer_epoch} -> "
                f"{snapshot.info.producer_epoch}): from the next refresh"
            )
        else:
            self.note = "none: this producer reports no counters"

    def fail(self, error: RPCError) -> None:
        self.refresh += 1
        self.error = error
        self.rates = None

    def lines(self, *, keys: bool) -> list[str]:
        out = [
            f"kvpark top  {self.target}  refresh {self.refresh}, every {self.interval_s:g}s  "
            f"{time.strftime('%H:%M:%S')}"
        ]
        if self.error is not None:
            out.append(f"error        {self.error}")
            out.append(f"             retrying every {self.interval_s:g}s")
            if self.last is not None:
                ago = time.monotonic() - self.last.taken_at
                out.append(f"last answer  {ago:.1f}s ago:")
        if self.last is not None:
            out += _state_lines(self.last)
        if self.error is None:
            out.append("")
            out += self._rate_lines()
        if keys:
            out += ["", KEY_HINT]
        return out

    def _rate_lines(self) -> list[str]:
        if self.rates is None:
            return [f"rates        {self.note}"]
        rows = [(f"rates over {self.rates_over_s:.2f}s", "delta", "per second")]
        for rate in self.rates:
            if rate.is_bytes:
                rows.append(
                    (rate.label, f"+{human_bytes(rate.delta)}", f"{human_bytes(rate.per_s)}/s")
                )
            else:
                rows.append((rate.label, f"+{rate.delta}", f"{rate.per_s:.1f}/s"))
        width = max(len(r[0]) for r in rows)
        return [f"{a.ljust(width)}  {b:>12}  {c:>14}" for a, b, c in rows]

    def document(self) -> dict[str, Any]:
        """One refresh as JSON (`kvpark top --json`)."""
        doc: dict[str, Any] = {"target": self.target, "refresh": self.refresh}
        doc["ok"] = self.error is None
        if self.error is not None:
            doc.update(error=self.error.code.name, detail=str(self.error))
            return doc
        assert self.last is not None
        doc.update(
            producer_epoch=self.last.info.producer_epoch,
            version=self.last.info.version,
            pool_bytes=self.last.info.pool_bytes,
            pool_used_bytes=self.last.pool_used_bytes,
            stats=None if self.last.stats is None else asdict(self.last.stats),
            rates_over_s=self.rates_over_s if self.rates is not None else None,
            rates=None
            if self.rates is None
            else {r.counter: {"delta": r.delta, "per_s": r.per_s} for r in self.rates},
        )
        return doc


def _state_lines(snapshot: Snapshot) -> list[str]:
    info = snapshot.info
    used = snapshot.pool_used_bytes
    lines = [
        f"producer     epoch {info.producer_epoch}  version {info.version}  "
        f"transports {','.join(snapshot.transports)}"
        + (f"  advertise {info.advertise_address}" if info.advertise_address else ""),
        f"pool         {human_bytes(used)} used of {human_bytes(info.pool_bytes)} "
        f"({percent(used, info.pool_bytes)})",
    ]
    stats: ProducerStats | None = snapshot.stats
    if stats is None:
        lines.append(f"ids          not reported by this producer (version {info.version})")
    else:
        lines.append(
            f"ids          parked {stats.parked_ids}  bound {stats.bound_ids}  "
            f"delivered {stats.delivered_ids}  tombstones {stats.tombstones}  "
            f"open park batches {stats.open_park_batches}"
        )
    return lines


# ------------------------------------------------------------------------------ terminal
class Keys:
    """Keys typed while `top` runs, when stdin is a terminal: cbreak mode for the run (no echo,
    no Enter needed; Ctrl-C still interrupts), the saved settings restored after it.

    A wait also ends when a signal arrives. The kernel may hand Ctrl-C's SIGINT to any thread
    of the process, grpc's included, and Python raises KeyboardInterrupt in the main thread
    only once that thread runs again: a wait that watched only the terminal would sleep on
    until the interval ends. `signal.set_wakeup_fd` makes every signal Python handles write a
    byte into a pipe the wait watches too."""

    def __init__(self, stdin: TextIO | None) -> None:
        self.fd: int | None = None
        if stdin is not None and not stdin.closed and stdin.isatty():
            self.fd = stdin.fileno()
        self._saved: list[Any] | None = None
        self._signals: tuple[int, int] | None = None  # the wake-up pipe's (read, write) ends
        self._previous_wakeup = -1

    @property
    def active(self) -> bool:
        return self.fd is not None

    def __enter__(self) -> Keys:
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        try:
            self._previous_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
            self._signals = (read_end, write_end)
        except ValueError:  # not the main thread: signals reach no handler here anyway
            os.close(read_end)
            os.close(write_end)
        if self.fd is not None:
            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        if self.fd is not None and self._saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
        if self._signals is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            for end in self._signals:
                os.close(end)
            self._signals = None

    def wait(self, until: float) -> str | None:
        """Waits until the monotonic time `until`, a key or a signal, whichever comes first;
        returns the keys typed (None: none). After a signal, its handler runs next (Ctrl-C:
        KeyboardInterrupt)."""
        remaining = max(0.0, until - time.monotonic())
        watched = [] if self.fd is None else [self.fd]
        if self._signals is not None:
            watched.append(self._signals[0])
        if not watched:
            time.sleep(remaining)
            return None
        ready, _, _ = select.select(watched, [], [], remaining)
        if self._signals is not None and self._signals[0] in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._signals[0], 64):
                    pass
            return None
        if not ready or self.fd is None:
            return None
        data = os.read(self.fd, 64)
        if not data:  # the terminal went away: from now on only the interval counts
            self.fd = None
            return None
        return data.decode("utf-8", errors="replace")


class Screen:
    """Where refreshes go: redrawn in place on a terminal, one block (or JSON line) each
    otherwise."""

    def __init__(self, out: TextIO, *, as_json: bool) -> None:
        self.out = out
        self.as_json = as_json
        self.redraw = not as_json and out.isatty()

    def __enter__(self) -> Screen:
        if self.redraw:
            self.out.write(HIDE_CURSOR + CLEAR + HOME)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        if self.redraw:
            self.out.write(SHOW_CURSOR)
            self.out.flush()

    def show(self, view: TopView, *, keys: bool) -> None:
        if self.as_json:
            self.out.write(json.dumps(view.document()) + "\n")
        elif self.redraw:
            # Lines cut to the terminal's width: a wrapped line would push the frame down and
            # the next redraw from the top would leave its tail on the screen.
            width = max(shutil.get_terminal_size().columns - 1, 20)
            body = "".join(line[:width] + ERASE_LINE + "\n" for line in view.lines(keys=keys))
            self.out.write(HOME + body + ERASE_BELOW)
        else:
            self.out.write("\n".join(view.lines(keys=False)) + "\n\n")
        self.out.flush()


# ---------------------------------------------------------------------------------- loop
def watch(args: argparse.Namespace) -> bool:
    """Runs the view until `q`, Ctrl-C or `--count`; returns False only when `--count` ended
    it and the last refresh did not reach the producer."""
    connection = Connection.from_args(args)
    view = TopView(args.target, args.interval)
    keys = Keys(sys.stdin)
    screen = Screen(sys.stdout, as_json=args.json)
    try:
        with connection.reader(args.target) as reader, keys, screen:
            while True:
                started = time.monotonic()
                try:
                    view.observe(reader.read(args.rpc_timeout))
                except RPCError as exc:
                    view.fail(exc)
                screen.show(view, keys=keys.active)
                if args.count is not None and view.refresh >= args.count:
                    return view.error is None
                typed = keys.wait(started + args.interval)
                if typed is not None and "q" in typed.lower():
                    break
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        # The reader of a pipe (`kvpark top | head`) went away: done. Stdout is pointed at
        # /dev/null so that the interpreter's last flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return True
