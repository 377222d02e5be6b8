"""Ablation: what each data-path lever buys, each measured before/after in one run.

`python -m benchmarks.ablation [--reps N] [--json PATH]` moves the 580 MB request (park, then
fetch into a preallocated numpy array, every byte verified) through four set-ups, interleaved
repetition by repetition so they share the machine's conditions:

    shipped    allocator fix in both processes, hand framing on the data path (identity
               (de)serializers + kvpark.wire on both sides), 4 MiB chunks
    no-alloc   the same without the allocator fix, in both processes (lever 1)
    protobuf   generated message classes on the data path, both sides (lever 2): the producer's
               Park/Fetch registered with the generated (de)serializers, the client using the
               generated stub and reading `chunk.data`
    64k        shipped, with 64 KiB chunks instead of 4 MiB (lever 3)

Each client runs in a process of its own (`python -m benchmarks.ablation client`), so the
allocator setting is per process as in a deployment; each producer variant runs through
`python -m benchmarks.ablation producer VARIANT -- <flags>`, which applies the variant to the
real producer and then runs its ordinary `main`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import data
from .env import GiB, MiB, ProducerProcess, ProducerSettings, child_env, cpu_seconds, stop_child
from .report import GB, Figure, VerificationError, render_table, write_json

NBYTES = 580_000_000
VARIANTS = ("shipped", "no-alloc", "protobuf", "64k")
_CHUNK = {"shipped": 4 * MiB, "no-alloc": 4 * MiB, "protobuf": 4 * MiB, "64k": 64 * 1024}
_PRODUCER = {"shipped": "shipped", "no-alloc": "no-alloc", "protobuf": "protobuf", "64k": "shipped"}
_SETTINGS = ProducerSettings(pool_bytes=1 * GiB, max_chunk_bytes=4 * MiB)
# The pool hands out whole 256 KiB pages, so 580 MB in 64 KiB chunks occupies 8,851 pages
# (2.2 GiB): the producer the 64k variant shares gets a pool that holds it.
_POOL_BYTES = {"shipped": 5 * GiB // 2, "no-alloc": 1 * GiB, "protobuf": 1 * GiB}


# ============================================================================== producer side
def producer_main(variant: str, flags: Sequence[str]) -> int:
    """Runs the real producer with `variant` applied."""
    import kvpark.producer.__main__ as entry

    if variant == "no-alloc":
        entry.tune_allocator = lambda: False  # type: ignore[attr-defined]
    elif variant == "protobuf":
        import kvpark.producer.server as server

        server.method_handlers = _protobuf_handlers  # type: ignore[attr-defined]
    elif variant != "shipped":
        raise SystemExit(f"unknown producer variant {variant!r}")
    return entry.main(list(flags))


def _protobuf_handlers(servicer: Any) -> Any:
    """The service with generated message classes on Park and Fetch, as a straightforward
    implementation would register it: every chunk is parsed into / built as a protobuf
    message (upb copies the payload each time). The producer's logic is unchanged: the
    messages are turned back into the frames it handles."""
    import grpc

    from kvpark.pb import kvpark_pb2 as pb
    from kvpark.producer.servicer import SERVICE_NAME

    async def park(requests: AsyncIterator[Any], context: Any) -> Any:
        async def frames() -> AsyncIterator[bytes]:
            async for message in requests:
                yield message.SerializeToString()

        return await servicer.Park(frames(), context)

    class ProtobufWrites:
        """The real context, with each chunk frame going out as a generated message."""

        def __init__(self, context: Any) -> None:
            self._context = context

        async def write(self, frame: bytes) -> None:
            await self._context.write(pb.FetchResponse.FromString(frame).SerializeToString())

        def __getattr__(self, name: str) -> Any:
            return getattr(self._context, name)

    async def fetch(request: Any, context: Any) -> Any:
        # Registered like the shipped Fetch (unary-unary, chunks written, TransferDone
        # returned: servicer.method_handlers says why), so only the message classes differ.
        return pb.FetchResponse.FromString(await servicer.Fetch(request, ProtobufWrites(context)))

    def unary(behavior: Any, request_type: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(
            behavior,
            request_deserializer=request_type.FromString,
            response_serializer=lambda m: m.SerializeToString(),
        )

    serialize = lambda m: m.SerializeToString()  # noqa: E731
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Park": grpc.stream_unary_rpc_method_handler(
                park, request_deserializer=pb.ParkRequest.FromString, response_serializer=serialize
            ),
            "Fetch": grpc.unary_unary_rpc_method_handler(
                fetch,
                request_deserializer=pb.FetchRequest.FromString,
                response_serializer=serialize,
            ),
            "KeepAlive": unary(servicer.KeepAlive, pb.KeepAliveRequest),
            "Release": unary(servicer.Release, pb.ReleaseRequest),
            "Lookup": unary(servicer.Lookup, pb.LookupRequest),
            "GetServerInfo": unary(servicer.GetServerInfo, pb.GetServerInfoRequest),
        },
    )


# ================================================================================ client side
def client_main(windows: int, allocator_fix: bool) -> int:
    """Answers `run VARIANT TARGET PRODUCER_PID WINDOW KID` lines with one JSON line each."""
    import grpc

    from kvpark.alloc import tune_allocator
    from kvpark.pb import kvpark_pb2 as pb
    from kvpark.pb import kvpark_pb2_grpc as pb_grpc

    from .clients import LOAD_TIMEOUT_S, MAX_MESSAGE_BYTES, ConsumerLoader, Parker, zeroed
    from .env import channel_options

    if allocator_fix:
        tune_allocator()
    source = data.pattern(data.source_size(NBYTES, windows))
    dest = zeroed(NBYTES)
    parkers: dict[str, Parker] = {}
    loaders: dict[str, ConsumerLoader] = {}
    stubs: dict[str, Any] = {}
    for line in sys.stdin:
        variant, target, pid_s, window_s, kid = line.split()
        chunk, pid = _CHUNK[variant], int(pid_s)
        payload = data.window(source, int(window_s), NBYTES)
        crcs = data.chunk_crcs(payload, chunk)
        parker = parkers.get(target) or parkers.setdefault(target, Parker(target))
        parker.keep_alive([kid], 120.0)
        dest.fill(0)
        me = os.getpid()
        if variant == "protobuf":
            if target not in stubs:
                channel = grpc.insecure_channel(target, channel_options(MAX_MESSAGE_BYTES))
                stubs[target] = pb_grpc.KVProducerStub(channel)
            stub = stubs[target]
            c0, p0, t0 = cpu_seconds(me), cpu_seconds(pid), time.perf_counter()
            reply = stub.Park(_pb_park(pb, kid, payload, chunk, crcs), timeout=120)
            c1, p1, t1 = cpu_seconds(me), cpu_seconds(pid), time.perf_counter()
            ok = reply.status == pb.STATUS_OK and _pb_fetch(pb, stub, kid, dest)
        else:
            loader = loaders.get(target) or loaders.setdefault(target, ConsumerLoader(target))
            c0, p0, t0 = cpu_seconds(me), cpu_seconds(pid), time.perf_counter()
            reply = parker.park(kid, payload, chunk, crcs)
            c1, p1, t1 = cpu_seconds(me), cpu_seconds(pid), time.perf_counter()
            ok = reply.status == pb.STATUS_OK
            if ok:
                ok = loader.load(kid, len(crcs), dest, LOAD_TIMEOUT_S).ok
        c2, p2, t2 = cpu_seconds(me), cpu_seconds(pid), time.perf_counter()
        verified = ok and data.same_bytes(dest, payload)
        print(json.dumps({
            "ok": verified, "park_s": t1 - t0, "fetch_s": t2 - t1,
            "park_cpu": [c1 - c0, p1 - p0], "fetch_cpu": [c2 - c1, p2 - p1],
        }), flush=True)  # fmt: skip
    return 0


def _pb_park(pb: Any, kid: str, payload: data.U8, chunk: int, crcs: list[int]) -> Iterator[Any]:
    view = memoryview(payload)  # type: ignore[arg-type]
    header = pb.ParkHeader(kv_request_id=kid, total_chunks=len(crcs), batch_bytes=len(payload))
    yield pb.ParkRequest(header=header)
    for i, crc in enumerate(crcs):
        piece = bytes(view[i * chunk : (i + 1) * chunk])
        yield pb.ParkRequest(chunk=pb.Chunk(chunk_id=i, data=piece, crc32c=crc))


def _pb_fetch(pb: Any, stub: Any, kid: str, dest: data.U8) -> bool:
    from kvpark.checksum import crc32c_of

    view = memoryview(dest)  # type: ignore[arg-type]
    pos = 0
    for message in stub.Fetch(pb.FetchRequest(kv_request_id=kid), timeout=60):
        if message.WhichOneof("kind") == "chunk":
            payload = message.chunk.data  # upb copies the payload out of the message
            if crc32c_of(payload) != message.chunk.crc32c:
                return False
            view[pos : pos + len(payload)] = payload
            pos += len(payload)
        else:
            return bool(message.done.status == pb.STATUS_OK)
    return False


# ================================================================================= the run
def run(reps: int, progress: Any) -> tuple[list[Figure], dict[str, Any]]:
    producers: dict[str, ProducerProcess] = {}
    clients: dict[bool, subprocess.Popen[str]] = {}
    samples: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    windows = reps * len(VARIANTS) + 1
    try:
        for name in ("shipped", "no-alloc", "protobuf"):
            progress(f"ablation: starting the {name} producer")
            producers[name] = ProducerProcess(
                replace(_SETTINGS, pool_bytes=_POOL_BYTES[name]),
                command=[sys.executable, "-m", "benchmarks.ablation", "producer", name, "--"],
                allocator_fix=name != "no-alloc",
            )
        for fix in (True, False):
            clients[fix] = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.ablation", "client", str(windows),
                 "fix" if fix else "nofix"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, env=child_env(allocator_fix=fix), bufsize=1,
            )  # fmt: skip
        window = 0
        for rep in range(reps):
            for variant in VARIANTS:
                progress(f"ablation: {variant}, repetition {rep + 1}/{reps}")
                producer = producers[_PRODUCER[variant]]
                client = clients[variant != "no-alloc"]
                assert client.stdin is not None and client.stdout is not None
                kid = f"ablation-{variant}-{rep}-{os.getpid()}"
                client.stdin.write(f"{variant} {producer.target} {producer.pid} {window} {kid}\n")
                client.stdin.flush()
                window += 1
                line = client.stdout.readline()
                if not line:
                    err = client.stderr.read() if client.stderr else ""
                    raise RuntimeError(f"ablation client exited: {err[-2000:]}")
                result = json.loads(line)
                if not result["ok"]:
                    raise VerificationError(f"ablation {variant}: bytes or outcome wrong")
                samples[variant].append(result)
    finally:
        for client in clients.values():
            stop_child(client)
        for producer in producers.values():
            producer.stop()
    return _figures(samples), {"samples": samples}


def _figures(samples: dict[str, list[dict[str, Any]]]) -> list[Figure]:
    gb = NBYTES / GB
    figures: list[Figure] = []
    for step in ("park", "fetch"):
        base = [gb / s[f"{step}_s"] for s in samples["shipped"]]
        for variant in VARIANTS:
            rates = [gb / s[f"{step}_s"] for s in samples[variant]]
            cpu = [sum(s[f"{step}_cpu"]) / gb for s in samples[variant]]
            ratios = [a / b for a, b in zip(rates, base, strict=True)]
            figures.append(Figure(
                f"ablation_{step}_{variant}_gbps", f"{step} 580 MB, {variant}", "GB/s",
                statistics.median(rates), rates, spread=(min(rates), max(rates)),
                ratio=statistics.median(ratios), ratio_to="shipped",
                note=f"CPU {statistics.median(cpu):.2f} s/GB (client + producer)",
            ))  # fmt: skip
            figures.append(Figure(
                f"ablation_{step}_{variant}_cpu_s_per_gb",
                f"{step} 580 MB, {variant}: CPU per GB", "s/GB", statistics.median(cpu), cpu,
                spread=(min(cpu), max(cpu)), group="cpu",
            ))  # fmt: skip
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["producer"]:
        flags = args[3:] if args[2:3] == ["--"] else args[2:]
        return producer_main(args[1], flags)
    if args[:1] == ["client"]:
        return client_main(int(args[1]), args[2] == "fix")
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ablation", description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    ns = parser.parse_args(args)
    from kvpark.alloc import tune_allocator

    tune_allocator()
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    try:
        figures, extra = run(ns.reps, progress)
    except VerificationError as exc:
        print(f"VERIFICATION FAILED: {exc}")
        return 1
    print(render_table([f for f in figures if f.group == "main"]))
    print()
    print(render_table([f for f in figures if f.group == "cpu"]))
    if ns.json is not None:
        write_json(ns.json, {"reps": ns.reps, "nbytes": NBYTES}, figures, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
