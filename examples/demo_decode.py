"""Demo decode worker: takes over the demo's requests from the prefill worker and decodes them.

For each request the worker allocates a block-major KV cache for the reference model
(examples/reference_model.py), loads the request's parked chunks straight into it with the
`kvpark` client (`into=layout.destination(cache)`: each verified chunk is copied once, into
its own block), lets the model prefill only from the first chunk that did not arrive
(`start_chunk=k`), and decodes a few tokens greedily. The prefill worker (prefill_worker.py)
parks four requests, and each takes a different path:

- ``on-time``: loaded as soon as it is parked, while its lease runs -> remote.
- ``partial``: only the first half of its chunks was committed (the prefill worker's batch
  with the rest was cut off). The worker asks for every chunk and waits at most
  DEMO_CHUNK_WAIT_S for one that is not there (`wait_timeout_s`, a bound the producer keeps):
  the first half arrives, then the producer answers WAIT_TIMEOUT, and the model recomputes
  the rest -> partial.
- ``late``: left alone until its lease ran out and the producer reaped it; the load is answered
  REAPED at once (one round trip, not the load timeout) and the model prefills it all ->
  recompute.
- ``queued``: waits in the decode queue longer than the lease, but the worker keeps its lease
  alive with KeepAlive from the moment it learns of the request -> still remote.

Loads take the best transport the producer offers that this worker can use (`transport=
"auto"`): its lent shared memory on the producer's host, else the producer's zero-copy TCP
data port (in the compose demo: another container, so tcp), else the gRPC stream. The table's
`via` column says which one carried each request's bytes ("-" when none came).

Every wait is for a condition the producer reports (Lookup), never a fixed sleep. Once all four
are decoded, the worker runs a local full prefill and the same greedy decoding of every prompt
and compares: the KV in each request's cache (loaded, recomputed and decoded) must be bitwise
the local one, and the generated tokens identical. Exit status 0 when every request took its
expected path and matched (and, with DEMO_EXPECT_TRANSPORT, every load that moved bytes took
that transport), 1 otherwise.

Settings: demo_common.py, plus
    DEMO_LOAD_TIMEOUT_S   the client's load timeout (default 10)
    DEMO_CHUNK_WAIT_S     longest wait for a chunk that is not parked yet (default 0.5)
    DEMO_QUEUE_EXTRA_S    how far past its lease ``queued`` waits before it is loaded (default 2)
    DEMO_READY_FILE       touched once the keep-alive for ``queued`` runs (compose healthcheck)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from demo_common import (
    NAMES,
    Settings,
    demo_model,
    kv_fingerprint,
    offered_transports,
    partial_prefix,
    prompt,
    request_ids,
)
from reference_model import ReferenceModel

from kvpark import (
    IdStatus,
    KVConsumer,
    LoadPath,
    LoadReport,
    ProducerInfo,
    Reason,
    State,
    Timeout,
    TransportError,
)

CONNECT_TIMEOUT_S = 30.0
# Parked within this long after the worker is ready, or the prefill side is broken.
PARK_WAIT_S = 60.0
# A late fetch must be answered this fast to count as "at once".
LATE_ANSWER_LIMIT_S = 1.0
# Generated tokens shown per row.
SHOWN_TOKENS = 6


def say(text: str) -> None:
    print(f"decode-worker: {text}", flush=True)


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Polls `predicate` (a Lookup) until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout_s:g}s waiting for {what}")
        time.sleep(0.02)


def connect(client: KVConsumer) -> ProducerInfo:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return client.server_info(timeout=2.0)
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@dataclass
class Handoff:
    """One request, taken over: how its KV arrived and what the model made of it."""

    name: str
    prompt: npt.NDArray[np.int64]
    total_chunks: int
    report: LoadReport[list[int]]
    # The first chunk the model computed here (a fully loaded prompt: its last one, see below).
    computed_from: int
    compute_s: float
    generated: list[int]
    cache: npt.NDArray[np.float16]
    tokens_match: bool = False
    kv_match: bool = False


def take_over(
    client: KVConsumer,
    model: ReferenceModel,
    name: str,
    kid: str,
    epoch: int,
    settings: Settings,
    chunk_wait_s: float,
) -> Handoff:
    layout = model.layout
    tokens = prompt(name, model.config.vocab_size)
    total = layout.num_chunks(len(tokens))
    # Room for the prompt and every generated token but the last (whose KV nothing reads).
    cache = model.new_cache(len(tokens) + settings.generate - 1)
    kv = layout.block_major(cache, len(tokens))
    spent: list[float] = []

    def prefill_from(first_missing: int) -> list[int]:
        # The engine's own prefill of the chunks that did not arrive, then greedy decoding.
        started = time.perf_counter()
        out = model.generate(tokens, cache, settings.generate, start_chunk=first_missing)
        spent.append(time.perf_counter() - started)
        return out

    report = client.load_or_recompute(
        kid,
        num_chunks=total,
        into=layout.destination(kv),
        expected_epoch=epoch,
        wait_timeout_s=chunk_wait_s,
        fingerprint=kv_fingerprint(model, tokens),
        recompute=prefill_from,
    )
    if report.recomputed_from is None:
        # Every chunk loaded. The first token's logits come from the prompt's last position,
        # so the model runs the last chunk once more (rewriting its KV with the same bits).
        generated = prefill_from(total)
        computed_from = total - 1
    else:
        assert report.recompute_value is not None
        generated = report.recompute_value
        computed_from = report.recomputed_from
    return Handoff(name, tokens, total, report, computed_from, spent[0], generated, cache)


def compare_with_local_prefill(model: ReferenceModel, handoff: Handoff, generate: int) -> None:
    """A full prefill and decoding of the same prompt, here: KV and tokens must be identical."""
    reference = model.new_cache(len(handoff.prompt) + generate - 1)
    expected = model.generate(handoff.prompt, reference, generate)
    handoff.tokens_match = handoff.generated == expected
    handoff.kv_match = np.array_equal(reference.view(np.uint8), handoff.cache.view(np.uint8))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def chunk_range(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def via(handoff: Handoff) -> str:
    """The transport that carried the request's bytes; "-" when none came."""
    result = handoff.report.result
    return result.transport if result.chunks_loaded else "-"


