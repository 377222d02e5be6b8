"""What the wheel carries: the one import package `kvpark` (producer, clients, CLI, the lean
`kvpark bench`) and nothing of the repository's other folders — no lab, no tests, no scripts.
The wheel is built from a copy of the sources (so nothing left in the checkout's build/ can
slip in) with the venv's pip, setuptools and wheel, offline. The installed entry points are
checked too, and `python -m kvpark.producer --help` answers.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Modules of the lab (benchmarks/) that must never ship, whatever package they would hide in.
LAB = {"ablation", "acceptfloor", "grpcfloor", "churn", "prober", "reaper", "helper", "memory"}
NOT_SHIPPED = {"benchmarks", "shared", "producer_service", "consumer_client", "tests", "scripts",
               "examples"}  # fmt: skip
SCRIPTS = {"kvpark": "kvpark.client.cli:main", "kvpark-producer": "kvpark.producer.__main__:main"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(tmp / "out"), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    [built] = (tmp / "out").glob("kvpark-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def test_only_kvpark_is_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    paths = [PurePosixPath(name) for name in wheel.namelist()]
    version = metadata.version("kvpark")
    assert {p.parts[0] for p in paths} == {"kvpark", f"kvpark-{version}.dist-info"}
    assert not {p.parts[0] for p in paths} & NOT_SHIPPED
    modules = [p for p in paths if p.suffix in (".py", ".pyi")]
    assert not [p for p in modules if p.stem in LAB]
    for path in modules:  # nothing in the package reaches for the lab either
        text = wheel.read(str(path)).decode()
        assert "import benchmarks" not in text and "from benchmarks" not in text, path
    names = {str(p) for p in paths}
    assert {"kvpark/py.typed", "kvpark/client/py.typed", "kvpark/producer/py.typed"} <= names
    assert "kvpark/pb/kvpark_pb2.pyi" in names
    assert {"kvpark/client/cli.py", "kvpark/client/bench/command.py",
            "kvpark/client/bench/rawtcp.py", "kvpark/producer/__main__.py"} <= names  # fmt: skip
    info = wheel.read(f"kvpark-{version}.dist-info/entry_points.txt").decode()
    for name, target in SCRIPTS.items():
        assert f"{name} = {target}" in info


def test_installed_entry_points_and_producer_help() -> None:
    scripts = {e.name: e.value for e in metadata.distribution("kvpark").entry_points
               if e.group == "console_scripts"}  # fmt: skip
    assert scripts == SCRIPTS
    proc = subprocess.run([sys.executable, "-m", "kvpark.producer", "--help"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and "usage: kvpark-producer" in proc.stdout, proc.stderr
