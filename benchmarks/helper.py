"""Helper processes that answer commands on stdin with JSON lines: both ends of the protocol.

The benchmark's probes and servers (the late-fetch prober, the bare-gRPC floor's server and its
late-call prober) run in processes of their own, so their timing is not disturbed by this
process's GIL while it moves data. Each takes one command per stdin line and answers with one
JSON line on stdout; `{"error": ...}` fails the run; closing its stdin asks it to exit.

Parent side: `JsonLineChild` starts the helper (`python -m benchmarks.<module>`, allocator
environment from env.py) and reads its answers with a deadline, so a helper that hangs fails
the run instead of stalling it. Child side: `answer_commands` is the command loop,
`run_until_stop` runs a measurement in a thread until the parent says `stop`, and
`repeat_until` is the "one try every GAP seconds" loop of a probe.
"""

from __future__ import annotations

import contextlib
import json
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from .env import start_child, stop_child
from .report import VerificationError

Answer = dict[str, Any]
# A child's command: (the words after the command's name, the remaining stdin lines) -> answer.
Command = Callable[[Sequence[str], Iterator[str]], Answer]
T = TypeVar("T")


class JsonLineChild:
    """A helper process of this package, owned by this object (stopped by `close`)."""

    def __init__(self, module: str, args: Sequence[str]) -> None:
        self._name = module
        self.proc = start_child(module, args)
        # Answers are read by a thread into a queue: a plain readline could wait forever on a
        # helper that hangs, and select() does not see lines already in the pipe's buffer.
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"{module}-answers", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                self._lines.put(line)
        except (OSError, ValueError):
            pass  # the pipe was closed by close()
        finally:
            self._lines.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout_s: float) -> Answer:
        """The helper's next answer; its `{"error": ...}` is a VerificationError (a wrong
        answer from the system under test), silence or an exit is a RuntimeError."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"{self._name}: no answer within {timeout_s:g} s") from None
        if line is None:
            err = ""
            if self.proc.poll() is not None and self.proc.stderr is not None:
                with contextlib.suppress(OSError, ValueError):
                    err = self.proc.stderr.read()[-2000:]
            raise RuntimeError(f"{self._name} exited ({self.proc.poll()}): {err}")
        doc: Answer = json.loads(line)
        if "error" in doc:
            raise VerificationError(f"{self._name}: {doc['error']}")
        return doc

    def ask(self, line: str, timeout_s: float) -> Answer:
        self.send(line)
        return self.answer(timeout_s)

    def close(self) -> None:
        stop_child(self.proc)
        self._reader.join(timeout=5)


# ================================================================================ child side
def answer_commands(commands: Mapping[str, Command], failures: tuple[type[Exception], ...]) -> None:
    """Answers each stdin line with one JSON line until stdin closes. A failure of the kinds
    in `failures` (a wrong answer from the system under test) is answered as `{"error": ...}`;
    anything else is a bug in the helper and ends it with a traceback."""
    lines = iter(sys.stdin.readline, "")
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        command = commands.get(parts[0])
        answer: Answer
        try:
            if command is None:
                answer = {"error": f"unknown command {parts[0]!r}"}
            else:
                answer = command(parts[1:], lines)
        except failures as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


def run_until_stop(work: Callable[[threading.Event], Answer], lines: Iterator[str]) -> Answer:
    """Runs `work` in a thread until a `stop` line arrives on stdin (or stdin closes); answers
    `{"started": true}` first, so the parent knows the measurement runs before it loads."""
    stop = threading.Event()
    result: list[Answer] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work(stop))
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    print(json.dumps({"started": True}), flush=True)
    for line in lines:
        if line.strip() == "stop":
            break
    stop.set()
    thread.join(timeout=30)
    if errors:
        return {"error": f"{type(errors[0]).__name__}: {errors[0]}"}
    return result[0] if result else {"error": "probe thread did not finish"}


def repeat_until(stop: threading.Event, gap_s: float, attempt: Callable[[], T]) -> list[T]:
    """`attempt()` every `gap_s` seconds until `stop` is set. At least once: a phase shorter
    than one try still reports one."""
    out = [attempt()]
    while not stop.wait(gap_s):
        out.append(attempt())
    return out
