"""Tests of producer_service.config: parsing, validation, sources and their precedence, and the
drift between config fields, KEYS, CLI flags and the spec's table of keys."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tls_certs import make_certs

from kvpark.address import Address
from kvpark.durations import MAX_SECONDS
from kvpark.producer.config import KEYS, MIN_REAP_INTERVAL_S, ProducerConfig
from kvpark.producer.config_sources import CONFIG_ENV_VAR, build_arg_parser, load_config
from kvpark.producer.config_values import ConfigError
from kvpark.producer.credentials import load_credentials

SECONDS_KEYS = [name for name, spec in KEYS.items() if spec.metavar == "SECONDS"]


def write_json(path: Path, data: object) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def secret_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- defaults -----------------------------------------------------------------------------


def test_defaults_are_valid_and_match_the_spec() -> None:
    cfg = ProducerConfig()
    assert cfg == load_config([], {})
    assert cfg.listen == "127.0.0.1:50051"
    assert cfg.metrics_listen == "127.0.0.1:9400"
    assert cfg.pool_bytes == 1024**3
    assert cfg.max_chunk_bytes == 16 * 1024**2
    assert (cfg.unbound_store_timeout_s, cfg.tombstone_retention_s) == (60.0, 60.0)
    assert (cfg.consumer_load_timeout_s, cfg.max_lease_s, cfg.max_fetch_wait_s) == (30, 600, 30)
    assert (cfg.max_tombstones, cfg.reap_interval_s, cfg.shutdown_grace_s) == (1_000_000, 0.25, 10)
    assert (cfg.log_level, cfg.log_format) == ("info", "text")
    assert cfg.tls_cert_file is cfg.tls_key_file is cfg.tls_client_ca_file is None
    credentials = load_credentials(cfg)
    assert credentials.park_token is None and credentials.fetch_token is None
    assert cfg.allow_insecure is False
    assert not cfg.is_insecure_exposed and cfg.listen_is_loopback and not cfg.tls_enabled
    assert cfg.metrics_address == Address("127.0.0.1", 9400)


def test_config_is_frozen_and_replace_revalidates() -> None:
    cfg = ProducerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.listen = "0.0.0.0:1"  # type: ignore[misc]
    assert cfg.replace(pool_bytes="2GiB").pool_bytes == 2 * 1024**3
    assert dataclasses.replace(cfg, max_lease_s="900").max_lease_s == 900.0  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^pool_bytes: .*got 'lots'$"):
        cfg.replace(pool_bytes="lots")
    with pytest.raises(ConfigError, match=r"^max_lease_s: .*got -1$"):
        dataclasses.replace(cfg, max_lease_s=-1)
    with pytest.raises(
        ConfigError, match=r"unknown key 'pool_byte' \(did you mean 'pool_bytes'\?\)"
    ):
        cfg.replace(pool_byte=1)


# --- precedence ---------------------------------------------------------------------------


def test_precedence_defaults_file_env_cli(tmp_path: Path) -> None:
    key, env = "unbound_store_timeout_s", {"KVPARK_UNBOUND_STORE_TIMEOUT_S": "120"}
    path = write_json(tmp_path / "c.json", {key: 90})
    flag = ["--unbound-store-timeout-s", "150"]
    assert load_config([], {}).unbound_store_timeout_s == 60.0
    assert load_config(["--config", path], {}).unbound_store_timeout_s == 90.0
    assert load_config(["--config", path], env).unbound_store_timeout_s == 120.0
    assert load_config(["--config", path, *flag], env).unbound_store_timeout_s == 150.0
    assert load_config(["--config", path, *flag], {}).unbound_store_timeout_s == 150.0
    # Keys a higher source does not name keep the lower source's value.
    both = write_json(tmp_path / "d.json", {key: 90, "max_tombstones": 5})
    cfg = load_config(["--config", both], env)
    assert (cfg.unbound_store_timeout_s, cfg.max_tombstones) == (120.0, 5)


def test_config_file_from_environment_and_cli_overrides_it(tmp_path: Path) -> None:
    env_file = write_json(tmp_path / "env.json", {"max_tombstones": 7})
    cli_file = write_json(tmp_path / "cli.json", {"max_tombstones": 8})
    assert load_config([], {CONFIG_ENV_VAR: env_file}).max_tombstones == 7
    assert load_config(["--config", cli_file], {CONFIG_ENV_VAR: env_file}).max_tombstones == 8
    with pytest.raises(ConfigError, match=r"^config: expected a path"):
        load_config([], {CONFIG_ENV_VAR: ""})


def test_quoted_180_accepted_from_every_source(tmp_path: Path) -> None:
    key = "unbound_store_timeout_s"
    path = write_json(tmp_path / "c.json", {key: "180"})
    assert load_config(["--config", path], {}).unbound_store_timeout_s == 180.0
    assert load_config([], {"KVPARK_UNBOUND_STORE_TIMEOUT_S": "180"}).unbound_store_timeout_s == 180
    assert load_config([f"--{key.replace('_', '-')}=180"], {}).unbound_store_timeout_s == 180.0
    assert ProducerConfig.from_mapping({key: "180"}).unbound_store_timeout_s == 180.0


# --- seconds ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [180, 2.5, " 2.5 ", "180", "1e2", 0.001, MAX_SECONDS])
def test_seconds_accepted(value: object) -> None:
    cfg = ProducerConfig.from_mapping({"max_fetch_wait_s": value})
    assert cfg.max_fetch_wait_s == float(value)  # type: ignore[arg-type]
    assert type(cfg.max_fetch_wait_s) is float


BAD_SECONDS: list[object] = [
    "abc", True, False, 0, -1, math.nan, math.inf, -math.inf, None, MAX_SECONDS + 1,
    "", "nan", "inf", "0", "-5", [60], "60s", 10**400,
]  # fmt: skip


@pytest.mark.parametrize("key", SECONDS_KEYS)
@pytest.mark.parametrize("value", BAD_SECONDS, ids=repr)
def test_bad_seconds_rejected_naming_key_and_repr(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        ProducerConfig.from_mapping({key: value})
    message = str(info.value)
    low = f">= {MIN_REAP_INTERVAL_S}" if key == "reap_interval_s" else "> 0"
    assert message.startswith(
        f"{key}: expected seconds {low} and <= {MAX_SECONDS} (one week), got "
    )
    assert repr(value)[:100] in message
    assert info.value.keys == (key,)


def test_bad_seconds_message_matches_the_documented_example() -> None:
    with pytest.raises(ConfigError) as info:
        ProducerConfig.from_mapping({"unbound_store_timeout_s": "abc"})
    assert str(info.value) == (
        "unbound_store_timeout_s: expected seconds > 0 and <= 604800 (one week), got 'abc'"
    )


@pytest.mark.parametrize(
    ("json_text", "shown"),
    [("true", "True"), ("null", "None"), ("NaN", "nan"), ("Infinity", "inf"), ('"abc"', "'abc'")],
)
def test_json_literals_reach_validation_and_are_rejected(
    tmp_path: Path, json_text: str, shown: str
) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"tombstone_retention_s": ' + json_text + "}")
    with pytest.raises(ConfigError) as info:
        load_config(["--config", str(path)], {})
    assert str(info.value).startswith("tombstone_retention_s: expected seconds")
    assert f"got {shown} (from config file {str(path)!r})" in str(info.value)


@pytest.mark.parametrize("value", ["abc", "nan", "0", "604801", "true", ""])
def test_bad_seconds_from_env_and_cli_name_the_source(value: str) -> None:
    with pytest.raises(ConfigError) as env_error:
        load_config([], {"KVPARK_MAX_LEASE_S": value})
    assert str(env_error.value) == (
        f"max_lease_s: expected seconds > 0 and <= 604800 (one week), got {value!r}"
        " (from environment KVPARK_MAX_LEASE_S)"
    )
    with pytest.raises(ConfigError) as cli_error:
        load_config([f"--max-lease-s={value}"], {})
    assert str(cli_error.value).endswith(f"got {value!r} (from command line --max-lease-s)")


@given(st.floats(min_value=1e-6, max_value=MAX_SECONDS, allow_nan=False))
def test_any_seconds_in_range_round_trips_through_its_string(seconds: float) -> None:
    cfg = ProducerConfig.from_mapping({"shutdown_grace_s": repr(seconds)})
    assert cfg.shutdown_grace_s == seconds


@pytest.mark.parametrize("value", [1e-6, "0.001", 0.0099])
def test_reap_interval_has_a_floor(value: object) -> None:
    """A reaper that wakes a million times a second keeps an idle producer's core busy."""
    with pytest.raises(ConfigError) as info:
        ProducerConfig.from_mapping({"reap_interval_s": value})
    assert str(info.value) == (
        f"reap_interval_s: expected seconds >= 0.01 and <= 604800 (one week), got {value!r}"
    )
    assert info.value.keys == ("reap_interval_s",)
    assert ProducerConfig.from_mapping({"reap_interval_s": 0.01}).reap_interval_s == 0.01


