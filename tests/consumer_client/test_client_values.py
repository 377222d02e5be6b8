"""The client's values and pure logic, without a network: Timeout, Reason vs the contract,
the one status-code mapping, LoadResult's derived fields, `into` handling, argument checks."""

from __future__ import annotations

import array
import mmap

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import kvpark.client as consumer_client
from kvpark import wire
from kvpark.checksum import crc32c_of
from kvpark.client import (
    AsyncKVConsumer,
    AsyncKVParker,
    AuthError,
    BufferTooSmallError,
    ConsumerMetrics,
    KVConsumer,
    KVParker,
    LoadPath,
    LoadResult,
    ProtocolError,
    Reason,
    RequestRejectedError,
    State,
    Timeout,
    TransportError,
    UsageError,
    classify_status,
)
from kvpark.client._buffers import ChunkBuffers, IntoBuffer, OwnedBuffer, byte_view, destination_for
from kvpark.client._session import LoadSession, ShmTarget, Step
from kvpark.client._timeouts import USE_CLIENT_DEFAULT, resolve, to_timeout
from kvpark.pb import kvpark_pb2 as pb

# ----------------------------------------------------------------------------------- Timeout


def test_timeout_defaults_to_the_reference_30s_total() -> None:
    t = Timeout()
    assert (t.total_s, t.first_chunk_s, t.per_gib_s) == (30.0, None, None)
    assert t.budget_s() == 30.0 and t.budget_s(10 * 2**30) == 30.0
    assert Timeout(5).total_s == 5


def test_size_scaled_budget_only_shortens_the_total() -> None:
    t = Timeout(total_s=30, base_s=1.0, per_gib_s=2.0)
    assert t.budget_s(2**30 // 2) == pytest.approx(2.0)  # 1 + 2 * 0.5 GiB
    assert t.budget_s(100 * 2**30) == 30  # capped by total
    assert t.budget_s(None) == 30  # size unknown: total only
    assert Timeout(total_s=None, per_gib_s=4).budget_s(2**30) == 4
    assert Timeout(total_s=None).budget_s(2**30) is None


def test_one_timeout_rule_for_every_timeout_argument() -> None:
    """USE_CLIENT_DEFAULT takes the client's; None means no limit (there and in a client); a
    number means that many seconds in all; a Timeout is taken as it is."""
    default = Timeout(7)
    assert resolve(USE_CLIENT_DEFAULT, default) is default
    assert resolve(None, default) == Timeout(total_s=None) == to_timeout(None)
    assert resolve(2.5, default) == Timeout(2.5) == to_timeout(2.5)
    t = Timeout(1, first_chunk_s=0.5)
    assert resolve(t, default) is t


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"total_s": 0}, "Timeout.total_s: expected finite seconds > 0, got 0"),
        ({"total_s": -1}, "Timeout.total_s: expected finite seconds > 0, got -1"),
        ({"total_s": float("nan")}, "Timeout.total_s: expected finite seconds > 0, got nan"),
        ({"total_s": float("inf")}, "Timeout.total_s: expected finite seconds > 0, got inf"),
        ({"total_s": True}, "Timeout.total_s: expected seconds as a number, got True"),
        ({"total_s": "30"}, "Timeout.total_s: expected seconds as a number, got '30'"),
        ({"first_chunk_s": 0}, "Timeout.first_chunk_s: expected finite seconds > 0, got 0"),
        ({"per_gib_s": -1}, "Timeout.per_gib_s: expected finite seconds > 0, got -1"),
        ({"base_s": 1.0}, "Timeout.base_s is only used with per_gib_s"),  # base without per_gib
        (
            {"base_s": -1.0, "per_gib_s": 1.0},
            "Timeout.base_s: expected finite seconds >= 0, got -1.0",
        ),
    ],
)
def test_timeout_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError) as err:
        Timeout(**kwargs)  # type: ignore[arg-type]
    assert str(err.value).startswith(message)  # names the bad field and the value it got


