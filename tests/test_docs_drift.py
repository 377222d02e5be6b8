"""Drift tests: what the README and the protocol promise must agree with the code and with what
CI runs."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpark.pb import kvpark_pb2 as pb
from kvpark.producer.config import KEYS
from kvpark.producer.lot import Lot, LotSettings
from kvpark.producer.metrics import ProducerMetrics
from kvpark.producer.pool import HostPool

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PROTOCOL = (ROOT / "docs" / "protocol.md").read_text()
PROTO = (ROOT / "protos" / "kvpark" / "v1" / "kvpark.proto").read_text()


def test_readme_configuration_table_lists_exactly_the_keys() -> None:
    section = README.split("### Configuration", 1)[1].split("\n### ", 1)[0]
    documented = re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)
    assert documented == list(KEYS), "README configuration table drifted from ProducerConfig"


def test_readme_metric_names_are_exactly_the_exported_ones() -> None:
    section = README.split("### Metrics", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`((?:kvpark|process)_[a-z_]+)", section))
    lot = Lot(HostPool(1 << 20), LotSettings(), epoch=1, clock=lambda: 0.0)
    metrics = ProducerMetrics(lot.pool.statistics(), lot.statistics())
    metrics.count_park(pb.REASON_UNSPECIFIED)
    metrics.count_fetch(pb.REASON_UNSPECIFIED)
    metrics.suppressed_warnings_total.labels("late_fetch").inc()
    text = generate_latest(metrics.registry).decode()
    exported = {
        f.name + "_total" if f.type == "counter" else f.name
        for f in text_string_to_metric_families(text)
    }
    assert documented == exported, (
        f"README lists {sorted(documented - exported)} that are not exported; "
        f"exported {sorted(exported - documented)} are not in the README"
    )


def test_ci_runs_the_readme_test_command() -> None:
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(
        r"^(\./scripts/\S+|docker[- ]compose? [^#\n]+?)\s*(?:#.*)?$", quick_start, re.M
    )
    assert "./scripts/test.sh" in commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^exec \./scripts/test\.sh\s*$", ci, re.M), (
        ".ci/run must call the README's test command"
    )


def test_readme_demo_command_names_the_compose_service() -> None:
    compose = (ROOT / "docker-compose.yml").read_text()
    match = re.search(r"--exit-code-from (\S+)", README)
    assert match, "the demo command must end with the decode worker's exit code"
    assert re.search(rf"^  {re.escape(match.group(1))}:", compose, re.M), (
        "README names a service compose lacks"
    )


def test_protocol_lists_exactly_the_grpc_codes_the_producer_sends() -> None:
    # Other teams' clients decide what each status means from these two texts: a code the
    # producer starts sending must reach the normative table and the proto's opening comment.
    sent: set[str] = set()
    for path in (ROOT / "producer_service").glob("*.py"):
        sent |= set(re.findall(r"\bStatusCode\.([A-Z_]+)", path.read_text()))
    assert sent, "found no status code in producer_service: the pattern drifted"
    section = PROTOCOL.split("## Outcomes", 1)[1].split("\n## ", 1)[0]
    documented: set[str] = set()
    for codes, sent_by in re.findall(r"^\| ((?:`[A-Z_]+`(?:, )?)+) \| ([^|]+) \|", section, re.M):
        if "producer" in sent_by:
            documented |= set(re.findall(r"`([A-Z_]+)`", codes))
    assert documented == sent, (
        f"protocol.md Outcomes lists {sorted(documented - sent)} the producer does not send; "
        f"the producer sends {sorted(sent - documented)} it does not list"
    )
    opening = PROTO.split("\nsyntax", 1)[0]
    missing = sorted(code for code in sent if not re.search(rf"\b{code}\b", opening))
    assert not missing, f"the proto's opening comment does not name {missing}"