# --- byte sizes and counts ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1048576, 1048576),
        ("1048576", 1048576),
        (" 1048576 ", 1048576),
        (1073741824.0, 1073741824),
        ("512MiB", 512 * 1024**2),
        ("4GiB", 4 * 1024**3),
        ("4gib", 4 * 1024**3),
        ("4Gi", 4 * 1024**3),
        ("64 KiB", 64 * 1024),
        ("1GB", 10**9),
        ("1gb", 10**9),
        ("1kB", 1000),
        ("2TB", 2 * 10**12),
        ("1TiB", 1024**4),
        ("100B", 100),
        ("100b", 100),
        ("1.5GiB", 1536 * 1024**2),
        ("0.5KiB", 512),
    ],
)
def test_byte_sizes_accepted(value: object, expected: int) -> None:
    # The key's own parser: a whole config also needs a pool of at least one page.
    assert KEYS["pool_bytes"].parse("pool_bytes", value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "abc", "", "0", 0, -1, "-1MiB", "1.5", "0.3B", "1.5B", 1.5, math.nan, math.inf,
        True, None, "4G", "4K", "4 GiBs", "1e9", "GiB", [1], 2**63, "0x10",
    ],
    ids=repr,
)  # fmt: skip
def test_byte_sizes_rejected(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        ProducerConfig.from_mapping({"pool_bytes": value})
    assert str(info.value).startswith("pool_bytes: expected a byte size > 0")
    assert str(info.value).endswith(f"got {value!r}")


@given(st.integers(min_value=1, max_value=2**20), st.sampled_from(["KiB", "MiB", "kB", "MB"]))
def test_byte_size_units(number: int, unit: str) -> None:
    scale = {"KiB": 1024, "MiB": 1024**2, "kB": 1000, "MB": 1000**2}[unit]
    assert KEYS["pool_bytes"].parse("pool_bytes", f"{number}{unit}") == number * scale


@pytest.mark.parametrize(("value", "expected"), [(5, 5), ("5", 5), (" 12 ", 12), (1e6, 10**6)])
def test_counts_accepted(value: object, expected: int) -> None:
    assert ProducerConfig.from_mapping({"max_tombstones": value}).max_tombstones == expected


@pytest.mark.parametrize(
    "value",
    [0, -3, "0", "-3", "1.5", 1.5, "abc", True, None, "1e6", "", "\u0661\u0662", 2**31, "9" * 20],
)
def test_counts_rejected(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^max_tombstones: expected a whole number > 0 and "):
        ProducerConfig.from_mapping({"max_tombstones": value})


# --- choices, booleans, addresses ---------------------------------------------------------


def test_log_level_and_format() -> None:
    cfg = ProducerConfig.from_mapping({"log_level": " DEBUG ", "log_format": "json"})
    assert (cfg.log_level, cfg.log_format) == ("debug", "json")
    with pytest.raises(ConfigError, match=r"^log_level: expected one of debug, .*got 'trace'$"):
        ProducerConfig.from_mapping({"log_level": "trace"})
    with pytest.raises(ConfigError, match=r"^log_format: expected one of text, json, got 1$"):
        ProducerConfig.from_mapping({"log_format": 1})


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), ("true", True), ("FALSE", False), ("1", True), ("0", False),
     ("yes", True), (" No ", False)],
)  # fmt: skip
def test_allow_insecure_accepts_bools_and_their_strings(value: object, expected: bool) -> None:
    assert ProducerConfig.from_mapping({"allow_insecure": value}).allow_insecure is expected