def test_timeout_arguments_of_other_types_are_misuse() -> None:
    with pytest.raises(UsageError):
        resolve("5", Timeout())  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        resolve(True, Timeout())
    with pytest.raises(UsageError):
        KVConsumer("h:1", timeout="30")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ Reason


def test_every_contract_failure_reason_has_a_member() -> None:
    for name, value in pb.FailureReason.items():
        if value == pb.REASON_UNSPECIFIED:
            assert Reason.from_proto(value) is Reason.PROTOCOL_ERROR
            continue
        reason = Reason.from_proto(value)
        assert reason.value == name.removeprefix("REASON_")
        assert reason.from_producer


def test_client_reasons_are_not_producer_reasons() -> None:
    producer = {n.removeprefix("REASON_") for n in pb.FailureReason.keys()}  # noqa: SIM118
    client_only = {r for r in Reason if r.value not in producer}
    assert client_only == {
        Reason.TIMEOUT,
        Reason.UNAVAILABLE,
        Reason.CANCELLED,
        Reason.PROTOCOL_ERROR,
        Reason.RPC_ERROR,
    }
    assert not any(r.from_producer for r in client_only)
    assert Reason.from_proto(999) is Reason.PROTOCOL_ERROR  # a reason newer than the client
    assert Reason.REAPED == "REAPED"  # a str enum: logs and JSON read naturally


def test_every_contract_state_has_a_member() -> None:
    for name, value in pb.State.items():
        if value != pb.STATE_UNSPECIFIED:
            assert State.from_proto(value).value == name.removeprefix("STATE_")


# --------------------------------------------------------------------- the one status mapping


def test_every_grpc_status_code_is_mapped_explicitly() -> None:
    from kvpark.client._errors import _TABLE

    assert set(_TABLE) == set(grpc.StatusCode), "the table must name every StatusCode"
    for code in grpc.StatusCode:
        rule = classify_status(code)
        assert rule.code is code
        assert issubclass(rule.error, consumer_client.RPCError)
        if rule.load_reason is None:  # misuse/misconfiguration: load raises too
            assert code in {
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.UNIMPLEMENTED,
            }


def test_status_mapping_highlights() -> None:
    s = grpc.StatusCode
    assert classify_status(s.UNAVAILABLE).load_reason is Reason.UNAVAILABLE
    assert classify_status(s.UNAVAILABLE).error is TransportError
    assert classify_status(s.DEADLINE_EXCEEDED).load_reason is Reason.TIMEOUT
    assert classify_status(s.CANCELLED).load_reason is Reason.CANCELLED
    assert classify_status(s.UNAUTHENTICATED).error is AuthError
    assert classify_status(s.PERMISSION_DENIED).error is AuthError
    assert classify_status(s.INVALID_ARGUMENT).error is RequestRejectedError
    assert classify_status(s.UNIMPLEMENTED).error is ProtocolError
    assert classify_status(None).load_reason is Reason.RPC_ERROR


# ---------------------------------------------------------------------------------- LoadResult


def _result(**kw: object) -> LoadResult:
    base: dict[str, object] = {
        "kv_request_id": "r",
        "ok": False,
        "reason": Reason.TIMEOUT,
        "detail": "",
        "chunk_ids": (4, 5, 6),
        "chunks_loaded": 1,
        "bytes": 10,
        "chunk_sizes": (10,),
        "elapsed_s": 0.1,
        "producer_epoch": 7,
        "data": np.zeros(10, np.uint8),
    }
    return LoadResult(**{**base, **kw})  # type: ignore[arg-type]


def test_load_result_paths_and_first_missing_chunk() -> None:
    partial = _result()
    assert partial.path is LoadPath.PARTIAL and partial.first_missing_chunk == 5
    miss = _result(chunks_loaded=0, bytes=0, chunk_sizes=())
    assert miss.path is LoadPath.RECOMPUTE and miss.first_missing_chunk == 4
    ok = _result(ok=True, reason=None, chunks_loaded=3, chunk_sizes=(3, 3, 4))
    assert ok.path is LoadPath.REMOTE and ok.first_missing_chunk is None
    assert ok.chunk_offsets == (0, 3, 6)
    everything = _result(chunk_ids=None, chunks_loaded=2, chunk_sizes=(5, 5))
    assert everything.first_missing_chunk == 2


