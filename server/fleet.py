"""`jserve fleet`: N `jserve serve` replicas on one machine behind an existing router.

jserve has no router of its own: the fleet runs smg (the Shepherd Model Gateway) or, for the
`kv_aware` policy, vllm-router, both installed by `pip install 'jserve[fleet]'`.

Walkthrough:
1. Start every replica (`python -m jserve.server.cli serve`) on its own loopback port, each
   logging to `<log-dir>/replica-<i>.log`; with `kv_aware`, each also publishes its KV-cache
   events on its own ZMQ ports (jserve.kv_events.publisher). Wait until every replica's /health
   answers 200; a replica that exits first fails the start (its log is named).
2. Start the router on `--port` with the chosen policy, the replicas' URLs (and their event
   endpoints for vllm-router), the API key passed through (smg checks clients' keys and sends
   the key to the replicas; vllm-router forwards the client's header, which the replicas
   check), and health checks every
   `HEALTH_INTERVAL_S` seconds so a dead replica leaves the rotation within seconds.
3. Supervise: a replica that exits is reported with its exit code and log; with `--restart`
   (the default) it is started again on the same port, at most `--max-restarts` times, and the
   router's health checks take it back when it answers. A replica whose /health stops
   answering is reported. If the router exits, the fleet stops (exit 1).
4. SIGTERM or SIGINT: stop the router first (no new requests), then SIGTERM every replica (each
   drains its in-flight requests, see jserve.server.runner), SIGKILL what is left after
   `--shutdown-timeout`, exit 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

log = logging.getLogger("jserve.fleet")


class Router(StrEnum):
    """The router programs a fleet can run (each is its command's name)."""

    SMG = "smg"
    VLLM_ROUTER = "vllm-router"


SMG_POLICIES = (
    "round_robin", "cache_aware", "random", "power_of_two", "least_load",
    "consistent_hashing", "prefix_hash",
)  # fmt: skip
VLLM_ROUTER_POLICIES = (
    "round_robin", "cache_aware", "kv_aware", "random", "power_of_two", "consistent_hash",
    "sticky_least_loaded",
)  # fmt: skip
HEALTH_INTERVAL_S = 2  # the routers' probe interval, and the fleet's own
# With kv_aware, vllm-router binds a session (a request's `x-session-id` header; a tenant's
# requests can share one) to the replica its first request was placed on by the KV events,
# for as long as the session keeps sending within this many seconds. Without it, two requests
# of a new session sent before either is scheduled land on different replicas, and both pools
# then hold that prefix (docs/fleet.md).
SESSION_AFFINITY_TTL_S = 600
_HOST = "127.0.0.1"
# The program each replica runs, before its flags (tests swap in the mock server).
REPLICA_PROGRAM = [sys.executable, "-m", "jserve.server.cli", "serve"]


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="jserve replicas (default: 2)")
    parser.add_argument(
        "--policy", default="cache_aware",
        choices=sorted(set(SMG_POLICIES) | set(VLLM_ROUTER_POLICIES)),
        help="the router's policy; kv_aware routes on the replicas' KV-cache events and runs "
        "vllm-router, the others run smg unless --router says otherwise (default: cache_aware)",
    )  # fmt: skip
    parser.add_argument(
        "--router", choices=[str(router) for router in Router], default=None,
        help="router program (default: vllm-router for kv_aware, else smg)",
    )  # fmt: skip
    parser.add_argument("--host", default=_HOST, help="router address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="router port (default: 8000)")
    parser.add_argument(
        "--replica-base-port", type=int, default=8100,
        help="replica i listens on this port + i, on 127.0.0.1 (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-events-base-port", type=int, default=5557,
        help="with kv_aware, replica i publishes KV events on this port + 2i and replays them "
        "on the next one (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--router-metrics-port", type=int, default=29000,
        help="the router's own Prometheus port (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--api-key", default=None,
        help="clients must send 'Authorization: Bearer KEY' to the router; the router sends it "
        "to the replicas, which require it too",
    )  # fmt: skip
    parser.add_argument(
        "--restart", action=argparse.BooleanOptionalAction, default=True,
        help="start a replica that exited again (default: on)",
    )  # fmt: skip
    parser.add_argument("--max-restarts", type=int, default=3, help="per replica (default: 3)")
    parser.add_argument(
        "--start-timeout", type=float, default=900.0,
        help="seconds for every replica to load and answer /health (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="seconds replicas may drain after SIGTERM before they are killed (default: 30)",
    )  # fmt: skip
    parser.add_argument(
        "--log-dir", default="fleet-logs", help="replica and router logs (default: %(default)s)"
    )
    parser.add_argument(
        "serve_args", nargs=argparse.REMAINDER,
        help="after `--`: flags for every `jserve serve` replica (model, KV pool size, ...)",
    )  # fmt: skip


@dataclass
class Child:
    """One supervised process: a replica or the router."""

    name: str
    command: list[str]
    log_path: Path
    url: str
    process: subprocess.Popen | None = None
    restarts: int = 0
    unhealthy_since: float | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self.process = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        log.info("%s started (pid %d), log %s", self.name, self.process.pid, self.log_path)

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)


