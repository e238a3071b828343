"""`jserve fleet` on mock replicas behind the real smg: API key, a killed replica, SIGTERM."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from argparse import Namespace
from pathlib import Path

import pytest

from jserve.server.cli import build_parser
from jserve.server.fleet import plan_fleet, router_command

ROOT = Path(__file__).resolve().parents[2]
# The fleet program with the mock server as its replicas' program.
LAUNCHER = """
import sys
import jserve.server.fleet as fleet
fleet.REPLICA_PROGRAM = [
    sys.executable, "-m", "jserve.server", "--mock", "--mock-token-delay", "0.01"
]
from jserve.server.cli import main
sys.exit(main(["fleet", *sys.argv[1:]]))
"""


def fleet_args(*argv: str) -> Namespace:
    return build_parser().parse_args(["fleet", *argv])


def test_plan_gives_each_replica_its_port_key_and_event_endpoints():
    args = fleet_args("--replicas", "2", "--policy", "kv_aware", "--api-key", "k",
                      "--replica-base-port", "9100", "--kv-events-base-port", "6000")  # fmt: skip
    plan = plan_fleet(args, ["--max-num-seqs", "8"])
    assert plan.router_name == "vllm-router"
    assert [r.url for r in plan.replicas] == ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]
    second = plan.replicas[1].command
    assert second[second.index("--port") + 1] == "9101" and "--max-num-seqs" in second
    assert second[second.index("--api-key") + 1] == "k"
    assert second[second.index("--kv-events-endpoint") + 1] == "tcp://127.0.0.1:6002"
    assert second[second.index("--kv-events-replay-endpoint") + 1] == "tcp://127.0.0.1:6003"
    if shutil.which("vllm-router"):
        command = router_command(
            plan.router_name, plan.policy, [r.url for r in plan.replicas], host="127.0.0.1",
            port=9000, metrics_port=9001, kv_event_endpoints=plan.kv_event_endpoints, model="m",
        )  # fmt: skip
        assert "http://127.0.0.1:9101=tcp://127.0.0.1:6002" in command
        assert "http://127.0.0.1:9101=tcp://127.0.0.1:6003" in command
        assert command[command.index("--kv-event-model") + 1] == "m"
        # A session sticks to the replica its first request was placed on.
        assert command[command.index("--kv-aware-session-affinity-ttl-secs") + 1] == "600"


def test_plan_refuses_bad_combinations():
    with pytest.raises(ValueError, match="smg has no policy 'kv_aware'"):
        plan_fleet(fleet_args("--policy", "kv_aware", "--router", "smg"), [])
    with pytest.raises(ValueError, match="the fleet sets --port"):
        plan_fleet(fleet_args(), ["--port", "1"])
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        plan_fleet(fleet_args("--replicas", "0"), [])


def _post(url: str, key: str | None) -> int:
    body = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4}  # fmt: skip
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def _wait_for(path: Path, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text() if path.exists() else "")
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} not in {path}:\n{path.read_text()}")


@pytest.mark.skipif(shutil.which("smg") is None, reason="smg is not installed (jserve[fleet])")
def test_fleet_passes_the_key_restarts_a_killed_replica_and_stops_on_sigterm(tmp_path):
    base = 18900 + os.getpid() % 50 * 8
    log = tmp_path / "fleet.log"
    with log.open("w") as out:
        fleet = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, "--replicas", "2", "--port", str(base),
             "--replica-base-port", str(base + 1), "--router-metrics-port", str(base + 5),
             "--api-key", "sekret", "--log-dir", str(tmp_path / "logs")],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    try:
        _wait_for(log, "fleet ready", 60)
        url = f"http://127.0.0.1:{base}"
        assert _post(url, None) == 401
        assert [_post(url, "sekret") for _ in range(4)] == [200] * 4
        pid = int(_wait_for(log, r"replica-0 started \(pid (\d+)\)", 1).group(1))
        os.kill(pid, signal.SIGKILL)
        _wait_for(log, r"replica-0 \(http://127.0.0.1:\d+\) died with exit code -9; restarting", 10)
        # The router routes around the dead replica (and back once it answers again).
        assert [_post(url, "sekret") for _ in range(6)] == [200] * 6
        fleet.send_signal(signal.SIGTERM)
        assert fleet.wait(timeout=60) == 0
        assert "fleet stopped" in log.read_text()
    finally:
        if fleet.poll() is None:
            fleet.kill()
            fleet.wait()