def test_load_result_is_frozen_and_compares_without_data() -> None:
    a, b = _result(), _result(data=np.ones(10, np.uint8))
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.ok = True  # type: ignore[misc]


# --------------------------------------------------------------------------------- buffers


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.zeros(64, np.uint8),
        lambda: np.zeros((4, 4), np.float32),  # any dtype/shape: viewed as bytes
        lambda: bytearray(64),
        lambda: memoryview(bytearray(64)),
        lambda: array.array("d", [0.0] * 8),
        lambda: mmap.mmap(-1, 64),
    ],
)
def test_into_accepts_writable_contiguous_buffers_without_copying(make: object) -> None:
    target = make()  # type: ignore[operator]
    view = byte_view(target)
    assert view.size == 64 and view.dtype == np.uint8
    view[:3] = [1, 2, 3]
    assert bytes(memoryview(target).cast("B")[:3]) == b"\x01\x02\x03"  # same memory


@pytest.mark.parametrize(
    "bad",
    [
        b"immutable",
        memoryview(b"readonly"),
        np.zeros(10, np.uint8)[::2],  # not contiguous
        np.zeros(0, np.uint8),  # no room
        "a string",
        12,
    ],
)
def test_into_rejects_what_cannot_be_written_in_place(bad: object) -> None:
    with pytest.raises(UsageError):
        destination_for(bad)


def test_into_rejects_readonly_numpy() -> None:
    a = np.zeros(8, np.uint8)
    a.flags.writeable = False
    with pytest.raises(UsageError):
        byte_view(a)


def test_placement_is_back_to_back_and_overflow_is_misuse() -> None:
    into = np.zeros(10, np.uint8)
    dest = IntoBuffer(into)
    dest.place(memoryview(b"abcd"), 0, 5)
    dest.place(memoryview(b"efg"), 1, 6)
    assert bytes(into[:7]) == b"abcdefg" and dest.nbytes == 7
    with pytest.raises(BufferTooSmallError) as err:
        dest.place(memoryview(b"hijk"), 2, 7)
    assert (err.value.needed, err.value.available, err.value.chunks_loaded) == (11, 10, 2)
    assert "chunk 7" in str(err.value)
    placed = dest.array()
    assert placed is not None and bytes(placed) == b"abcdefg"
    owned = OwnedBuffer()
    owned.place(memoryview(b"ab"), 0, 0)
    owned.place(memoryview(b"c"), 1, 1)
    whole = owned.array()
    assert whole is not None and bytes(whole) == b"abc"


def test_per_chunk_destinations_take_scatter_lists_and_refuse_what_does_not_fit() -> None:
    blocks = [np.zeros(4, np.uint8), [np.zeros(2, np.uint8), np.zeros(3, np.uint8)]]
    dest = ChunkBuffers(blocks)
    dest.place(memoryview(b"abcd"), 0, 0)
    dest.place(memoryview(b"efghi"), 1, 1)  # scattered over the two pieces in order
    assert bytes(blocks[0]) == b"abcd"
    assert (bytes(blocks[1][0]), bytes(blocks[1][1])) == (b"ef", b"ghi")
    with pytest.raises(BufferTooSmallError):
        dest.place(memoryview(b"x"), 2, 2)  # no third destination
    asked: list[tuple[int, int]] = []

    def paged(chunk_id: int, nbytes: int) -> np.ndarray:
        asked.append((chunk_id, nbytes))
        return np.zeros(3, np.uint8)

    by_call = ChunkBuffers(paged)
    by_call.place(memoryview(b"xyz"), 0, 9)
    assert asked == [(9, 3)] and by_call.array() is None
    with pytest.raises(BufferTooSmallError):
        by_call.place(memoryview(b"four"), 1, 10)
    with pytest.raises(UsageError):
        ChunkBuffers([b"read-only"])


# ------------------------------------------------------------------ the session, fed by hand


