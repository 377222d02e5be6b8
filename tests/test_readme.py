"""The README's Python snippets, run as a reader would run them: in order, in one namespace,
against a real producer process that offers every transport. The only change made to them is
the producer's address. Their own asserts check what they claim; this test also checks what
they print (the transports of the shared-memory example, the metrics sample)."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import ProducerProcess

README = Path(__file__).resolve().parent.parent / "README.md"
PLACEHOLDER = "prefill-0:50051"


def python_snippets() -> list[str]:
    section = README.read_text().split("## Using it from Python", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```", section, flags=re.M | re.S)


@pytest.fixture
def short_dir() -> Iterator[str]:
    # Unix socket paths are short (107 bytes): pytest's tmp_path can be too long.
    directory = tempfile.mkdtemp(prefix="kvpark-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_the_readme_python_snippets_run_against_a_real_producer(
    producer_process: Callable[..., ProducerProcess], short_dir: str
) -> None:
    snippets = python_snippets()
    assert len(snippets) >= 5, "the README's Python section lost its examples"
    assert all(PLACEHOLDER in s or "ConsumerPool(" in s for s in snippets)
    producer = producer_process(
        data_listen="127.0.0.1:0", shm_socket=f"{short_dir}/shm.sock", pool_bytes="256MiB"
    )
    namespace: dict[str, object] = {"__name__": "readme"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for n, snippet in enumerate(snippets, start=1):
            code = compile(snippet.replace(PLACEHOLDER, producer.target), f"README#{n}", "exec")
            exec(code, namespace)
    lines = printed.getvalue().splitlines()
    assert "remote None" in lines  # the pool's load by handle
    assert "not recomputed: WAIT_TIMEOUT" in lines  # policy="fail"
    assert "shm shm" in lines  # the first park and load of shared buffers
    assert lines[-1] == "1.0"  # the metrics sample: one remote load counted, printed last
    assert producer.proc.poll() is None
