"""Offline checks of the Kubernetes deployment and the Grafana dashboard (no cluster, no network).

`kubectl kustomize` builds deploy/kubernetes (and the Prometheus Operator overlay); every object
is validated strictly (unknown fields fail) against the Kubernetes API schemas that the
`kubernetes-validate` package ships. On top of the schema, the rules the producer and the
README depend on: the producer is a native sidecar, its memory limit covers the pool, the grace
period covers its drain, its probes speak the TLS it serves, secrets come from Secret volumes,
every KVPARK_ variable is a real key (a typo makes the producer exit 2), the NetworkPolicy lets
only decode pods reach the KV ports and only the monitoring namespace the metrics port, and
the dashboard queries only metrics that exist.

Without kubectl on PATH the manifest tests are skipped, except under CI=true, where they fail.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import posixpath
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from kvpark import ConsumerMetrics
from kvpark.address import Address
from kvpark.producer.config import KEYS
from kvpark.producer.config_sources import load_config
from kvpark.producer.config_values import ConfigError

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes"
PROMETHEUS_OVERLAY = ROOT / "deploy" / "overlays" / "prometheus-operator"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvpark-dashboard.json"
README = ROOT / "README.md"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"

# Schemas to validate against: 1.29 is the oldest release with native sidecars on by default
# (init containers with restartPolicy Always); 1.32 is the kubectl this project is tested with.
K8S_VERSIONS = ("1.29", "1.32")

# Keys a deployment must never set: token values belong in files (park_token_file, ...).
TOKEN_VALUE_KEYS = frozenset({"park_token", "fetch_token"})
DEFAULTS = {"max_tombstones": 1_000_000, "shutdown_grace_s": 10.0}


def client_metrics() -> tuple[frozenset[str], frozenset[str]]:
    """The consumer library's series as `ConsumerMetrics` exports them (decode side): every
    name, and those that are histograms."""
    registry = CollectorRegistry()
    ConsumerMetrics(registry)
    names, histograms = set(), set()
    for family in registry.collect():
        if family.type == "histogram":
            histograms.add(family.name)
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return frozenset(names), frozenset(histograms)


CLIENT_METRICS, CLIENT_HISTOGRAMS = client_metrics()

MiB = 1024 * 1024
# README: container memory limit = pool_bytes + 256 MiB + the remembered-id tables. The tables
# are bounded here at 1 KiB per max_tombstones (a tombstone and a KeepAlive intent for an id of
# up to 256 bytes come to ~0.9 KiB together by the README's measurements).
HEADROOM_BYTES = 256 * MiB
ID_TABLE_BYTES_PER_ENTRY = 1024
# The grace period must exceed the producer's preStop plus its drain by at least this much.
GRACE_MARGIN_S = 5

Obj = dict[str, Any]


# ----------------------------------------------------------------------------------- building
def kustomize(path: Path) -> list[Obj]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        message = f"kubectl is not on PATH: cannot build {path.relative_to(ROOT)}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " (CI=true: the CI machine needs kubectl; tested with v1.32)")
        pytest.skip(message + " (install kubectl to run the Kubernetes manifest tests)")
    proc = subprocess.run(
        [kubectl, "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    objects = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    assert objects, f"kubectl kustomize {path} printed no objects"
    return objects


@pytest.fixture(scope="module")
def base() -> list[Obj]:
    return kustomize(BASE)


@pytest.fixture(scope="module")
def prometheus_overlay() -> list[Obj]:
    return kustomize(PROMETHEUS_OVERLAY)


# ------------------------------------------------------------------------------------ helpers
def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def workloads(objects: list[Obj]) -> list[Obj]:
    kinds = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
    return [o for o in objects if o["kind"] in kinds]


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def pod_labels(workload: Obj) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def all_containers(spec: Obj) -> Iterator[Obj]:
    yield from spec.get("initContainers", [])
    yield from spec.get("containers", [])


def is_producer(container: Obj) -> bool:
    argv = [*container.get("command", []), *container.get("args", [])]
    return "kvpark-producer" in argv or argv[:3] == ["python", "-m", "kvpark.producer"]


def prefill(objects: list[Obj]) -> tuple[Obj, Obj]:
    """The workload that runs the producer, and the producer container."""
    found = [
        (w, c) for w in workloads(objects) for c in all_containers(pod_spec(w)) if is_producer(c)
    ]
    assert len(found) == 1, f"expected exactly one producer container, found {len(found)}"
    return found[0]


def env_of(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def key_value(container: Obj, key: str) -> str | None:
    entry = env_of(container).get(f"KVPARK_{key.upper()}")
    if entry is None:
        return None
    assert "value" in entry, f"KVPARK_{key.upper()} must be a literal value"
    value: str = entry["value"]
    return value


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels only) selects these labels."""
    assert not selector.get("matchExpressions"), "only matchLabels selectors are checked"
    match: dict[str, str] = selector.get("matchLabels", {})
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