def table(handoffs: list[Handoff]) -> str:
    lines = [
        f"{'request':<9} {'path':<10} {'reason':<13} {'loaded':>6} {'via':<4} {'bytes':>10} "
        f"{'load':>9}  {'computed':<8}  tokens = local prefill"
    ]
    for h in handoffs:
        r = h.report.result
        computed = chunk_range(h.computed_from, h.total_chunks - 1)
        shown = " ".join(str(t) for t in h.generated[:SHOWN_TOKENS])
        more = " ..." if len(h.generated) > SHOWN_TOKENS else ""
        lines.append(
            f"{h.name:<9} {h.report.path:<10} {r.reason or '-':<13} "
            f"{f'{r.chunks_loaded}/{h.total_chunks}':>6} {via(h):<4} {human_bytes(r.bytes):>10} "
            f"{r.elapsed_s * 1000:>6.1f} ms  {computed:<8}  "
            f"{'yes' if h.tokens_match else 'NO':<3}  {shown}{more}"
        )
    return "\n".join(lines)


def main() -> int:
    # PID 1 in a container gets no default SIGTERM handling: exit when compose stops us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settings = Settings.from_env()
    load_timeout = Timeout(total_s=float(os.environ.get("DEMO_LOAD_TIMEOUT_S", "10")))
    chunk_wait_s = float(os.environ.get("DEMO_CHUNK_WAIT_S", "0.5"))
    queue_extra_s = float(os.environ.get("DEMO_QUEUE_EXTRA_S", "2"))
    ready_file = os.environ.get("DEMO_READY_FILE")
    model = demo_model()
    cfg, layout = model.config, model.layout

    with KVConsumer(
        settings.target,
        timeout=load_timeout,
        token=settings.fetch_token,
        credentials=settings.credentials(),
        transport=settings.transport,  # the client refuses an unknown one
        data_tls=settings.data_tls(),
        shm_socket=settings.shm_socket,
    ) as client:
        info = connect(client)
        epoch, lease = info.producer_epoch, info.unbound_store_timeout_s
        ids = request_ids(epoch)
        say(
            f"producer {settings.target} epoch {epoch:016x}, lease (unbound_store_timeout_s) "
            f"{lease:g}s, load timeout {load_timeout.total_s:g}s, chunk wait {chunk_wait_s:g}s"
        )
        say(
            f"producer offers {offered_transports(info)}; "
            f"this worker: transport={settings.transport}"
        )
        say(
            f"model: {cfg.num_layers} layers, {model.num_parameters / 1e6:.2f} M parameters, "
            f"float16 KV of {human_bytes(layout.token_nbytes)} per token in chunks of "
            f"{cfg.tokens_per_chunk} tokens ({human_bytes(layout.full_chunk_nbytes)}); "
            f"{settings.generate} greedy tokens per request"
        )

        def status(kid: str) -> IdStatus:
            return client.lookup([kid])[0]

        def parked(kid: str) -> IdStatus | None:
            s = status(kid)
            complete = s.total_chunks and s.chunks_parked == s.total_chunks
            return s if s.state is State.PARKED and complete else None

        def take(name: str) -> Handoff:
            return take_over(client, model, name, ids[name], epoch, settings, chunk_wait_s)

        handoffs: list[Handoff] = []
        # The router told us about `queued` when it sent it to prefill: keep its lease alive
        # from now on, parked or not (KeepAlive records intent for ids not parked yet).
        with client.keep_alive([ids["queued"]]) as keep_alive:
            if ready_file:
                Path(ready_file).touch()
            say("keeping 'queued' alive while it waits in the decode queue")

            wait_for(lambda: parked(ids["on-time"]), PARK_WAIT_S, "'on-time' to be parked")
            handoffs.append(take("on-time"))

            # Its first batch is committed; the rest never will be, but the decode side cannot
            # know that: it asks for every chunk and relies on the chunk wait.
            wait_for(
                lambda: status(ids["partial"]).state is State.PARKED,
                PARK_WAIT_S,
                "'partial' to be parked",
            )
            handoffs.append(take("partial"))

            # Nobody keeps `late` alive: wait until the producer reaped it.
            wait_for(
                lambda: status(ids["late"]).state is State.TOMBSTONED,
                PARK_WAIT_S + lease,
                "'late' to be reaped",
            )
            handoffs.append(take("late"))

            # `queued` outlives its lease in the queue; the keep-alive holds it.
            def outlived_lease() -> IdStatus | None:
                s = parked(ids["queued"])
                return s if s is not None and s.age_s >= lease + queue_extra_s else None

            queued = wait_for(
                outlived_lease, PARK_WAIT_S + lease + queue_extra_s, "'queued' to outlive its lease"
            )
            keep_alive.discard(ids["queued"])  # admitted: its KV is loaded now
            rounds = keep_alive.statistics().rounds
            handoffs.append(take("queued"))

    for handoff in handoffs:
        compare_with_local_prefill(model, handoff, settings.generate)
    matching = sum(h.tokens_match for h in handoffs)
    print(table(handoffs), flush=True)
    print(f"tokens match a local prefill: {matching} of {len(handoffs)}", flush=True)

    by_name = {h.name: h for h in handoffs}
    partial, late = by_name["partial"], by_name["late"]
    prefix = partial_prefix(partial.total_chunks)
    print(
        f"partial: chunks 0-{prefix - 1} of {partial.total_chunks} committed, the batch with the "
        f"rest cut off; {partial.report.result.chunks_loaded} loaded, then none within the "
        f"{chunk_wait_s:g}s chunk wait ({partial.report.reason}); recomputed chunks "
        f"{chunk_range(partial.computed_from, partial.total_chunks - 1)} and decoded in "
        f"{partial.compute_s * 1000:.0f} ms",
        flush=True,
    )
    print(
        f"late:    not fetched within its {lease:g}s lease; the producer answered "
        f"{late.report.reason} in {late.report.result.elapsed_s * 1000:.1f} ms (load timeout "
        f"{load_timeout.total_s:g}s); prefilled all {late.total_chunks} chunks and decoded in "
        f"{late.compute_s * 1000:.0f} ms",
        flush=True,
    )
    print(
        f"queued:  waited {queued.age_s:.1f}s after parking (lease {lease:g}s), kept alive by "
        f"{rounds} KeepAlive rounds",
        flush=True,
    )

    expected = {
        "on-time": (LoadPath.REMOTE, None, None),
        "partial": (LoadPath.PARTIAL, Reason.WAIT_TIMEOUT, prefix),
        "late": (LoadPath.RECOMPUTE, Reason.REAPED, 0),
        "queued": (LoadPath.REMOTE, None, None),
    }
    problems = []
    for name in NAMES:
        h = by_name[name]
        want = expected[name]  # path, reason, first chunk recomputed
        got = (h.report.path, h.report.reason, h.report.recomputed_from)
        if got != want:
            problems.append(f"{name}: {got}, expected {want}")
        if not h.tokens_match:
            problems.append(f"{name}: tokens differ from a local prefill's")
        if not h.kv_match:
            problems.append(f"{name}: KV differs from a local prefill's")
        if settings.expect_transport and via(h) not in ("-", settings.expect_transport):
            problems.append(
                f"{name}: loaded via {via(h)}, not {settings.expect_transport} "
                "(DEMO_EXPECT_TRANSPORT)"
            )
    if late.report.result.elapsed_s >= LATE_ANSWER_LIMIT_S:
        problems.append(f"late: answered in {late.report.result.elapsed_s:.3f}s, not at once")
    if problems:
        say("UNEXPECTED: " + "; ".join(problems))
        return 1
    say(
        "ok: every request's KV (loaded chunks CRC32C-checked, the rest recomputed) is bitwise "
        f"a local full prefill's, and so are its {settings.generate} greedy tokens"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TimeoutError as exc:
        say(str(exc))
        sys.exit(1)