@pytest.mark.parametrize("value", [1, 0, "on", "", None, "maybe"])
def test_allow_insecure_rejects_everything_else(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^allow_insecure: expected true or false"):
        ProducerConfig.from_mapping({"allow_insecure": value})


def test_allow_insecure_flag_without_value_means_true() -> None:
    assert load_config(["--allow-insecure"], {}).allow_insecure is True
    assert load_config(["--allow-insecure", "false"], {}).allow_insecure is False


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1:50051", "localhost:0", "[::1]:50051", "[::]:65535", "my-host.example:80",
     " 127.0.0.1:1 "],
)  # fmt: skip
def test_addresses_accepted(address: str) -> None:
    cfg = ProducerConfig.from_mapping({"listen": address, "allow_insecure": True})
    assert cfg.listen == address.strip()


BAD_ADDRESSES: list[object] = [
    "127.0.0.1", "127.0.0.1:65536", "127.0.0.1:-1", ":50051", "::1:50051", "[nothost]:1",
    "999.0.0.1:80", "host:port", "host :1", "", 50051, None, "unix:/tmp/sock", "[::1]",
    "127.0.0.1:\u0665\u0660",
]  # fmt: skip


@pytest.mark.parametrize(
    ("key", "address"),
    [("listen", address) for address in BAD_ADDRESSES]
    # An empty metrics_listen is valid: it disables the metrics endpoint.
    + [("metrics_listen", address) for address in BAD_ADDRESSES if address != ""],
    ids=repr,
)
def test_addresses_rejected(key: str, address: object) -> None:
    with pytest.raises(ConfigError) as info:
        ProducerConfig.from_mapping({key: address})
    assert str(info.value).startswith(f"{key}: expected 'HOST:PORT' or '[IPV6]:PORT'")
    assert repr(address) in str(info.value)