_SIZE_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _SIZE_UNITS[f"{_p}b"] = 1000**_i
    _SIZE_UNITS[f"{_p}ib"] = 1024**_i


def parse_size(text: str) -> int:
    """A producer byte size ("4GiB", "512MiB", "1048576")."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)", text.strip())
    assert match and match.group(2).lower() in _SIZE_UNITS, f"unparsable byte size {text!r}"
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


_QUANTITY_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def parse_quantity(value: str | int) -> int:
    """A Kubernetes memory quantity ("4480Mi", "5G", 1073741824)."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([A-Za-z]*)", str(value))
    assert match and match.group(2) in _QUANTITY_UNITS, f"unparsable quantity {value!r}"
    return int(float(match.group(1)) * _QUANTITY_UNITS[match.group(2)])


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def volume_mounted_at(container: Obj, spec: Obj, path: str) -> tuple[Obj, str]:
    """The volume whose mount holds `path` in this container, and `path` relative to it."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    best: tuple[Obj, str] | None = None
    for mount in container.get("volumeMounts", []):
        root = mount["mountPath"].rstrip("/")
        if path.startswith(root + "/") and (best is None or len(root) > len(best[1])):
            best = (volumes[mount["name"]], root)
    assert best is not None, f"{path} is on no volume mounted in container {container['name']}"
    return best[0], posixpath.relpath(path, best[1])


def secret_key_for(volume: Obj, relative: str) -> tuple[str, str]:
    """(Secret name, key) behind a file of a Secret volume."""
    assert "secret" in volume, f"volume {volume['name']} is not a Secret volume"
    secret = volume["secret"]
    items = secret.get("items")
    key = relative
    if items:
        by_path = {item["path"]: item["key"] for item in items}
        assert relative in by_path, f"{relative} is not projected by volume {volume['name']}"
        key = by_path[relative]
    return secret["secretName"], key


def secret_keys(objects: list[Obj], name: str) -> set[str]:
    found = [s for s in of_kind(objects, "Secret") if s["metadata"]["name"] == name]
    assert found, f"no Secret {name} in the build"
    return set(found[0].get("data", {})) | set(found[0].get("stringData", {}))


# ------------------------------------------------------------------------ schema validation
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_base_validates_strictly_against_the_kubernetes_schemas(
    base: list[Obj], version: str
) -> None:
    failures = []
    for obj in base:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            failures.append(f"{name}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            failures.append(f"{name}: {exc.message} (custom resources belong in a component)")
    assert not failures, "\n".join(failures)


def test_strict_validation_rejects_a_misspelt_field(base: list[Obj]) -> None:
    # Guards the test above: a typo in a field name must not pass as an unknown extra.
    workload, producer = prefill(base)
    broken = copy.deepcopy(workload)
    for container in pod_spec(broken)["initContainers"]:
        if container["name"] == producer["name"]:
            container["restartPolicyy"] = container.pop("restartPolicy")
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicyy"):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_prometheus_overlay_adds_a_podmonitor_for_the_producers(
    base: list[Obj], prometheus_overlay: list[Obj]
) -> None:
    monitors = of_kind(prometheus_overlay, "PodMonitor")
    assert len(monitors) == 1
    monitor = monitors[0]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    workload, producer = prefill(prometheus_overlay)
    assert monitor["metadata"].get("namespace") == workload["metadata"].get("namespace")
    assert selects(monitor["spec"]["selector"], pod_labels(workload))
    port_names = {p["name"]: p["containerPort"] for p in producer.get("ports", [])}
    metrics_port = port_of(key_value(producer, "metrics_listen") or "")
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert port_names.get(endpoint["port"]) == metrics_port
    # Everything else is the base, unchanged.
    rest = [o for o in prometheus_overlay if o["kind"] != "PodMonitor"]
    assert sorted(rest, key=repr) == sorted(base, key=repr)
    assert not of_kind(base, "PodMonitor"), "the PodMonitor CRD must stay out of the base"


# ------------------------------------------------------------------------------- the producer
def test_producer_runs_as_a_native_sidecar_of_the_engine(base: list[Obj]) -> None:
    workload, producer = prefill(base)
    spec = pod_spec(workload)
    assert producer in spec.get("initContainers", []), "the producer must be an init container"
    assert producer.get("restartPolicy") == "Always", (
        "a native sidecar is an init container with restartPolicy: Always"
    )
    assert spec["containers"], "the pod needs its engine as a main container"
    assert not any(is_producer(c) for c in spec["containers"])
    assert producer["image"].startswith("kvpark:") or "/kvpark:" in producer["image"]
    # The image's default command line sets --listen/--metrics-listen, which would override
    # the environment; the manifest must start the producer with the environment only.
    assert producer.get("command") == ["kvpark-producer"] and not producer.get("args")


def test_every_kvpark_variable_is_a_producer_key(base: list[Obj]) -> None:
    known = frozenset(KEYS) - TOKEN_VALUE_KEYS
    unknown = []
    for workload in workloads(base):
        for container in all_containers(pod_spec(workload)):
            assert not container.get("envFrom"), "envFrom would hide which KVPARK_ keys are set"
            for name in env_of(container):
                key = name.removeprefix("KVPARK_").lower()
                if name.startswith("KVPARK_") and key not in known:
                    unknown.append(f"{container['name']}: {name}")
    assert not unknown, f"not producer keys (the producer would exit 2): {unknown}"


def test_env_references_are_defined_before_use(base: list[Obj]) -> None:
    # $(VAR) expands only variables defined earlier in the same list; otherwise the producer
    # would get the literal text "$(POD_IP):50051".
    for workload in workloads(base):
        for container in all_containers(pod_spec(workload)):
            defined: set[str] = set()
            for entry in container.get("env", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", entry.get("value", "")):
                    assert ref in defined, f"{container['name']}: {entry['name']} uses $({ref})"
                defined.add(entry["name"])


def test_producer_advertises_its_pod_ip_and_logs_json(base: list[Obj]) -> None:
    _, producer = prefill(base)
    env = env_of(producer)
    advertise = key_value(producer, "advertise_address") or ""
    refs = re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", advertise)
    assert refs, "advertise_address must come from the downward API, e.g. $(POD_IP):50051"
    for ref in refs:
        assert env[ref]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert port_of(advertise) == port_of(key_value(producer, "listen") or "")
    assert key_value(producer, "log_format") == "json"


def producer_environment(producer: Obj) -> dict[str, str]:
    """The producer's KVPARK_ variables as the kubelet hands them over: $(VAR) references to
    earlier variables expanded, the downward API's pod IP stood in for by a documentation
    address."""
    values: dict[str, str] = {}
    for entry in producer.get("env", []):
        if "value" in entry:
            values[entry["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: values[m.group(1)], entry["value"]
            )
        elif entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            values[entry["name"]] = "192.0.2.10"
    return {k: v for k, v in values.items() if k.startswith("KVPARK_")}


def test_producer_environment_is_a_valid_configuration(base: list[Obj]) -> None:
    """What the producer itself would do at start: every value parsed and every cross-key
    rule checked (the file keys only name files; reading them comes later)."""
    _, producer = prefill(base)
    try:
        config = load_config([], producer_environment(producer))
    except ConfigError as exc:
        pytest.fail(f"the producer would exit 2: {exc}")
    assert config.advertise_address == "192.0.2.10:50051"
    assert config.data_listen and config.shm_socket


def test_park_idle_and_delivery_grace_are_chosen_and_consistent(base: list[Obj]) -> None:
    """Both are set in the manifest (the deployment's choice, commented there), and a decode
    worker that retries a delivery within its own load timeout still finds the bytes."""
    _, producer = prefill(base)
    for key in ("park_idle_timeout_s", "delivery_grace_s"):
        assert key_value(producer, key) is not None, f"set {key} explicitly"
    config = load_config([], producer_environment(producer))
    assert config.delivery_grace_s >= config.consumer_load_timeout_s, (
        f"delivery_grace_s {config.delivery_grace_s:g} s < consumer_load_timeout_s "
        f"{config.consumer_load_timeout_s:g} s: a retried load could find its bytes gone"
    )


def test_memory_limit_covers_pool_and_id_tables(base: list[Obj]) -> None:
    _, producer = prefill(base)
    pool = parse_size(key_value(producer, "pool_bytes") or "1GiB")
    tombstones = int(key_value(producer, "max_tombstones") or DEFAULTS["max_tombstones"])
    resources = producer["resources"]
    limit = parse_quantity(resources["limits"]["memory"])
    request = parse_quantity(resources["requests"]["memory"])
    assert request == limit, "memory request = limit: the whole pool is allocated at start"
    assert limit >= pool + HEADROOM_BYTES, (
        f"memory limit {limit / MiB:.0f} MiB < pool_bytes {pool / MiB:.0f} MiB + 256 MiB"
    )
    need = pool + HEADROOM_BYTES + tombstones * ID_TABLE_BYTES_PER_ENTRY
    assert limit >= need, (
        f"memory limit {limit / MiB:.0f} MiB < pool + 256 MiB + {tombstones} remembered ids "
        f"({need / MiB:.0f} MiB): raise the limit or lower max_tombstones"
    )


def test_grace_period_covers_the_producers_drain(base: list[Obj]) -> None:
    workload, producer = prefill(base)
    grace = pod_spec(workload)["terminationGracePeriodSeconds"]
    shutdown_grace = float(key_value(producer, "shutdown_grace_s") or DEFAULTS["shutdown_grace_s"])
    pre_stop = producer.get("lifecycle", {}).get("preStop", {})
    pre_stop_s = 0.0
    if "sleep" in pre_stop:
        pre_stop_s = float(pre_stop["sleep"]["seconds"])
    elif "exec" in pre_stop:
        argv = pre_stop["exec"]["command"]
        assert argv[0] == "sleep" and len(argv) == 2, f"preStop is not a plain sleep: {argv}"
        pre_stop_s = float(argv[1])
    assert pre_stop, "the producer needs a preStop (keeps serving after the engine stopped)"
    assert grace > shutdown_grace, "terminationGracePeriodSeconds <= shutdown_grace_s"
    assert grace >= pre_stop_s + shutdown_grace + GRACE_MARGIN_S, (
        f"terminationGracePeriodSeconds {grace} < preStop {pre_stop_s:g} s + shutdown_grace_s "
        f"{shutdown_grace:g} s + {GRACE_MARGIN_S} s margin: the drain would be SIGKILLed"
    )


def _dials_the_health_port(producer: Obj, flags: dict[str, str]) -> bool:
    """The health check without --target dials KVPARK_HEALTH_LISTEN when that is set."""
    return "--target" not in flags and bool(key_value(producer, "health_listen"))


def test_probes_run_the_health_check_over_the_producers_tls(base: list[Obj]) -> None:
    workload, producer = prefill(base)
    spec = pod_spec(workload)
    serves_tls = key_value(producer, "tls_cert_file") is not None
    requires_client_cert = key_value(producer, "tls_client_ca_file") is not None
    for kind in ("readinessProbe", "startupProbe"):
        probe = producer.get(kind)
        assert probe, f"the producer needs a {kind}"
        if "grpc" in probe:
            assert not serves_tls, f"{kind}: native grpc probes cannot speak TLS"
            assert probe["grpc"]["port"] == port_of(key_value(producer, "listen") or "")
            continue
        argv = probe["exec"]["command"]
        assert argv[:3] == ["python", "-m", "kvpark.producer.healthcheck"], argv
        flags = dict(zip(argv[3::2], argv[4::2], strict=False))
        assert not _dials_the_health_port(producer, flags), (
            f"{kind}: would dial the plaintext health port, not the TLS gRPC port"
        )
        if "--target" in flags:
            assert port_of(flags["--target"]) == port_of(key_value(producer, "listen") or "")
        assert float(flags.get("--timeout", 2)) < probe.get("timeoutSeconds", 1), (
            f"{kind}: the check's --timeout must end before the probe's timeoutSeconds"
        )
        if requires_client_cert:
            assert "--client-cert" in flags and "--client-key" in flags, (
                f"{kind}: the producer requires client certificates (mTLS)"
            )
        for flag in ("--ca-file", "--client-cert", "--client-key"):
            if flag in flags:
                volume, relative = volume_mounted_at(producer, spec, flags[flag])
                name, key = secret_key_for(volume, relative)
                assert key in secret_keys(base, name), f"{kind}: {flag} {flags[flag]} is missing"


def test_liveness_dials_the_health_port_outside_the_connection_cap(base: list[Obj]) -> None:
    """grpc counts a probe's connection against max_connections: through the gRPC port, a
    producer with every connection taken would fail liveness and be restarted, losing every
    parked request. The health port has connections of its own."""
    _, producer = prefill(base)
    health_listen = key_value(producer, "health_listen")
    assert health_listen, "the producer needs KVPARK_HEALTH_LISTEN for its liveness probe"
    assert Address.parse(health_listen).is_loopback
    probe = producer["livenessProbe"]
    argv = probe["exec"]["command"]
    assert argv[:3] == ["python", "-m", "kvpark.producer.healthcheck"], argv
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert _dials_the_health_port(producer, flags), argv
    # The health port is plaintext: the check refuses TLS options without --target.
    assert not {"--tls", "--ca-file", "--client-cert", "--client-key", "--server-name"} & set(
        flags
    ), argv
    assert float(flags.get("--timeout", 2)) < probe.get("timeoutSeconds", 1)


def test_tokens_and_tls_files_come_from_secret_volumes(base: list[Obj]) -> None:
    workload, producer = prefill(base)
    spec = pod_spec(workload)
    env = env_of(producer)
    for name in ("KVPARK_PARK_TOKEN", "KVPARK_FETCH_TOKEN"):
        assert name not in env, f"{name} would put a token in the pod spec: use {name}_FILE"
    file_keys = ["park_token_file", "fetch_token_file", "tls_cert_file", "tls_key_file"]
    file_keys += ["tls_client_ca_file"]
    for key in file_keys:
        path = key_value(producer, key)
        assert path, f"{key} must be set (tokens and TLS protect the KV path)"
        volume, relative = volume_mounted_at(producer, spec, path)
        secret_name, secret_key = secret_key_for(volume, relative)
        assert secret_key in secret_keys(base, secret_name), f"{key}: {path} is not in the Secret"


def test_no_secret_value_is_written_into_a_pod_spec(base: list[Obj]) -> None:
    sensitive = re.compile(r"TOKEN|PASSWORD|SECRET|PRIVATE|(^|_)KEY$")
    for workload in workloads(base):
        spec = pod_spec(workload)
        for container in all_containers(spec):
            for entry in container.get("env", []):
                name = entry["name"]
                if not sensitive.search(name) or "value" not in entry:
                    continue
                # A literal may only name a file on a Secret volume (e.g. a TLS key's path).
                value = entry["value"]
                assert value.startswith("/"), (
                    f"{container['name']}: {name} holds a literal; take it from a Secret"
                )
                volume, relative = volume_mounted_at(container, spec, value)
                secret_name, key = secret_key_for(volume, relative)
                assert key in secret_keys(base, secret_name), f"{name}: {value} is missing"


def test_shipped_secrets_are_placeholders(base: list[Obj]) -> None:
    secrets = of_kind(base, "Secret")
    assert secrets
    for secret in secrets:
        for key, encoded in secret.get("data", {}).items():
            value = base64.b64decode(encoded).decode()
            assert "REPLACE-ME" in value, f"{secret['metadata']['name']}/{key} is not a placeholder"
    for path in (ROOT / "deploy").rglob("*"):
        if path.is_file():
            assert "PRIVATE KEY-----" not in path.read_text(errors="replace"), path


def test_shm_socket_directory_is_shared_with_the_engine(base: list[Obj]) -> None:
    workload, producer = prefill(base)
    spec = pod_spec(workload)
    socket = key_value(producer, "shm_socket")
    assert socket, "shm_socket must be set for the engine's shared-memory path"
    volume, _ = volume_mounted_at(producer, spec, socket)
    assert "emptyDir" in volume
    engines = [
        c
        for c in spec["containers"]
        if any(m["name"] == volume["name"] for m in c.get("volumeMounts", []))
    ]
    assert engines, f"no engine container mounts {volume['name']} ({socket})"
    for engine in engines:
        assert volume_mounted_at(engine, spec, socket)[0] == volume


def test_ports_agree_between_config_container_and_service(base: list[Obj]) -> None:
    workload, producer = prefill(base)
    wanted = {
        port_of(key_value(producer, key) or "")
        for key in ("listen", "data_listen", "metrics_listen")
    }
    assert wanted == {50051, 50052, 9400}
    assert {p["containerPort"] for p in producer["ports"]} >= wanted
    services = [
        s
        for s in of_kind(base, "Service")
        if selects({"matchLabels": s["spec"].get("selector", {})}, pod_labels(workload))
    ]
    assert services, "no Service selects the prefill pods"
    assert {p["targetPort"] for p in services[0]["spec"]["ports"]} >= wanted
    annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true"
    assert int(annotations["prometheus.io/port"]) == port_of(
        key_value(producer, "metrics_listen") or ""
    )


def test_pods_run_restricted(base: list[Obj]) -> None:
    for workload in workloads(base):
        spec = pod_spec(workload)
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True
        assert pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault"
        for container in all_containers(spec):
            sc = container.get("securityContext", {})
            where = f"{workload['metadata']['name']}/{container['name']}"
            assert sc.get("runAsUser", pod_sc.get("runAsUser")) == 10001, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert not sc.get("privileged"), where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not sc.get("capabilities", {}).get("add"), where


def test_prefill_pods_roll_and_drain_one_at_a_time(base: list[Obj]) -> None:
    workload, _ = prefill(base)
    rolling = workload["spec"].get("strategy", {}).get("rollingUpdate", {})
    surge, unavailable = rolling.get("maxSurge"), rolling.get("maxUnavailable")
    assert isinstance(surge, int) and isinstance(unavailable, int)
    assert sorted((surge, unavailable)) == [0, 1], "replace one prefill pod at a time"
    budgets = [
        p
        for p in of_kind(base, "PodDisruptionBudget")
        if selects(p["spec"]["selector"], pod_labels(workload))
    ]
    assert len(budgets) == 1, "one PodDisruptionBudget must cover the prefill pods"
    assert budgets[0]["spec"].get("maxUnavailable") == 1


# ------------------------------------------------------------------------------ NetworkPolicy
DECODE = {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "decode"}}}
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def test_network_policy_admits_decode_to_kv_ports_and_monitoring_to_metrics(
    base: list[Obj],
) -> None:
    workload, producer = prefill(base)
    named = {
        p["name"]: p["containerPort"]
        for c in all_containers(pod_spec(workload))
        for p in c.get("ports", [])
    }
    kv_ports = {port_of(key_value(producer, k) or "") for k in ("listen", "data_listen")}
    metrics_port = port_of(key_value(producer, "metrics_listen") or "")
    policies = [
        p
        for p in of_kind(base, "NetworkPolicy")
        if selects(p["spec"]["podSelector"], pod_labels(workload))
    ]
    assert policies, "no NetworkPolicy selects the prefill pods"
    admitted: dict[int, list[Obj]] = {}
    for policy in policies:
        assert "Ingress" in policy["spec"].get("policyTypes", ["Ingress"])
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("from"), "a rule without `from` admits every source"
            assert rule.get("ports"), "a rule without `ports` admits every port"
            for port in rule["ports"]:
                assert port.get("protocol", "TCP") == "TCP"
                first = named.get(port["port"], port["port"])
                last = port.get("endPort", first)
                for number in range(first, last + 1):
                    admitted.setdefault(number, []).extend(rule["from"])
    for number in kv_ports:
        assert admitted.get(number), f"decode pods cannot reach port {number}"
        assert all(peer == DECODE for peer in admitted[number]), (
            f"port {number} admits more than decode pods: {admitted[number]}"
        )
    assert admitted.get(metrics_port), "Prometheus cannot reach the metrics port"
    assert all(peer == MONITORING for peer in admitted[metrics_port]), (
        f"metrics port admits more than the monitoring namespace: {admitted[metrics_port]}"
    )


# ------------------------------------------------------------------------------------ Grafana
def readme_metrics() -> tuple[set[str], set[str]]:
    """(every producer metric name in README's Metrics section, the histograms among them)."""
    section = README.read_text().split("### Metrics", 1)[1].split("\n## ", 1)[0]
    names = set(re.findall(r"`((?:kvpark|process)_[a-z_]+)", section))
    match = re.search(r"histograms\s+(.*?)\(", section, flags=re.S)
    assert match, "README's Metrics section no longer names its histograms"
    histograms = set(re.findall(r"`([a-z_]+)`", match.group(1)))
    assert histograms and histograms <= names
    return names, histograms


def dashboard_exprs(dashboard: Obj) -> list[str]:
    exprs = []

    def walk(panels: list[Obj]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            exprs.extend(t["expr"] for t in panel.get("targets", []))

    walk(dashboard["panels"])
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        if variable.get("type") == "query":
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:kvpark|process)_[a-z0-9_]+)", expr))


def test_dashboard_uses_a_templated_prometheus_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = []

    def walk(panels: list[Obj]) -> None:
        for panel in panels:
            ids.append(panel["id"])
            walk(panel.get("panels", []))
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            assert panel["targets"], f"panel {panel['title']!r} has no query"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
                assert metric_names(target["expr"]), f"{panel['title']!r}: {target['expr']}"

    walk(dashboard["panels"])
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_dashboard_queries_only_metrics_that_exist() -> None:
    producer, producer_histograms = readme_metrics()
    known = producer | CLIENT_METRICS
    histograms = producer_histograms | CLIENT_HISTOGRAMS
    for suffix in ("_bucket", "_sum", "_count"):
        known |= {h + suffix for h in histograms}
    used = set().union(*map(metric_names, dashboard_exprs(json.loads(DASHBOARD.read_text()))))
    assert used <= known, f"the dashboard queries unknown metrics: {sorted(used - known)}"


def test_dashboard_covers_producer_and_consumer_metrics() -> None:
    used = set().union(*map(metric_names, dashboard_exprs(json.loads(DASHBOARD.read_text()))))
    used |= {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
    wanted = {
        "kvpark_pool_bytes",
        "kvpark_pool_used_bytes",
        "kvpark_pool_stored_bytes",
        "kvpark_pool_reserved_bytes",
        "kvpark_parked_ids",
        "kvpark_bound_ids",
        "kvpark_tombstones",
        "kvpark_park_total",
        "kvpark_fetch_total",
        "kvpark_late_fetch_rejections_total",
        "kvpark_late_park_rejections_total",
        "kvpark_reaped_total",
        "kvpark_fetch_duration_seconds",
        "kvpark_time_to_fetch_seconds",
        "process_resident_memory_bytes",
    } | CLIENT_METRICS
    assert wanted <= used, f"no panel shows {sorted(wanted - used)}"


def test_dashboard_panels_sit_under_the_row_of_their_side() -> None:
    """A panel of the decode workers' series (kvpark_client_*) sits under the consumers' row,
    a panel of the producers' series under a producer row: an operator reads a row as one
    side's story."""
    dashboard = json.loads(DASHBOARD.read_text())
    row = ""
    for panel in sorted(dashboard["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"])):
        if panel["type"] == "row":
            row = panel["title"]
            continue
        names = set().union(*(metric_names(t["expr"]) for t in panel["targets"]))
        client = {name.startswith("kvpark_client_") for name in names}
        assert len(client) == 1, f"{panel['title']!r} mixes producer and consumer series"
        side = "Consumers" if client == {True} else "Producer"
        assert row.startswith(side), f"{panel['title']!r} sits under {row!r}"


# --------------------------------------------------------------------------------------- docs
def test_deployment_doc_names_every_manifest() -> None:
    doc = DEPLOYMENT_DOC.read_text()
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert resource in doc, f"docs/deployment.md does not explain {resource}"
    assert "kubectl apply -k deploy/kubernetes" in doc
