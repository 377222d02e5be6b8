"""`kvpark bench` checks the producer's answer to every delivery it confirms, the concurrent
loads' included: a refused confirmation is a wrong outcome, the section fails and the run
exits 1. The bench runs in this process, so that the consumer's confirm can be made to answer
as a producer that refuses would; its producer and helper processes are real."""

from __future__ import annotations

from typing import Any

import pytest

from kvpark.client import KVConsumer, Reason, ReleaseResult, cli


def test_a_refused_confirmation_of_a_concurrent_load_fails_the_section(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    confirm = KVConsumer.confirm

    def refuse_concurrent(self: KVConsumer, result: Any, **kwargs: Any) -> ReleaseResult:
        if "-grpc-c0-" in result.kv_request_id:  # the first round of loads at once
            return ReleaseResult(result.kv_request_id, False, Reason.UNKNOWN_ID, "refused")
        return confirm(self, result, **kwargs)

    monkeypatch.setattr(KVConsumer, "confirm", refuse_concurrent)
    # 17 MiB in 1 MiB chunks: one whole chunk for each of the 16 loads at once.
    args = cli.build_parser().parse_args(
        ["bench", "--transport", "grpc", "--size", "17MiB", "--reps", "1",
         "--latency-tries", "1", "--quiet"]
    )  # fmt: skip
    assert args.run(args) == 1
    out = capsys.readouterr().out
    assert "FAILED: concurrent: wrong answer: confirming the delivery of" in out, out
    assert "UNKNOWN_ID" in out and "FAILED: warm-up" not in out, out