@dataclass
class FleetPlan:
    """What to run: built from the arguments before anything starts."""

    replicas: list[Child]
    router_name: Router
    policy: str
    kv_event_endpoints: list[tuple[str, str]] = field(default_factory=list)  # (pub, replay)


def plan_fleet(args: argparse.Namespace, serve_args: list[str]) -> FleetPlan:
    """Replica commands and the router choice; raises ValueError on a bad combination."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    router = Router(
        args.router or (Router.VLLM_ROUTER if args.policy == "kv_aware" else Router.SMG)
    )
    allowed = SMG_POLICIES if router is Router.SMG else VLLM_ROUTER_POLICIES
    if args.policy not in allowed:
        raise ValueError(f"{router} has no policy {args.policy!r}; it has {', '.join(allowed)}")
    for flag in ("--host", "--port", "--api-key", "--kv-events-endpoint",
                 "--kv-events-replay-endpoint"):  # fmt: skip
        if any(a == flag or a.startswith(flag + "=") for a in serve_args):
            raise ValueError(f"the fleet sets {flag} for its replicas; remove it after `--`")
    log_dir = Path(args.log_dir)
    replicas, endpoints = [], []
    for i in range(args.replicas):
        port = args.replica_base_port + i
        command = [*REPLICA_PROGRAM, "--host", _HOST, "--port", str(port), *serve_args]
        if args.api_key:
            command += ["--api-key", args.api_key]
        if args.policy == "kv_aware":
            pub = f"tcp://{_HOST}:{args.kv_events_base_port + 2 * i}"
            replay = f"tcp://{_HOST}:{args.kv_events_base_port + 2 * i + 1}"
            command += ["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay]
            endpoints.append((pub, replay))
        replicas.append(Child(f"replica-{i}", command, log_dir / f"replica-{i}.log",
                              f"http://{_HOST}:{port}"))  # fmt: skip
    return FleetPlan(replicas, router, args.policy, endpoints)


def router_command(
    router: Router,
    policy: str,
    replica_urls: list[str],
    *,
    host: str,
    port: int,
    metrics_port: int,
    api_key: str | None = None,
    kv_event_endpoints: list[tuple[str, str]] | None = None,
    model: str = "",
    block_size: int = 16,
) -> list[str]:
    """The router's command line: smg or vllm-router with `policy` over `replica_urls`, probing
    them every HEALTH_INTERVAL_S; for vllm-router, each replica's (PUB, replay) event endpoints
    and the model and block size the events describe."""
    binary = shutil.which(router)
    if binary is None:
        raise ValueError(f"{router} is not installed: pip install 'jserve[fleet]'")
    common = ["--host", host, "--port", str(port), "--policy", policy,
              "--prometheus-port", str(metrics_port),
              "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
              "--health-failure-threshold", "2", "--health-success-threshold", "1"]  # fmt: skip
    if api_key:
        common += ["--api-key", api_key]
    if router == Router.SMG:
        return [binary, "launch", "--worker-urls", *replica_urls, *common]
    command = [binary, "--worker-urls", *replica_urls, *common]
    for url, (pub, replay) in zip(replica_urls, kv_event_endpoints or [], strict=False):
        command += ["--kv-event-source", f"{url}={pub}", "--kv-event-replay-source",
                    f"{url}={replay}"]  # fmt: skip
    if kv_event_endpoints:
        command += ["--kv-event-model", model, "--kv-event-block-size", str(block_size)]
    if policy == "kv_aware":
        command += ["--kv-aware-session-affinity-ttl-secs", str(SESSION_AFFINITY_TTL_S)]
    return command


def _get(url: str, api_key: str | None = None, timeout: float = 2.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, urllib.error.URLError):
        return 0, b""


def wait_ready(children: list[Child], path: str, timeout: float, stop: threading.Event) -> None:
    """Until each child answers 200 on `path`; raises RuntimeError naming one that exited."""
    deadline = time.monotonic() + timeout
    pending = list(children)
    while pending:
        for child in list(pending):
            code = child.exit_code()
            if code is not None:
                raise RuntimeError(f"{child.name} exited with code {code}; see {child.log_path}")
            if _get(child.url + path)[0] == 200:
                log.info("%s ready at %s", child.name, child.url)
                pending.remove(child)
        if stop.is_set():
            raise RuntimeError("stopped while starting")
        if time.monotonic() > deadline:
            names = ", ".join(c.name for c in pending)
            raise RuntimeError(f"{names} not ready after {timeout:.0f} s")
        stop.wait(1.0)


def served_model(replica: Child, api_key: str | None) -> str:
    status, body = _get(replica.url + "/v1/models", api_key)
    if status != 200:
        raise RuntimeError(f"{replica.name} answered /v1/models with {status}")
    return json.loads(body)["data"][0]["id"]


def supervise_once(plan: FleetPlan, router: Child, args: argparse.Namespace) -> str | None:
    """One supervision pass; returns why the fleet must stop, or None."""
    code = router.exit_code()
    if code is not None:
        return f"the router exited with code {code}; see {router.log_path}"
    for replica in plan.replicas:
        code = replica.exit_code()
        if code is not None:
            if args.restart and replica.restarts < args.max_restarts:
                replica.restarts += 1
                log.error("%s (%s) died with exit code %d; restarting it (%d of %d); see %s",
                          replica.name, replica.url, code, replica.restarts, args.max_restarts,
                          replica.log_path)  # fmt: skip
                replica.start()
            elif replica.process is not None:
                log.error("%s (%s) died with exit code %d and stays down; see %s",
                          replica.name, replica.url, code, replica.log_path)  # fmt: skip
                replica.process = None  # reported once
            continue
        if replica.process is None:
            continue
        healthy = _get(replica.url + "/health", timeout=HEALTH_INTERVAL_S)[0] == 200
        if healthy and replica.unhealthy_since is not None:
            log.info("%s answers /health again", replica.name)
            replica.unhealthy_since = None
        elif not healthy and replica.unhealthy_since is None:
            replica.unhealthy_since = time.monotonic()
            log.warning("%s (%s) does not answer /health with 200 (starting, draining or "
                        "stuck); the router routes around it",
                        replica.name, replica.url)  # fmt: skip
    return None


def shut_down(children: list[Child], timeout: float) -> None:
    """SIGTERM each (in order), then SIGKILL whatever is still running after `timeout`."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + timeout
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s: killing it", child.name, timeout)
            child.process.kill()
            child.process.wait()