@pytest.mark.parametrize("address", ["0.0.0.0:50051", "[::]:50051", "10.0.0.7:0"])
def test_advertise_address_must_be_dialable(address: str) -> None:
    """A wildcard host or port 0 means something only to a listener: published in handles,
    it would send every decode worker to an address that reaches nothing."""
    with pytest.raises(ConfigError) as info:
        ProducerConfig.from_mapping({"advertise_address": address})
    assert str(info.value).startswith("advertise_address: expected a host and port other hosts")
    assert repr(address) in str(info.value)
    for good in ("", "10.0.0.7:50051", "[fd00::7]:50051", "prefill-0.kv:50051"):
        assert ProducerConfig.from_mapping({"advertise_address": good}).advertise_address == good


def test_metrics_listen_empty_disables_and_must_not_clash_with_listen() -> None:
    assert ProducerConfig.from_mapping({"metrics_listen": ""}).metrics_address is None
    assert ProducerConfig.from_mapping({"metrics_listen": "[::1]:9"}).metrics_address == Address(
        "::1", 9
    )
    with pytest.raises(ConfigError, match=r"^metrics_listen \('0.0.0.0:50051'\) must not use"):
        ProducerConfig.from_mapping({"metrics_listen": "0.0.0.0:50051"})
    # Port 0 means "any free port" for both, so the two never clash.
    ProducerConfig.from_mapping({"listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0"})


# --- unknown keys -------------------------------------------------------------------------


def test_unknown_key_in_file_rejected(tmp_path: Path) -> None:
    path = write_json(tmp_path / "c.json", {"pool_bytes": "1GiB", "unbound_store_timeout": 5})
    with pytest.raises(ConfigError) as info:
        load_config(["--config", path], {})
    assert str(info.value) == (
        f"config file {path!r}: unknown key 'unbound_store_timeout'"
        " (did you mean 'unbound_store_timeout_s'?)"
    )


def test_unknown_kvpark_variable_rejected_other_variables_ignored() -> None:
    with pytest.raises(ConfigError) as info:
        load_config([], {"KVPARK_POOL_BYTE": "1GiB", "HOME": "/root"})
    assert str(info.value) == (
        "environment: unknown variable 'KVPARK_POOL_BYTE' (did you mean 'KVPARK_POOL_BYTES'?)"
    )
    with pytest.raises(ConfigError, match="unknown variable 'KVPARK_pool_bytes'"):
        load_config([], {"KVPARK_pool_bytes": "1GiB"})
    assert load_config([], {"PATH": "/bin", "kvpark_whatever": "x"}) == ProducerConfig()


def test_unknown_or_abbreviated_flag_rejected() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^command line: unknown option '--pool-byte' \(did you mean '--pool-bytes'\?\); "
        r"1 unexpected argument \(not shown",
    ):
        load_config(["--pool-byte", "1GiB"], {})
    with pytest.raises(ConfigError, match=r"^command line: "):
        load_config(["--pool", "1GiB"], {})  # no abbreviations
    with pytest.raises(ConfigError, match=r"^command line: .*--listen.*expected one argument"):
        load_config(["--listen"], {})
    with pytest.raises(ConfigError, match=r"^command line: 1 unexpected argument \(not shown"):
        load_config(["stray"], {})


@pytest.mark.parametrize(
    "argv",
    [
        ["--park-tokn", "s3cr3t-value"],
        ["--fetch_token=s3cr3t-value"],
        ["--park-token", "a-token", "s3cr3t-value"],
    ],
)
def test_a_mistyped_flag_never_shows_its_value(argv: list[str]) -> None:
    """The word after a mistyped token flag is the token; the error names the flag only."""
    with pytest.raises(ConfigError, match=r"^command line: ") as raised:
        load_config(argv, {})
    assert "s3cr3t" not in str(raised.value)
    if argv[0] != "--park-token":
        assert "did you mean" in str(raised.value)


