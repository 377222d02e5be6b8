"""Where the producer's configuration comes from: defaults < a JSON file (`--config FILE` or
`KVPARK_CONFIG`) < the environment (`KVPARK_<KEY>`) < the command line (`--<key-with-dashes>`),
later wins. Every source hands raw values to the one schema (config.py), so a value is judged
the same whatever its source, and an error says where the offending value came from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from kvpark.version import __version__

from .config import (
    ENV_PREFIX,
    KEYS,
    ConfigError,
    KeySpec,
    ProducerConfig,
    reject_unknown_keys,
    suggest,
)
from .config_values import parse_bool, parse_bytes

__all__ = ["CONFIG_ENV_VAR", "OTHER_TOOLS_ENV_VARS", "build_arg_parser", "load_config"]

# The one KVPARK_ variable that is not a key: it names the JSON config file.
CONFIG_ENV_VAR = "KVPARK_CONFIG"
# KVPARK_ variables that belong to the project's other tools, not to the producer: ignored here
# rather than rejected as typos, so one operator shell can hold them all. The `kvpark` CLI
# (kvpark.client.cli) reads the first two; the compose files interpolate the last two.
OTHER_TOOLS_ENV_VARS = frozenset(
    {"KVPARK_TARGET", "KVPARK_TOKEN", "KVPARK_IMAGE", "KVPARK_CERTS_DIR"}
)


class _ArgumentParser(argparse.ArgumentParser):
    """argparse reports errors by printing and exiting 2; library code raises instead."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"command line: {message}")


def _format_default(spec: KeySpec) -> str:
    value = spec.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if spec.parse is parse_bytes and isinstance(value, int):
        for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
            if value % size == 0:
                return f"{value // size}{unit}"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def build_arg_parser() -> argparse.ArgumentParser:
    """The producer's command line: `--config FILE`, `--version` and one `--<key>` per key.
    Only flags actually given appear in the parsed namespace (defaults are suppressed), so the
    command line overrides lower sources key by key. Errors raise ConfigError."""
    parser = _ArgumentParser(
        prog="kvpark-producer",
        description="kvpark producer: parks KV-cache chunks in a host-memory pool and serves "
        "them to decode workers over gRPC. Sources, later wins: defaults < JSON file "
        f"(--config or {CONFIG_ENV_VAR}) < environment ({ENV_PREFIX}<KEY>) < command line.",
        allow_abbrev=False,  # --pool must not silently mean --pool-bytes
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"JSON file holding an object of keys (env {CONFIG_ENV_VAR})",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in KEYS.values():
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group)
        help_text = f"{spec.help} (default: {_format_default(spec)}; env {spec.env_var})"
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if spec.parse is parse_bool else {}
        groups[spec.group].add_argument(
            spec.flag,
            dest=spec.name,
            metavar=spec.metavar,
            help=help_text.replace("%", "%%"),
            **extra,
        )
    return parser


def _unknown_arguments(words: Sequence[str]) -> str:
    """Names the unknown flags and never echoes a value: the word after a mistyped
    `--park-tokn`, or after the `=` of `--fetch_token=...`, is a token, and this message ends
    up in the container's log."""
    flags = [word.split("=", 1)[0] for word in words if word.startswith("-")]
    known = ["--config", "--version", "--help", *(spec.flag for spec in KEYS.values())]
    named = [f"unknown option {flag!r}{suggest(flag, known)}" for flag in flags]
    if others := len(words) - len(flags):
        named.append(f"{others} unexpected argument{'s' if others > 1 else ''} (not shown: "
                     "a value may be a secret)")  # fmt: skip
    return "; ".join(named)


def _read_config_file(path: str) -> dict[str, object]:
    def no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
        result: dict[str, object] = {}
        for name, value in pairs:
            if name in result:
                raise ConfigError(f"config: duplicate key {name!r} in {path!r}", keys=(name,))
            result[name] = value
        return result

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"config: cannot read config file {path!r}: {reason}") from None
    try:
        # NaN/Infinity/true/null pass through to the key parsers, which reject them with repr.
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config: {path!r} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path!r} must hold a JSON object, got {type(data).__name__}")
    reject_unknown_keys(data, f"config file {path!r}")
    return data


def _read_environment(environ: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """({key: raw value} of the KVPARK_<KEY> variables, the KVPARK_CONFIG path or None)."""
    values: dict[str, str] = {}
    config_path: str | None = None
    known = {spec.env_var: name for name, spec in KEYS.items()}
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX):
            continue
        if var == CONFIG_ENV_VAR:
            config_path = environ[var]
        elif var in OTHER_TOOLS_ENV_VARS:
            continue  # the CLI's or the compose files' own; an operator's shell may hold all
        elif var in known:
            values[known[var]] = environ[var]
        else:
            # A misspelt variable would otherwise be ignored and the default used silently.
            hint = suggest(var, [*known, CONFIG_ENV_VAR])
            raise ConfigError(f"environment: unknown variable {var!r}{hint}")
    return values, config_path


def _with_origins(exc: ConfigError, origins: Mapping[str, str]) -> ConfigError:
    """Appends where the offending value(s) came from; keys left at their default are not named."""
    if len(exc.keys) == 1 and exc.keys[0] in origins:
        return ConfigError(f"{exc} (from {origins[exc.keys[0]]})", keys=exc.keys)
    named = [f"{key} from {origins[key]}" for key in exc.keys if key in origins]
    if not named:
        return exc
    return ConfigError(f"{exc} ({'; '.join(named)})", keys=exc.keys)


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ProducerConfig:
    """The producer's config from defaults < JSON file < environment < command line.

    `argv` defaults to `sys.argv[1:]` and `environ` to `os.environ`. Raises ConfigError for
    any invalid value, unknown key, unknown KVPARK_ variable or bad command line; `--help`
    and `--version` print and raise SystemExit(0) as argparse does.
    """
    parser = build_arg_parser()
    known, unknown = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if unknown:
        raise ConfigError(f"command line: {_unknown_arguments(unknown)}")
    args = vars(known)
    env_values, env_config = _read_environment(os.environ if environ is None else environ)
    config_path = args.pop("config", env_config)
    if config_path is not None and not config_path:
        raise ConfigError("config: expected a path to a JSON file, got ''")

    merged: dict[str, object] = {}
    origins: dict[str, str] = {}
    if config_path is not None:
        for key, value in _read_config_file(config_path).items():
            merged[key], origins[key] = value, f"config file {config_path!r}"
    for key, value in env_values.items():
        merged[key], origins[key] = value, f"environment {KEYS[key].env_var}"
    for key, value in args.items():
        merged[key], origins[key] = value, f"command line {KEYS[key].flag}"
    try:
        return ProducerConfig.from_mapping(merged)
    except ConfigError as exc:
        raise _with_origins(exc, origins) from None
