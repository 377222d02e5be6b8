"""A producer rescheduled under the same DNS name on another host (a pod, a compose service's
new container): a client whose channel knew the old address reaches the new one within a
second or two, not after grpc's default 30 s between name lookups.

The client runs in a mount namespace of its own whose /etc/hosts is a file of this test's, so
the name can move without touching the machine's resolver; the producers listen on 127.0.0.1
and then 127.0.0.2 (both loopback)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ProducerProcess, start_producer_process
from consumer_support import park_sync

NAME = "kvpark-producer.test"

CLIENT = textwrap.dedent(
    """
    import sys, time
    from kvpark.client import KVConsumer

    with KVConsumer(sys.argv[1], timeout=2, transport="grpc") as client:
        print(client.server_info().producer_epoch, flush=True)  # connected to the first host
        kid, epoch = sys.stdin.readline().split()
        moved = time.monotonic()
        while time.monotonic() - moved < 45:
            if client.load(kid, num_chunks=1, expected_epoch=int(epoch)).ok:
                print(f"loaded {time.monotonic() - moved:.2f}", flush=True)
                break
            time.sleep(0.05)
        else:
            print("never loaded", flush=True)
    """
)


def _can_unshare_mounts() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-m", "--propagation", "private", "true"]
    return subprocess.run(probe, capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare_mounts(), reason="needs a mount namespace (unshare -m)")
def test_a_client_follows_its_producer_to_a_new_address(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 {NAME}\n")
    (tmp_path / "client.py").write_text(CLIENT)
    started: list[ProducerProcess] = []
    first = start_producer_process(tmp_path)
    started.append(first)
    port = first.target.rsplit(":", 1)[1]
    command = (
        f"mount --bind {hosts} /etc/hosts && exec {sys.executable} {tmp_path / 'client.py'} "
        f"{NAME}:{port}"
    )
    client = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", command],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert client.stdin is not None and client.stdout is not None
    try:
        first_epoch = int(client.stdout.readline())
        # The old host goes away; the name now points at the new one, where the id is parked.
        first.proc.kill()
        first.proc.wait(timeout=10)
        # Rewritten in place (same inode), so the bind mount sees it.
        hosts.write_text(f"127.0.0.1 localhost\n127.0.0.2 {NAME}\n")
        second = start_producer_process(tmp_path, listen=f"127.0.0.2:{port}")
        started.append(second)
        epoch = park_sync(second.target, "moved", {0: b"kv" * 4096}).producer_epoch
        assert epoch != first_epoch
        client.stdin.write(f"moved {epoch}\n")
        client.stdin.flush()
        outcome = client.stdout.readline().split()
        assert client.wait(timeout=60) == 0
        assert outcome[0] == "loaded", outcome
        # grpc's default would be about 30 s; a second between lookups plus reconnects.
        assert float(outcome[1]) < 10.0, outcome
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(timeout=10)
        for producer in started:
            if producer.proc.poll() is None:
                producer.proc.kill()
            producer.proc.wait(timeout=10)
            producer.close_output()