def test_unknown_key_in_mapping_rejected() -> None:
    with pytest.raises(ConfigError, match=r"^from_mapping: unknown key 'listen_addr'"):
        ProducerConfig.from_mapping({"listen_addr": "127.0.0.1:1"})


def test_help_and_version_exit_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load_config(["--help"], {})
    assert info.value.code == 0
    assert "--unbound-store-timeout-s" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        load_config(["--version"], {})
    assert info.value.code == 0


# --- config file errors -------------------------------------------------------------------


def test_config_file_errors(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match=r"^config: cannot read config file .*missing.json"):
        load_config(["--config", missing], {})
    broken = tmp_path / "broken.json"
    broken.write_text('{"pool_bytes": \n')
    with pytest.raises(ConfigError, match=r"is not valid JSON: .* line 2 column 1$"):
        load_config(["--config", str(broken)], {})
    listing = write_json(tmp_path / "list.json", [1, 2])
    with pytest.raises(ConfigError, match=r"must hold a JSON object, got list$"):
        load_config(["--config", listing], {})
    duplicate = tmp_path / "dup.json"
    duplicate.write_text('{"max_tombstones": 1, "max_tombstones": 2}')
    with pytest.raises(ConfigError, match=r"^config: duplicate key 'max_tombstones'"):
        load_config(["--config", str(duplicate)], {})


def test_every_message_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        ProducerConfig.from_mapping({"listen": "a\nb:1"})
    assert "\n" not in str(info.value) and "'a\\nb:1'" in str(info.value)
    assert str(ConfigError("first\nsecond")) == "first second"
    assert issubclass(ConfigError, ValueError)
    long_value = "x" * 10_000
    with pytest.raises(ConfigError) as info:
        ProducerConfig.from_mapping({"log_level": long_value})
    assert len(str(info.value)) < 300