def _session(chunk_ids: tuple[int, ...] | None, into: object = None) -> LoadSession:
    from kvpark.client._buffers import destination_for

    return LoadSession(
        kv_request_id="s",
        chunk_ids=chunk_ids,
        destination=destination_for(into),
        timeout=Timeout(),
        expected_epoch=0,
        wait_timeout_s=0.0,
        on_chunk=None,
        max_chunk_bytes=16 << 20,
    )


def _chunk(cid: int, data: bytes, crc: int | None = None) -> bytes:
    return wire.encode_fetch_chunk(cid, crc32c_of(data) if crc is None else crc, [data])


def _done(status: int, reason: int = 0, sent: int = 0) -> bytes:
    return wire.encode_done(pb.TransferDone(status=status, reason=reason, chunks_sent=sent))


def test_session_ok_path() -> None:
    s = _session((1, 0))
    assert s.feed(_chunk(1, b"one")) is Step.CONTINUE
    assert s.feed(_chunk(0, b"zero")) is Step.CONTINUE
    assert s.feed(_done(pb.STATUS_OK, sent=2)) is Step.DONE
    r = s.result(None)
    assert r.ok and bytes(r.data) == b"onezero" and r.chunk_sizes == (3, 4)


def test_session_rejects_out_of_order_and_bad_crc_and_garbage() -> None:
    s = _session((0, 1))
    assert s.feed(_chunk(1, b"x")) is Step.ABANDON
    assert s.result(None).reason is Reason.PROTOCOL_ERROR
    s = _session((0, 1))
    assert s.feed(_chunk(0, b"good")) is Step.CONTINUE
    assert s.feed(_chunk(1, b"bad", crc=123)) is Step.ABANDON
    r = s.result(None)
    assert (r.reason, r.chunks_loaded, bytes(r.data)) == (Reason.CHECKSUM_MISMATCH, 1, b"good")
    s = _session(None)
    assert s.feed(b"\xff\xff\xff") is Step.ABANDON
    assert s.result(None).reason is Reason.PROTOCOL_ERROR


def test_session_failed_done_and_missing_done() -> None:
    s = _session((0, 1))
    s.feed(_chunk(0, b"a"))
    assert s.feed(_done(pb.STATUS_FAILED, pb.REASON_WAIT_TIMEOUT, 1)) is Step.DONE
    r = s.result(None)
    assert (r.reason, r.first_missing_chunk) == (Reason.WAIT_TIMEOUT, 1)
    s = _session((0,))
    s.stream_ended()
    assert s.result(None).reason is Reason.PROTOCOL_ERROR
    s = _session((0, 1))
    s.feed(_chunk(0, b"a"))
    assert s.feed(_done(pb.STATUS_OK, sent=1)) is Step.DONE  # OK but a chunk short
    assert s.result(None).reason is Reason.PROTOCOL_ERROR


def test_session_all_chunks_verified_then_transport_broke_is_ok() -> None:
    s = _session((0,))
    s.feed(_chunk(0, b"all here"))
    s.rpc_failed(grpc.StatusCode.UNAVAILABLE, "reset", timed_out=False)
    assert s.result(None).ok


def test_session_misuse_statuses_raise() -> None:
    s = _session((0,))
    with pytest.raises(RequestRejectedError):
        s.rpc_failed(grpc.StatusCode.INVALID_ARGUMENT, "chunk_id 9 out of range", timed_out=False)
    s = _session((0,))
    with pytest.raises(AuthError):
        s.rpc_failed(grpc.StatusCode.UNAUTHENTICATED, "no token", timed_out=False)


