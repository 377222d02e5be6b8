"""The fleet stack (docker-compose.fleet.yml): two prefill nodes, one producer SIGKILLed mid-run.

The stack runs once per module, as the README command runs it (`up --exit-code-from driver`),
on the session's image and as its own project (`kvpark-test-fleet-<pid>`, torn down with
`down -v` whatever happens). The tests then read the driver's `fleet-json:` line and hold every
request to its expected path and time by their own rules, not by the driver's verdict; they
look at the containers and their logs for the kill and for the producer that kept serving; and
they feed the driver's judge broken copies of the run to show it fails when it should.

The checks of the file itself need no Docker and run everywhere.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import yaml

from kvpark.producer.config import KEYS
from kvpark.producer.config_values import parse_bytes

from .conftest import TOKENS_ENV
from .stack import ROOT, Stack

FLEET_FILE = ROOT / "docker-compose.fleet.yml"
FLEET_COMMAND = "docker compose -f docker-compose.fleet.yml up --build --exit-code-from driver"
NODES = ("prefill-a", "prefill-b")
KILLED, SURVIVOR = NODES
SERVICES = (*NODES, "decode-1", "decode-2", "proxy", "driver")
MiB = 1024 * 1024
# What the compose file gives the prefill worker beside the producer in a node's container.
WORKER_ALLOWANCE_MIB = 128
# The whole run, image already built; it takes ~20 s on 2 cores.
RUN_LIMIT_S = 120
# Slack on a client timeout for a fallback (the driver's own margin is the same).
MARGIN_S = 1.0


@dataclass
class FleetRun:
    code: int
    output: str
    took_s: float
    run: dict[str, Any]
    logs: dict[str, str]
    states: dict[str, dict[str, Any]]

    def requests(self, node: str, phase: str | None = None) -> list[dict[str, Any]]:
        return [
            r
            for r in self.run["requests"]
            if r["node"] == node and (phase is None or r["phase"] == phase)
        ]


def _fleet_json(output: str) -> dict[str, Any]:
    for line in output.splitlines():
        _, marker, rest = line.partition("fleet-json: ")
        if marker:
            return dict(json.loads(rest))
    raise AssertionError(f"the driver printed no fleet-json line:\n{output[-5000:]}")


@pytest.fixture(scope="module")
def fleet(kvpark_image: None) -> Any:
    stack = Stack(f"kvpark-test-fleet-{os.getpid()}", [FLEET_FILE], env=dict(TOKENS_ENV))
    stack.down()  # a leftover of a crashed run with the same pid
    try:
        started = time.monotonic()
        proc = stack.run(
            "up", "--no-build", "--no-color", "--exit-code-from", "driver",
            timeout=RUN_LIMIT_S + 60, check=False,
        )  # fmt: skip
        took = time.monotonic() - started
        output = proc.stdout + proc.stderr
        logs = {s: stack.run("logs", "--no-color", s, check=False).stdout for s in NODES}
        states = {s: json.loads(stack.inspect("{{json .State}}", s)) for s in SERVICES}
        yield FleetRun(proc.returncode, output, took, _fleet_json(output), logs, states)
    finally:
        stack.down()


# --------------------------------------------------------------------------- the run itself
@pytest.mark.compose
@pytest.mark.timeout(900)
def test_the_run_ends_by_itself_with_ok(fleet: FleetRun) -> None:
    assert fleet.code == 0, fleet.output[-5000:]
    verdict = [line for line in fleet.output.splitlines() if "fleet: " in line][-1]
    assert verdict.split("| ", 1)[-1].startswith("fleet: ok "), verdict
    assert fleet.run["ok"] and fleet.run["problems"] == []
    assert fleet.took_s < RUN_LIMIT_S, f"took {fleet.took_s:.0f}s"
    print(f"fleet: up -> exit 0 in {fleet.took_s:.1f}s; the driver's run {fleet.run['elapsed_s']}s")


@pytest.mark.compose
@pytest.mark.timeout(900)
def test_every_request_took_its_nodes_path(fleet: FleetRun) -> None:
    """Per node and phase, every request came back verified on the path its producer's state
    calls for: everything remote on the survivor, and on the killed node remote before the
    kill, partial for the load it cut off, recompute for whatever came later."""
    expected = {
        (KILLED, "before"): "remote",
        (KILLED, "streamed"): "partial",
        (KILLED, "queued"): "recompute",
        (KILLED, "after"): "recompute",
    }
    per_node = 3  # FLEET_PER_NODE in the compose file
    assert len(fleet.run["requests"]) == 2 * (3 * per_node + 1)
    for node in NODES:
        for phase in ("before", "streamed", "queued", "after"):
            group = fleet.requests(node, phase)
            assert len(group) == (1 if phase == "streamed" else per_node), (node, phase)
            want = expected.get((node, phase), "remote")
            for r in group:
                assert r["error"] is None and r["verified"], r
                assert r["path"] == want, (node, phase, r)
            if want == "remote":
                assert all(r["chunks_loaded"] == fleet.run["chunks"] for r in group)
    # The handle always named the producer as its node advertises it.
    for r in fleet.run["requests"]:
        if r["park_ok"]:
            assert r["handle_producer"] == f"{r['node']}:50051", r


@pytest.mark.compose
@pytest.mark.timeout(900)
def test_the_killed_nodes_requests_fell_back_within_the_bound(fleet: FleetRun) -> None:
    load_timeout, park_timeout = fleet.run["load_timeout_s"], fleet.run["park_timeout_s"]
    killed_at = fleet.run["kill"]["killed_at"]
    half = fleet.run["chunks"] // 2

    [cut] = fleet.requests(KILLED, "streamed")
    noticed = cut["ended_at"] - killed_at
    assert cut["reason"] in ("UNAVAILABLE", "CANCELLED"), cut
    assert (cut["chunks_loaded"], cut["recomputed_from"]) == (half, half), cut
    assert 0 <= noticed <= load_timeout + MARGIN_S and cut["load_s"] <= load_timeout + MARGIN_S

    queued = fleet.requests(KILLED, "queued")
    assert {r["reason"] for r in queued} == {"UNAVAILABLE"}, queued
    assert all(r["recomputed_from"] == 0 and r["chunks_loaded"] == 0 for r in queued)
    assert max(r["load_s"] for r in queued) <= load_timeout + MARGIN_S

    after = fleet.requests(KILLED, "after")
    assert {(r["park_ok"], r["park_reason"], r["reason"]) for r in after} == {
        (False, "UNAVAILABLE", "NO_HANDLE")
    }, after
    assert max(r["park_s"] for r in after) <= park_timeout + MARGIN_S
    print(
        f"fleet: the load in flight ended {noticed * 1000:.1f} ms after the SIGKILL; held "
        f"handles fell back within {max(r['load_s'] for r in queued) * 1000:.1f} ms; parks "
        f"failed within {max(r['park_s'] for r in after) * 1000:.1f} ms (bound "
        f"{load_timeout + MARGIN_S:g} s)"
    )


@pytest.mark.compose
@pytest.mark.timeout(900)
def test_the_producer_died_of_sigkill_and_its_container_did_not(fleet: FleetRun) -> None:
    kill = fleet.run["kill"]
    assert kill["returncode"] == -9 and kill["exit"] == "killed by SIGKILL", kill
    assert not fleet.run["producers_at_end"][KILLED]["running"]
    log = fleet.logs[KILLED]
    assert f"producer pid {kill['pid']} ended as asked: killed by SIGKILL" in log, log
    # Only the producer process died: the node's container ran on until compose stopped the
    # stack, and then exited 0 (its worker stopped gracefully), never killed or OOM-killed.
    for service in SERVICES:
        state = fleet.states[service]
        assert state["ExitCode"] == 0 and not state["OOMKilled"], (service, state)
    # The parked KV died with it: the rest of the cut-off request could not be parked.
    assert fleet.run["rest_parks"][KILLED]["reason"] == "UNAVAILABLE"


@pytest.mark.compose
@pytest.mark.timeout(900)
def test_the_other_producer_kept_serving(fleet: FleetRun) -> None:
    start = fleet.run["producers_at_start"][SURVIVOR]
    end = fleet.run["producers_at_end"][SURVIVOR]
    assert end["running"] and end["pid"] == start["pid"]
    assert end["serving_epoch"] == start["epoch"] == start["serving_epoch"]
    assert {r["handle_epoch"] for r in fleet.requests(SURVIVOR)} == {start["epoch"]}
    # Parked into after the kill, loaded remote after it, and the held half of its streamed
    # request went in after the kill too.
    assert fleet.run["rest_parks"][SURVIVOR]["ok"]
    assert all(r["path"] == "remote" for r in fleet.requests(SURVIVOR, "after"))
    # It was alive to the end: compose's SIGTERM found it and it drained and exited 0.
    assert f"producer pid {start['pid']} stopped: exited 0" in fleet.logs[SURVIVOR]
    # And the decode workers kept working: both served requests after the kill.
    after = fleet.requests(SURVIVOR, "after") + fleet.requests(KILLED, "after")
    assert {r["worker"] for r in after} == {"decode-1", "decode-2"}


# ------------------------------------------------------------------------ the driver's judge
def _fleet_report() -> ModuleType:
    path = ROOT / "examples" / "fleet_report.py"
    spec = importlib.util.spec_from_file_location("fleet_report", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its dataclasses look their module up while being defined.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.compose
@pytest.mark.timeout(900)
def test_the_drivers_judge_fails_broken_runs(fleet: FleetRun) -> None:
    """The real run passes the driver's judge; each of these breakages of it fails it."""
    report = _fleet_report()

    def problems(change: Any) -> list[str]:
        run = copy.deepcopy(fleet.run)
        change(run)
        summary = {k: v for k, v in run.items() if k != "requests"}
        fields = {"request_id", "phase"} | set(report.Outcome.__dataclass_fields__)
        outcomes = []
        for r in run["requests"]:
            item = {k: v for k, v in r.items() if k in fields}
            item["problems"], item["fallback_s"] = [], None
            outcomes.append(report.Outcome(**item))
        return list(report.judge(summary, outcomes))

    def request(run: dict[str, Any], node: str, phase: str) -> dict[str, Any]:
        return next(r for r in run["requests"] if r["node"] == node and r["phase"] == phase)

    assert problems(lambda run: None) == []
    breakages = {
        "a survivor's request recomputed": lambda run: request(run, SURVIVOR, "after").update(
            path="recompute", reason="UNAVAILABLE"
        ),
        "a byte astray": lambda run: request(run, SURVIVOR, "queued").update(verified=False),
        "a lost request": lambda run: request(run, KILLED, "before").update(error="502"),
        "a slow fallback": lambda run: request(run, KILLED, "queued").update(load_s=99.0),
        "a timeout, not a noticed death": lambda run: request(run, KILLED, "queued").update(
            reason="TIMEOUT"
        ),
        "a producer that exited 0": lambda run: run["kill"].update(returncode=0),
        "a survivor restarted": lambda run: run["producers_at_end"][SURVIVOR].update(
            serving_epoch=1
        ),
        "a handle naming another producer": lambda run: request(run, SURVIVOR, "before").update(
            handle_producer="prefill-a:50051"
        ),
    }
    for name, change in breakages.items():
        assert problems(change), f"the judge passed a run with {name}"