# --- cross-field rules --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "pattern"),
    [
        (
            {"tombstone_retention_s": 30, "consumer_load_timeout_s": 30},
            r"^tombstone_retention_s \(30.0\) must be greater than consumer_load_timeout_s "
            r"\(30.0\)",
        ),
        (
            {"tombstone_retention_s": "40", "consumer_load_timeout_s": "45"},
            r"^tombstone_retention_s \(40.0\) must be greater than consumer_load_timeout_s "
            r"\(45.0\)",
        ),
        (
            {"pool_bytes": "1MiB", "max_chunk_bytes": "2MiB", "max_batch_share": 1},
            r"^max_chunk_bytes \(2097152\) takes 8 pages of 262144 bytes, more than one Park "
            r"batch may hold: 4, the whole pages of pool_bytes \(1048576\) x max_batch_share "
            r"\(1.0\); lower max_chunk_bytes or raise pool_bytes or max_batch_share$",
        ),
        (
            {"max_lease_s": 59, "unbound_store_timeout_s": 60},
            r"^max_lease_s \(59.0\) must be >= unbound_store_timeout_s \(60.0\)$",
        ),
    ],
)
def test_cross_field_rules(values: dict[str, object], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as info:
        ProducerConfig.from_mapping(values)
    assert set(info.value.keys) == set(values)


def test_cross_field_boundaries_are_allowed() -> None:
    cfg = ProducerConfig.from_mapping(
        {"pool_bytes": "32MiB", "max_lease_s": 60, "tombstone_retention_s": 30.5}
    )
    assert 2 * cfg.max_chunk_bytes == cfg.pool_bytes and cfg.max_lease_s == 60.0


PAGE = 256 * 1024


@pytest.mark.parametrize(
    ("pool_bytes", "max_chunk_bytes", "max_batch_share"),
    [
        # The default 16 MiB chunk in a 16 MiB pool: a batch holds half of it.
        ("16MiB", "16MiB", 0.5),
        # A chunk of two pages (one byte more than a page) in a one-page pool.
        ("300KiB", "300KiB", 1),
        # The share of a 4-page pool rounds down to one page; the chunk takes two.
        (4 * PAGE, PAGE + 1, 0.49),
        # The pool's odd bytes are no page: 2 whole pages, and the chunk takes 3.
        (3 * PAGE - 1, 2 * PAGE + 1, 1),
    ],
)
def test_largest_chunk_must_fit_one_batch_in_whole_pages(
    pool_bytes: object, max_chunk_bytes: object, max_batch_share: float
) -> None:
    """A chunk takes whole pool pages and one Park batch may hold max_batch_share of the pool,
    in whole pages: a largest chunk that takes more could never be parked (TOO_LARGE)."""
    values = {
        "pool_bytes": pool_bytes,
        "max_chunk_bytes": max_chunk_bytes,
        "max_batch_share": max_batch_share,
    }
    with pytest.raises(ConfigError, match=r"^max_chunk_bytes \(\d+\) takes \d+ pages") as info:
        ProducerConfig.from_mapping(values)
    assert info.value.keys == ("max_chunk_bytes", "pool_bytes", "max_batch_share")


@pytest.mark.parametrize(("pool_pages", "share", "pages"), [(11520, 0.7, 8064), (10, 0.25, 2)])
def test_a_batch_is_the_share_of_the_pool_in_whole_pages(
    pool_pages: int, share: float, pages: int
) -> None:
    """0.7 of 11,520 pages is 8,064 exactly, though the float product lands just below it."""
    values = {"pool_bytes": pool_pages * PAGE, "max_chunk_bytes": PAGE, "max_batch_share": share}
    assert ProducerConfig.from_mapping(values).max_batch_pages == pages


def test_pool_must_hold_one_page() -> None:
    with pytest.raises(ConfigError, match=r"^pool_bytes \(262143\) must hold at least one") as info:
        ProducerConfig.from_mapping({"pool_bytes": PAGE - 1, "max_chunk_bytes": 1})
    assert info.value.keys == ("pool_bytes",)


def test_cross_field_error_names_the_sources(tmp_path: Path) -> None:
    path = write_json(tmp_path / "c.json", {"tombstone_retention_s": 20})
    with pytest.raises(ConfigError) as info:
        load_config(["--config", path, "--consumer-load-timeout-s", "25"], {})
    assert str(info.value).endswith(
        f"(tombstone_retention_s from config file {path!r}; "
        "consumer_load_timeout_s from command line --consumer-load-timeout-s)"
    )


# --- tokens -------------------------------------------------------------------------------


def test_tokens_inline_and_from_files(tmp_path: Path) -> None:
    park_file = secret_file(tmp_path, "park", "p-secret\n")
    cfg = ProducerConfig.from_mapping({"park_token_file": park_file, "fetch_token": "f-secret"})
    credentials = load_credentials(cfg)
    assert (credentials.park_token, credentials.fetch_token) == ("p-secret", "f-secret")
    assert cfg.auth_enabled
    env = {"KVPARK_FETCH_TOKEN_FILE": secret_file(tmp_path, "fetch", "f2\r\n")}
    assert load_credentials(load_config(["--park-token", "p2"], env)).fetch_token == "f2"
    assert "p-secret" not in repr(credentials)


def test_validation_does_no_io_and_the_load_step_reads_the_files(tmp_path: Path) -> None:
    """A config names files without reading them (building one never touches the disk); the
    load step reads them when called, so a rotated token file is read afresh."""
    path = tmp_path / "park"
    cfg = ProducerConfig.from_mapping({"park_token_file": str(path)})  # not there yet: fine
    with pytest.raises(ConfigError, match=r"^park_token_file: not an existing file"):
        load_credentials(cfg)
    path.write_text("first")
    assert load_credentials(cfg).park_token == "first"
    path.write_text("second")
    assert load_credentials(cfg.replace(log_level="debug")).park_token == "second"


def test_tokens_never_shown(tmp_path: Path) -> None:
    cfg = ProducerConfig.from_mapping(
        {"park_token": "p-secret", "fetch_token_file": secret_file(tmp_path, "f", "f-secret")}
    )
    for text in (repr(cfg), str(cfg), str(cfg.as_dict())):
        assert "p-secret" not in text and "f-secret" not in text
    assert "park_token='***'" in repr(cfg) and "fetch_token=None" in repr(cfg)
    assert cfg.as_dict(redact=False)["park_token"] == "p-secret"
    for bad in ("has space", "tab\there", "nl\n"):
        with pytest.raises(ConfigError) as info:
            ProducerConfig.from_mapping({"fetch_token": bad})
        assert bad not in str(info.value)
        assert str(info.value) == (
            "fetch_token: expected a non-empty token of printable ASCII characters (0x21-0x7E, "
            f"no spaces), got <redacted string of {len(bad)} characters>"
        )


@pytest.mark.parametrize("role", ["park", "fetch"])
def test_token_and_token_file_are_exclusive(tmp_path: Path, role: str) -> None:
    values = {f"{role}_token": "inline", f"{role}_token_file": secret_file(tmp_path, "t", "file")}
    with pytest.raises(ConfigError) as info:
        ProducerConfig.from_mapping(values)
    assert str(info.value).startswith(f"{role}_token and {role}_token_file are mutually exclusive")
    assert "inline" not in str(info.value) and info.value.keys == tuple(values)


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        ("", r"^park_token_file: token file '.*' is empty$"),
        ("\n", r"^park_token_file: token file '.*' is empty$"),
        ("two words\n", r"^park_token_file: the token in '.*' holds a space or a character "),
    ],
)
def test_bad_token_files(tmp_path: Path, content: str, pattern: str) -> None:
    path = secret_file(tmp_path, "park", content)
    with pytest.raises(ConfigError, match=pattern):
        load_credentials(ProducerConfig.from_mapping({"park_token_file": path}))


