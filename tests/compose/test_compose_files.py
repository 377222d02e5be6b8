"""Drift checks between the compose files, the producer's config keys and the README.

No Docker needed (not marked `compose`): these run everywhere. The producer rejects unknown
KVPARK_ variables, so a misspelt key in a compose file would only show up as a producer that
exits 2 at start; the demo workers read DEMO_* variables and must never be handed KVPARK_ ones.
"""

from __future__ import annotations

import json
import posixpath
import re
from pathlib import Path
from typing import Any

import yaml

from kvpark.producer.config import KEYS
from kvpark.producer.config_sources import CONFIG_ENV_VAR, load_config
from kvpark.producer.config_values import ConfigError
from kvpark.producer.memory_room import REMEMBERED_ID_BYTES

from .stack import DEMO_FILE, ROOT, TEST_FILE, TLS_FILE

COMPOSE_FILES = (DEMO_FILE, TLS_FILE, TEST_FILE)
MiB = 1024 * 1024
DEMO_COMMAND = "docker compose up --build --exit-code-from decode-worker"


def services(path: Path) -> dict[str, str]:
    """Service name -> its block of text (2-space indented YAML under `services:`)."""
    text = path.read_text()
    body = text.split("\nservices:\n", 1)[1]
    blocks: dict[str, str] = {}
    name = None
    for line in body.splitlines():
        if m := re.fullmatch(r"  ([a-z][a-z0-9-]*):", line):
            name = m.group(1)
            blocks[name] = ""
        elif name is not None and (line.startswith("    ") or not line.strip()):
            blocks[name] += line + "\n"
        elif line.strip() and not line.startswith(" "):
            name = None
    return blocks


def env_keys(block: str) -> set[str]:
    return set(re.findall(r"^\s+(KVPARK_[A-Z0-9_]+):", block, flags=re.M))


def test_producer_env_keys_are_config_keys() -> None:
    known = {spec.env_var for spec in KEYS.values()} | {CONFIG_ENV_VAR}
    for path in COMPOSE_FILES:
        keys = env_keys(services(path).get("producer", ""))
        assert keys, f"{path.name}: no KVPARK_ keys on the producer?"
        assert keys <= known, f"{path.name}: unknown producer keys {sorted(keys - known)}"


def test_workers_get_no_producer_variables() -> None:
    for path in COMPOSE_FILES:
        for name, block in services(path).items():
            if name != "producer":
                assert not env_keys(block), f"{path.name}: {name} is given KVPARK_ variables"


def test_demo_start_order_is_gated_on_health() -> None:
    """producer healthy -> decode worker healthy (its keep-alive runs) -> prefill worker."""
    demo = services(DEMO_FILE)
    gates = {
        name: re.findall(r"^      ([a-z-]+):\n        condition: (\S+)", block, re.M)
        for name, block in demo.items()
    }
    assert gates["decode-worker"] == [("producer", "service_healthy")]
    assert gates["prefill-worker"] == [
        ("producer", "service_healthy"),
        ("decode-worker", "service_healthy"),
    ]


def test_readme_and_compose_file_give_the_same_demo_command() -> None:
    # tests/test_docs_drift.py checks the service name; this checks the whole command.
    assert DEMO_COMMAND in (ROOT / "README.md").read_text()
    assert DEMO_COMMAND in DEMO_FILE.read_text()


def test_demo_producer_memory_limit_follows_the_sizing_rule() -> None:
    """README, "Memory": the container's limit is pool_bytes + 256 MiB + 1 KiB per
    max_tombstones (or more)."""
    block = services(DEMO_FILE)["producer"]
    [pool] = re.findall(r"KVPARK_POOL_BYTES: (\d+)MiB", block)
    [tombstones] = re.findall(r'KVPARK_MAX_TOMBSTONES: "(\d+)"', block)
    [limit] = re.findall(r"^    mem_limit: (\d+)m$", block, flags=re.M)
    assert int(limit) * MiB >= (int(pool) + 256) * MiB + int(tombstones) * REMEMBERED_ID_BYTES


def test_demo_producer_takes_its_addresses_from_the_environment() -> None:
    """The image's default command line sets --listen/--metrics-listen, which win over the
    environment: the demo's producer starts without flags, so its KVPARK_LISTEN is the address
    it serves and the one the health probe dials."""
    block = services(DEMO_FILE)["producer"]
    [command] = re.findall(r"^    command: (.*)$", block, flags=re.M)
    assert json.loads(command) == ["kvpark-producer"]
    assert "KVPARK_LISTEN: 0.0.0.0:50051" in block


def test_data_plane_wiring_of_the_demo() -> None:
    """The producer's shm socket lies on the `kvpark-shm` volume, mounted by the producer and
    the prefill worker at the same folder (so the path the producer advertises is the one the
    worker finds) and not by the decode worker (which must take the data port, as on another
    host); the data port is offered on the host the workers dial; each worker is told which
    transport to expect."""
    demo = yaml.safe_load(DEMO_FILE.read_text())
    tools = yaml.safe_load(TEST_FILE.read_text())["services"]
    assert "kvpark-shm" in demo["volumes"]
    services_ = demo["services"]
    env = services_["producer"]["environment"]
    socket = env["KVPARK_SHM_SOCKET"]
    folder = posixpath.dirname(socket)

    def shm_mounts(service: dict[str, Any]) -> list[str]:
        mounts = [str(m).split(":") for m in service.get("volumes", [])]
        return [m[1] for m in mounts if m[0] == "kvpark-shm"]

    assert shm_mounts(services_["producer"]) == [folder]
    assert shm_mounts(services_["prefill-worker"]) == [folder]
    assert shm_mounts(services_["decode-worker"]) == []
    assert env["KVPARK_DATA_LISTEN"] == "0.0.0.0:50052"
    for worker, transport in (("prefill-worker", "shm"), ("decode-worker", "tcp")):
        worker_env = services_[worker]["environment"]
        assert worker_env["DEMO_TARGET"] == env["KVPARK_ADVERTISE_ADDRESS"], worker
        assert worker_env["DEMO_EXPECT_TRANSPORT"] == transport, worker
    # The test suite's same-host tools share the volume too; its loader does not.
    assert shm_mounts(tools["same-host"]) == [folder]
    assert shm_mounts(tools["loader"]) == []


def test_producer_environment_is_a_valid_configuration() -> None:
    """Each way the compose files are combined gives the producer a configuration it accepts:
    every value parsed and every cross-key rule checked, as at its start (file keys only name
    files here; reading them comes later)."""
    for files in ((DEMO_FILE,), (DEMO_FILE, TEST_FILE), (DEMO_FILE, TLS_FILE, TEST_FILE)):
        env: dict[str, str] = {}
        for path in files:
            service = yaml.safe_load(path.read_text())["services"].get("producer", {})
            env.update(service.get("environment", {}))
        # ${VAR:-default} as compose expands it with VAR unset.
        env = {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}
        names = " + ".join(p.name for p in files)
        try:
            config = load_config([], env)
        except ConfigError as exc:
            raise AssertionError(f"{names}: the producer would exit 2: {exc}") from None
        assert config.data_listen and config.shm_socket and config.advertise_address, names