# ----------------------------------------------------------------------- the file, statically
def _fleet_file() -> dict[str, Any]:
    return dict(yaml.safe_load(FLEET_FILE.read_text()))


def test_fleet_file_services_and_start_order() -> None:
    services = _fleet_file()["services"]
    assert set(services) == set(SERVICES)
    gates = {
        name: {dep: c["condition"] for dep, c in (s.get("depends_on") or {}).items()}
        for name, s in services.items()
    }
    assert gates["proxy"] == {s: "service_healthy" for s in (*NODES, "decode-1", "decode-2")}
    assert gates["driver"] == {"proxy": "service_healthy"}
    # Only prefill-a builds; everything else starts after its container, so compose builds
    # the image before any service looks for it.
    assert [n for n, s in services.items() if "build" in s] == [KILLED]
    for name in ("prefill-b", "decode-1", "decode-2"):
        assert gates[name] == {KILLED: "service_started"}
    for node in NODES:
        probe = " ".join(services[node]["healthcheck"]["test"])
        assert "python -m kvpark.producer.healthcheck" in probe
        assert services[node]["healthcheck"]["interval"] == "1s"
    assert services["driver"]["healthcheck"] == {"disable": True}


def test_fleet_file_producer_settings() -> None:
    """Known keys only, on the nodes only; each node advertises its compose name; the memory
    limit follows the sizing rule with room for the worker; the timeouts agree."""
    services = _fleet_file()["services"]
    known = {spec.env_var for spec in KEYS.values()}
    for name, service in services.items():
        env = service.get("environment") or {}
        keys = {k for k in env if k.startswith("KVPARK_")}
        if name in NODES:
            assert keys <= known, f"{name}: unknown producer keys {sorted(keys - known)}"
            assert env["KVPARK_ADVERTISE_ADDRESS"] == f"{name}:50051"
            pool_mib = parse_bytes("pool_bytes", env["KVPARK_POOL_BYTES"]) // MiB
            # About 1 KiB per remembered id (docs/deployment.md, "Sizing").
            tombstones_mib = -(-int(env["KVPARK_MAX_TOMBSTONES"]) // 1024)
            limit = re.fullmatch(r"(\d+)m", service["mem_limit"])
            assert limit, service["mem_limit"]
            assert int(limit.group(1)) >= pool_mib + 256 + tombstones_mib + WORKER_ALLOWANCE_MIB
            assert float(env["KVPARK_CONSUMER_LOAD_TIMEOUT_S"]) < float(
                env["KVPARK_TOMBSTONE_RETENTION_S"]
            )
        else:
            assert not keys, f"{name} is given producer variables"
    load_timeouts = {
        services["prefill-a"]["environment"]["KVPARK_CONSUMER_LOAD_TIMEOUT_S"],
        services["decode-1"]["environment"]["FLEET_LOAD_TIMEOUT_S"],
        services["decode-2"]["environment"]["FLEET_LOAD_TIMEOUT_S"],
        services["driver"]["environment"]["FLEET_LOAD_TIMEOUT_S"],
    }
    assert len(load_timeouts) == 1, load_timeouts
    park_timeouts = {services[n]["environment"]["FLEET_PARK_TIMEOUT_S"] for n in (*NODES, "driver")}
    assert len(park_timeouts) == 1, park_timeouts
    assert services["driver"]["environment"]["FLEET_KILL_NODE"] == KILLED


def test_fleet_command_is_the_documented_one() -> None:
    assert FLEET_COMMAND in FLEET_FILE.read_text()
    assert FLEET_COMMAND in (ROOT / "docs" / "deployment.md").read_text()


def test_fleet_tokens_are_demo_values_overridable() -> None:
    text = FLEET_FILE.read_text()
    tokens = set(re.findall(r"\$\{(DEMO_\w+_TOKEN):-([^}]+)\}", text))
    assert tokens == {
        ("DEMO_PARK_TOKEN", "demo-park-token-not-a-secret"),
        ("DEMO_FETCH_TOKEN", "demo-fetch-token-not-a-secret"),
    }
