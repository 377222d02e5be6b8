"""Parks one request's KV with nothing but the stubs generated from the proto: the wire, shown.

A prefill worker in any language parks like this, with stubs generated from
`protos/kvpark/v1/kvpark.proto` and a CRC32C (Castagnoli) function. One `Park` call is a client
stream of `ParkRequest` messages, answered by one `ParkResponse`:

    ParkRequest{header: ParkHeader{kv_request_id, total_chunks, batch_bytes}}    first
    ParkRequest{chunk: Chunk{chunk_id, crc32c, data}}                           one per chunk
    ParkRequest{commit: ParkCommit{chunks, bytes}}                              last

- `total_chunks` declares how many chunks the id has (0: let the first commit fix it);
  `batch_bytes` the payload bytes this call will send, so the producer reserves its pool up
  front and answers POOL_FULL (with `retry_after_s`) before any byte is sent.
- `crc32c` is the CRC32C of `data`. The field has explicit presence: a CRC that is set is
  checked, whatever its value (0 too). A mismatch fails the call with CHECKSUM_MISMATCH.
- The commit names what this call sent: the number of Chunk messages and the sum of their
  `data` lengths. Nothing of the batch is visible before it; a commit whose counts differ
  (COMMIT_MISMATCH) or a stream that ends without one (NOT_COMMITTED) undoes the whole batch.
- The call carries the prefill role's token as `authorization: Bearer <token>` metadata, and
  needs a send limit (`grpc.max_send_message_length`) above the largest chunk plus framing.

Outcomes are in-band: `ParkResponse.status` is STATUS_OK or STATUS_FAILED with a `reason`;
gRPC error statuses mean the request was malformed or not authorised, or the transport failed.
This script prints every message it sends, with the first bytes of its encoding (`Chunk.data`
is the last field, so a chunk's encoding is a short prefix followed by the payload), and the
answer.

The KV is real: examples/reference_model.py's float16 cache after prefilling a seeded prompt,
chunk c holding token positions [64c, 64c + 64) of every layer, K and V, in kvpark.layout's
canonical byte order (docs/kv-layout.md), so a decode worker loads it into its own cache and
resumes the prefill from it.

    python examples/park_with_stubs.py --target 127.0.0.1:50051 --id req-1 --tokens 300

Exit status: 0 parked, 1 the producer refused (the reason is printed), 3 the call failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import crc32c_rs
import grpc
import numpy as np
from reference_model import ReferenceModel

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc

# Room for a message's framing around the payload.
FRAME_MARGIN_BYTES = 64 * 1024
PARK_TIMEOUT_S = 30.0


def prompt_kv(num_tokens: int, seed: int = 0) -> list[bytes]:
    """The reference model's KV for a seeded prompt of `num_tokens` tokens, one bytes object
    per chunk in the canonical order (what a decode worker's KVLayout expects)."""
    model = ReferenceModel(seed=seed)
    tokens = np.random.default_rng(seed + 1).integers(0, model.config.vocab_size, num_tokens)
    cache = model.new_cache(num_tokens)
    model.prefill(tokens, cache)
    kv = model.layout.block_major(cache, num_tokens)
    return [
        b"".join(model.layout.chunk_parts(kv, c))
        for c in range(model.layout.num_chunks(num_tokens))
    ]


def park_messages(
    kv_request_id: str, chunks: Sequence[bytes], total_chunks: int | None = None
) -> list[pb.ParkRequest]:
    """One Park batch: header, every chunk with its CRC32C, commit. `total_chunks` defaults
    to len(chunks) (the batch is the whole id)."""
    header = pb.ParkHeader(
        kv_request_id=kv_request_id,
        total_chunks=len(chunks) if total_chunks is None else total_chunks,
        batch_bytes=sum(len(data) for data in chunks),
    )
    messages = [pb.ParkRequest(header=header)]
    for chunk_id, data in enumerate(chunks):
        chunk = pb.Chunk(chunk_id=chunk_id, crc32c=crc32c_rs.crc32c(data), data=data)
        messages.append(pb.ParkRequest(chunk=chunk))
    commit = pb.ParkCommit(chunks=len(chunks), bytes=sum(len(data) for data in chunks))
    messages.append(pb.ParkRequest(commit=commit))
    return messages


def describe(message: pb.ParkRequest) -> str:
    """One line per message: its fields, and the first bytes of its encoding."""
    wire = message.SerializeToString()
    head = wire[:16].hex(" ")
    kind = message.WhichOneof("kind")
    if kind == "chunk":
        c = message.chunk
        fields = f"chunk_id={c.chunk_id} crc32c={c.crc32c:#010x} data=<{len(c.data)} bytes>"
    elif kind == "header":
        h = message.header
        fields = (
            f"kv_request_id={h.kv_request_id!r} total_chunks={h.total_chunks} "
            f"batch_bytes={h.batch_bytes}"
        )
    else:
        fields = f"chunks={message.commit.chunks} bytes={message.commit.bytes}"
    more = " ..." if len(wire) > 16 else ""
    return f"-> {kind:<6} {fields}\n   {len(wire)} bytes on the wire: {head}{more}"


def park(
    channel: grpc.Channel,
    messages: Sequence[pb.ParkRequest],
    token: str | None = None,
    timeout_s: float = PARK_TIMEOUT_S,
) -> pb.ParkResponse:
    """Sends one Park stream; the producer's answer (raises grpc.RpcError for a gRPC status)."""
    stub = kvpark_pb2_grpc.KVProducerStub(channel)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    reply: pb.ParkResponse = stub.Park(iter(messages), timeout=timeout_s, metadata=metadata)
    return reply


def open_channel(target: str, max_chunk_bytes: int, ca_file: str | None = None) -> grpc.Channel:
    options = [("grpc.max_send_message_length", max_chunk_bytes + FRAME_MARGIN_BYTES)]
    if ca_file:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes())
        return grpc.secure_channel(target, creds, options)
    return grpc.insecure_channel(target, options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:50051", help="producer host:port")
    parser.add_argument("--id", default="stubs-1", help="kv_request_id")
    parser.add_argument("--tokens", type=int, default=300, help="prompt length (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="model and prompt seed")
    parser.add_argument("--token", default=None, help="the producer's park token, if it has one")
    parser.add_argument("--ca-file", default=None, help="PEM CA: speak TLS to the producer")
    args = parser.parse_args(argv)

    chunks = prompt_kv(args.tokens, args.seed)
    messages = park_messages(args.id, chunks)
    for message in messages:
        print(describe(message))
    with open_channel(args.target, max(len(c) for c in chunks), args.ca_file) as channel:
        try:
            reply = park(channel, messages, args.token)
        except grpc.RpcError as exc:
            print(f"<- gRPC status {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 3
    status = pb.Status.Name(reply.status)
    if reply.status != pb.STATUS_OK:
        print(f"<- {status} {pb.FailureReason.Name(reply.reason)}: {reply.detail}")
        return 1
    print(
        f"<- {status} chunks_parked={reply.chunks_parked} bytes_parked={reply.bytes_parked} "
        f"total_chunks={reply.total_chunks} producer_epoch={reply.producer_epoch:#018x} "
        f"lease_remaining_s={reply.lease_remaining_s:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