# ----------------------------------------------------------------------- argument misuse


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_request_id": ""},
        {"kv_request_id": "bad\nid"},
        {"kv_request_id": "x" * 300},
        {"kv_request_id": "ok", "chunk_ids": [0], "num_chunks": 1},
        {"kv_request_id": "ok", "num_chunks": 0},
        {"kv_request_id": "ok", "num_chunks": True},
        {"kv_request_id": "ok", "chunk_ids": []},
        {"kv_request_id": "ok", "chunk_ids": [0, 0]},
        {"kv_request_id": "ok", "chunk_ids": [-1]},
        {"kv_request_id": "ok", "chunk_ids": "01"},
        {"kv_request_id": "ok", "expected_epoch": -1},
        {"kv_request_id": "ok", "expected_epoch": 2**64},
        {"kv_request_id": "ok", "timeout": -1},
        {"kv_request_id": "ok", "wait_timeout_s": float("nan")},
        {"kv_request_id": "ok", "into": b"readonly"},
        {"kv_request_id": "ok", "on_chunk": 3},
    ],
)
def test_load_misuse_raises_before_any_call(kwargs: dict[str, object]) -> None:
    client = KVConsumer("127.0.0.1:1")  # nothing listens: misuse must raise before contact
    with pytest.raises(UsageError):
        client.load(**kwargs)  # type: ignore[arg-type]
    client.close()


def test_closed_client_raises_and_bad_constructor_args() -> None:
    client = KVConsumer("127.0.0.1:1")
    client.close()
    with pytest.raises(consumer_client.ClientClosedError):
        client.load("x")
    with pytest.raises(consumer_client.ClientClosedError):
        client.lookup(["x"])
    with pytest.raises(UsageError):
        KVConsumer("")
    with pytest.raises(UsageError):
        KVConsumer("h:1", token="two\nlines")
    with pytest.raises(UsageError):
        KVConsumer("h:1", timeout=0)


@pytest.mark.parametrize("token", ["", "two\nlines", "trailing\r", "t\u00f6k", "with space", 7])
@pytest.mark.parametrize("client", [KVConsumer, AsyncKVConsumer, KVParker, AsyncKVParker])
def test_a_token_grpc_cannot_send_is_refused_at_construction(client: type, token: object) -> None:
    """A token is sent as a metadata value, which grpc takes in printable ASCII only: any
    other fails every call later with INTERNAL "Invalid metadata" (a load quietly recomputes),
    so the client refuses it when built, and never shows it."""
    with pytest.raises(UsageError, match=r"^token: expected a non-empty token") as raised:
        client("127.0.0.1:1", token=token)
    if isinstance(token, str) and token:
        assert token not in str(raised.value)


def test_public_api_is_curated() -> None:
    import kvpark

    assert len(set(consumer_client.__all__)) == len(consumer_client.__all__)
    for name in consumer_client.__all__:
        assert hasattr(consumer_client, name), name
    # `kvpark` itself: the clients, Timeout, the result, reason and error types; no more.
    surface = set(kvpark.__all__) - {"__version__"}
    assert {"KVConsumer", "AsyncKVConsumer", "KVParker", "AsyncKVParker", "Timeout"} <= surface
    assert surface <= set(consumer_client.__all__)
    assert all(getattr(kvpark, n) is getattr(consumer_client, n) for n in surface)
    # The exception tree drawn in the module docstring matches the classes.
    assert issubclass(consumer_client.BufferTooSmallError, consumer_client.UsageError)
    assert issubclass(consumer_client.UsageError, ValueError)
    assert issubclass(consumer_client.ClientClosedError, RuntimeError)
    for cls in (TransportError, RequestRejectedError, AuthError, ProtocolError):
        assert issubclass(cls, consumer_client.RPCError)
    doc = consumer_client.__doc__ or ""
    for name in consumer_client.__all__:
        obj = getattr(consumer_client, name)
        if isinstance(obj, type) and issubclass(obj, consumer_client.KVParkError):
            assert name in doc, f"{name} missing from the exception tree in the docstring"


@pytest.mark.parametrize(
    ("chunk_ids", "num_chunks", "message"),
    [
        ([2**32 - 1], None, "not a chunk id"),  # 2**32 - 1 marks a data connection's end
        ([-1], None, "not a chunk id"),
        ([0, 0], None, "repeats"),
        (None, 2**32, "num_chunks"),
        (None, 0, "num_chunks"),
    ],
)
def test_chunk_ids_outside_the_id_space_are_misuse(
    chunk_ids: list[int] | None, num_chunks: int | None, message: str
) -> None:
    with KVConsumer("127.0.0.1:1") as consumer, pytest.raises(UsageError, match=message):
        consumer.load("x", chunk_ids=chunk_ids, num_chunks=num_chunks, timeout=0.01)