def test_missing_token_file_and_empty_token(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(
        ConfigError, match=rf"^park_token_file: not an existing file: {re.escape(repr(missing))}"
    ):
        load_credentials(load_config([], {"KVPARK_PARK_TOKEN_FILE": missing}))
    with pytest.raises(ConfigError, match=r"^park_token: expected a non-empty token"):
        load_config(["--park-token="], {})


def test_park_and_fetch_tokens_must_differ() -> None:
    with pytest.raises(ConfigError, match=r"^park_token and fetch_token must differ"):
        load_credentials(ProducerConfig.from_mapping({"park_token": "same", "fetch_token": "same"}))


# --- TLS ----------------------------------------------------------------------------------


def test_tls_pairing(tmp_path: Path) -> None:
    pem = "-----BEGIN CERTIFICATE-----\nnot checked here\n-----END CERTIFICATE-----\n"
    cert, key, ca = (secret_file(tmp_path, name, pem) for name in ("cert", "key", "ca"))
    cfg = ProducerConfig.from_mapping(
        {"tls_cert_file": cert, "tls_key_file": key, "tls_client_ca_file": ca}
    )
    assert cfg.tls_enabled
    with pytest.raises(ConfigError, match=r"^tls_cert_file \('.*cert'\) and tls_key_file \(None\)"):
        ProducerConfig.from_mapping({"tls_cert_file": cert})
    with pytest.raises(ConfigError, match=r"^tls_cert_file \(None\) and tls_key_file \('.*key'\)"):
        ProducerConfig.from_mapping({"tls_key_file": key})
    with pytest.raises(ConfigError, match=r"^tls_client_ca_file \('.*ca'\) requires tls_cert_file"):
        ProducerConfig.from_mapping({"tls_client_ca_file": ca})
    missing = ProducerConfig.from_mapping(
        {"tls_cert_file": cert, "tls_key_file": f"{tmp_path}/missing"}
    )
    with pytest.raises(ConfigError, match=r"^tls_key_file: not an existing file: '.*missing'$"):
        load_credentials(missing)
    secret_file(tmp_path, "cert", "PEM")
    with pytest.raises(ConfigError, match=r"^tls_cert_file: .* holds no PEM block$"):
        load_credentials(cfg)  # a placeholder, not a certificate: one line, the key named
    with pytest.raises(ConfigError, match=r"^tls_cert_file: expected a path to a file"):
        ProducerConfig.from_mapping({"tls_cert_file": ""})


def test_tls_material_that_a_server_cannot_use_is_a_config_error(tmp_path: Path) -> None:
    """PEM that is not a certificate or key, a key of another certificate, a client CA that
    is no certificate: each is refused when the credentials load, naming the keys (grpc would
    fail the bind with "Failed to bind" and a traceback)."""
    certs = make_certs(tmp_path / "real")
    other = make_certs(tmp_path / "other")
    garbage = secret_file(
        tmp_path, "garbage", "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n"
    )

    def config(cert: object, key: object, ca: object = None) -> ProducerConfig:
        files = {"tls_cert_file": str(cert), "tls_key_file": str(key)}
        return ProducerConfig.from_mapping(files | ({"tls_client_ca_file": str(ca)} if ca else {}))

    good = load_credentials(config(certs.server_cert, certs.server_key, certs.ca))
    assert good.tls_cert == certs.server_cert.read_bytes()
    for cert, key in ((garbage, certs.server_key), (certs.server_cert, garbage),
                      (certs.server_cert, other.server_key)):  # fmt: skip
        with pytest.raises(ConfigError, match=r"^tls_cert_file / tls_key_file: not a usable"):
            load_credentials(config(cert, key))
    with pytest.raises(ConfigError, match=r"^tls_client_ca_file: .* holds no usable CA") as bad:
        load_credentials(config(certs.server_cert, certs.server_key, garbage))
    assert not str(bad.value).endswith("None"), "says what is wrong with the file"


# --- exposure rule ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "listen", ["0.0.0.0:50051", "[::]:50051", "10.1.2.3:50051", "prefill-0:50051", "0.0.0.0:0"]
)
def test_non_loopback_listen_needs_tls_tokens_or_allow_insecure(
    tmp_path: Path, listen: str
) -> None:
    with pytest.raises(ConfigError) as info:
        ProducerConfig.from_mapping({"listen": listen})
    message = str(info.value)
    assert message.startswith(f"listen: {listen!r} is not a loopback address")
    assert "allow_insecure" in message and "TLS" in message and "tokens" in message

    insecure = ProducerConfig.from_mapping({"listen": listen, "allow_insecure": "true"})
    assert insecure.is_insecure_exposed

    with_token = ProducerConfig.from_mapping({"listen": listen, "fetch_token": "t"})
    assert not with_token.is_insecure_exposed
    cert, key = secret_file(tmp_path, "cert", "PEM"), secret_file(tmp_path, "key", "PEM")
    with_tls = ProducerConfig.from_mapping(
        {"listen": listen, "tls_cert_file": cert, "tls_key_file": key}
    )
    assert not with_tls.is_insecure_exposed