def run_fleet(args: argparse.Namespace, serve_args: list[str], block_size: int) -> int:
    """Start, supervise until SIGTERM/SIGINT, shut down; returns the exit code."""
    plan = plan_fleet(args, serve_args)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    router: Child | None = None
    reason: str | None = None
    try:
        for replica in plan.replicas:
            replica.start()
        log.info("starting %d replicas (logs in %s)", len(plan.replicas), args.log_dir)
        wait_ready(plan.replicas, "/health", args.start_timeout, stop)
        model = served_model(plan.replicas[0], args.api_key)
        command = router_command(
            plan.router_name, plan.policy, [r.url for r in plan.replicas], host=args.host,
            port=args.port, metrics_port=args.router_metrics_port, api_key=args.api_key,
            kv_event_endpoints=plan.kv_event_endpoints, model=model, block_size=block_size,
        )  # fmt: skip
        router = Child(plan.router_name, command, Path(args.log_dir) / "router.log",
                       f"http://{args.host}:{args.port}")  # fmt: skip
        router.start()
        wait_ready([router], "/health", 120.0, stop)
        log.info("fleet ready: %s (%s, policy %s) in front of %s", router.url, plan.router_name,
                 plan.policy, ", ".join(r.url for r in plan.replicas))  # fmt: skip
        while not stop.wait(HEALTH_INTERVAL_S):
            reason = supervise_once(plan, router, args)
            if reason is not None:
                log.error("%s: stopping the fleet", reason)
                break
    except (RuntimeError, ValueError) as e:
        reason = str(e)
        log.error("fleet failed: %s", reason)
    finally:
        log.info("shutting the fleet down")
        shut_down([router] if router else [], 10.0)
        shut_down(plan.replicas, args.shutdown_timeout)
    log.info("fleet stopped%s", f" ({reason})" if reason else "")
    return 1 if reason else 0