def test_consumer_metrics_refuse_an_unknown_policy_and_a_second_registration() -> None:
    """A typo in `policy` would be exported as the policy the worker runs with; a second
    ConsumerMetrics in one registry would fail inside prometheus_client with no word of what to
    do. Both are misuse, named."""
    registry = CollectorRegistry()
    with pytest.raises(UsageError, match="policy: expected 'recompute' or 'fail', got 'recompte'"):
        ConsumerMetrics(registry, policy="recompte")
    assert registry.get_sample_value("kvpark_client_failure_policy", {"policy": "recompte"}) is None
    ConsumerMetrics(registry, policy="fail")
    with pytest.raises(UsageError, match="already holds a ConsumerMetrics"):
        ConsumerMetrics(registry)
    assert registry.get_sample_value("kvpark_client_failure_policy", {"policy": "fail"}) == 1


@pytest.mark.parametrize(
    "target, problem",
    [
        ("localhost", "expected 'host:port'"),  # gRPC would dial port 443
        ("127.0.0.1:0", "port 0 cannot be dialed"),
        (" producer:50051", "spaces around it"),
        ("http://producer:50051", "expected 'host:port'"),  # gRPC would take it for a name
        ("", "expected 'host:port'"),
        ("::1:50051", "IPv6 address in brackets"),  # gRPC would take it for a name
    ],
)
def test_a_target_that_cannot_reach_a_producer_is_misuse(target: str, problem: str) -> None:
    """Each of these would make every load fail UNAVAILABLE as if the producer were down."""
    for client in (KVConsumer, consumer_client.KVParker, consumer_client.AsyncKVConsumer):
        with pytest.raises(UsageError, match=f"target: .*{problem}"):
            client(target)


@pytest.mark.parametrize(
    "target",
    [
        "producer:50051",
        "[::1]:50051",
        "dns:///producer:50051",
        "unix:/run/kv.sock",
        "passthrough:///producer:50051",
        "kvpark_producer_1:50051",  # docker compose v1 names
        "kvpark.ns.svc.cluster.local.:50051",  # a fully qualified name
    ],
)
def test_host_port_and_grpc_targets_are_taken(target: str) -> None:
    KVConsumer(target).close()
    consumer_client.KVParker(target).close()


@pytest.mark.parametrize("direct", [True, False])
def test_a_chunk_placed_anywhere_but_right_after_the_last_is_a_protocol_error(
    direct: bool,
) -> None:
    """Shared-memory placements go back to back: a placement over an earlier chunk (or past
    a gap) would have the load report a chunk where it is not."""
    lent = np.zeros(8, np.uint8)
    into = lent if direct else np.zeros(8, np.uint8)
    shm = ShmTarget("lend", lent.data, 0, 8, direct=direct)
    session = LoadSession(
        kv_request_id="s",
        chunk_ids=(0, 1),
        destination=destination_for(into),
        timeout=Timeout(),
        expected_epoch=0,
        wait_timeout_s=0.0,
        on_chunk=None,
        max_chunk_bytes=16 << 20,
        shm=shm,
    )
    lent[:4] = 1
    first = pb.ChunkPlaced(chunk_id=0, crc32c=crc32c_of(b"\x01" * 4), offset=0, nbytes=4)
    placed = pb.FetchResponse(placed=pb.ChunksPlaced(chunks=[first]))
    assert session.feed(placed.SerializeToString()) is Step.CONTINUE
    over = pb.ChunkPlaced(chunk_id=1, crc32c=crc32c_of(b"\x01" * 4), offset=0, nbytes=4)
    step = session.feed(pb.FetchResponse(placed=pb.ChunksPlaced(chunks=[over])).SerializeToString())
    assert step is not Step.CONTINUE
    result = session.result(None)
    assert result.reason is Reason.PROTOCOL_ERROR and "placed at 0, not at 4" in result.detail
    assert result.chunks_loaded == 1