@pytest.mark.parametrize(
    "listen", ["127.0.0.1:1", "127.8.9.10:1", "[::1]:1", "localhost:1", "LOCALHOST:0",
               "[::ffff:127.0.0.1]:1"],
)  # fmt: skip
def test_loopback_listen_needs_nothing(listen: str) -> None:
    cfg = ProducerConfig.from_mapping({"listen": listen, "allow_insecure": True})
    assert cfg.listen_is_loopback and not cfg.is_insecure_exposed


def test_exposure_error_names_the_source() -> None:
    with pytest.raises(ConfigError) as info:
        load_config([], {"KVPARK_LISTEN": "0.0.0.0:50051"})
    assert str(info.value).endswith("(listen from environment KVPARK_LISTEN)")
    cfg = load_config(["--allow-insecure"], {"KVPARK_LISTEN": "0.0.0.0:50051"})
    assert cfg.is_insecure_exposed


# --- drift --------------------------------------------------------------------------------


def test_fields_keys_and_cli_flags_agree() -> None:
    fields = [f.name for f in dataclasses.fields(ProducerConfig) if f.init]
    assert list(KEYS) == fields
    parser = build_arg_parser()
    by_dest = {action.dest: action for action in parser._actions}
    flag_dests = set(by_dest) - {"help", "version", "config"}
    assert flag_dests == set(fields)
    defaults = ProducerConfig()
    for name, spec in KEYS.items():
        action = by_dest[name]
        assert action.option_strings == ["--" + name.replace("_", "-")] == [spec.flag]
        assert action.help and spec.env_var in action.help and "default: " in action.help
        assert spec.help in action.help
        assert getattr(defaults, name) == spec.default
        assert spec.env_var == "KVPARK_" + name.upper()


def test_other_tools_variables_are_not_producer_typos() -> None:
    """The `kvpark` CLI and the compose files read KVPARK_ variables of their own: a shell
    holding them still starts a producer, and every one of them is known to the producer."""
    from kvpark.client import cli
    from kvpark.producer.config_sources import OTHER_TOOLS_ENV_VARS

    root = Path(cli.__file__).resolve().parents[1]
    sources = [Path(cli.__file__), *root.glob("docker-compose*.yml")]
    used = {v for path in sources for v in re.findall(r"KVPARK_[A-Z_]+", path.read_text())}
    known = OTHER_TOOLS_ENV_VARS | {spec.env_var for spec in KEYS.values()} | {CONFIG_ENV_VAR}
    assert used <= known, sorted(used - known)
    environ = dict.fromkeys(OTHER_TOOLS_ENV_VARS, "x") | {"KVPARK_POOL_BYTES": "32MiB"}
    config = load_config([], environ)
    assert config.pool_bytes == 32 * 1024 * 1024


def test_a_shm_socket_whose_private_bind_path_would_be_too_long_is_refused() -> None:
    """The socket is first bound in a private directory beside it ("<dir>/.kvpark-XXXXXXXX/s",
    19 bytes more than its directory), which must fit the 107-byte Unix limit too."""
    fits = "/" + "d" * 87 + "/kv.sock"  # directory 88 bytes
    assert ProducerConfig.from_mapping({"shm_socket": fits}).shm_socket == fits
    deep = "/" + "d" * 88 + "/kv.sock"  # directory 89 bytes, whole path 97: under 107
    with pytest.raises(ConfigError, match=r"^shm_socket: .*directory is at most 88 bytes"):
        ProducerConfig.from_mapping({"shm_socket": deep})
