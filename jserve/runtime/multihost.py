"""Several processes, one SPMD program: JAX's multi-controller runtime, driven by process 0.

Every process of a run (`jax.distributed.initialize`; on CPU its collectives are gloo's) holds
its share of one mesh and must launch the same compiled computations in the same order.
Process 0 alone schedules and serves; before each device computation it broadcasts what the
others need to launch the same one: a message kind and, for a model step, the step's inputs
(`StepInputs`, all int32). The others (`follow`) only ever receive and run.

The broadcast is JAX's own collective, precompiled like everything else (so serving never
compiles): every process contributes a [1, n] int32 row of a global [processes, n] array, zeros
except process 0's, and a jitted sum replicates process 0's row everywhere (the scheme of
`jax.experimental.multihost_utils.broadcast_one_to_all`, which would compile once per new
shape while serving and build its mesh on every call). Every message is one broadcast of one
fixed length (a header: kind, bucket, payload length; then the payload, sized for the largest
bucket): such a broadcast costs its latency, nearly the same from 16 B to 256 KiB (docs/
multi-process.md has the figures), so one fixed-size collective beats a header and a payload.

Sampling needs no broadcast: the step's logits are replicated, so process 0 samples its own copy.

Failure: a collective with a dead peer fails fast (gloo sees the closed connection), and the
error is raised as `ProcessGroupError`, which names the process count. Process 0's engine then
cannot restart (its restart broadcasts a reset, which fails again), so it is marked dead and the
server exits 1; an idle process 0 finds the loss through its keepalive and exits 1; followers
exit 1 with the error. Such exits skip JAX's shutdown barrier, which a lost process never
reaches. A process that stops sending JAX's heartbeats for `heartbeat_timeout_seconds` is
declared dead by JAX's coordination service, which terminates every other process of the run
with its own message: nothing waits forever.
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jserve.runtime.model_runner import ModelRunner
from jserve.runtime.step_inputs import StepInputs

log = logging.getLogger(__name__)

HEADER_LEN = 4  # kind, token bucket, sequence bucket, payload length
# Process 0 broadcasts a no-op when it has been idle this long, so the others never sit in one
# collective for long and a lost peer is found while idle, not at the next request.
KEEPALIVE_SECONDS = 5.0


class Message(enum.IntEnum):
    STEP = 1  # run the model step of these inputs
    RESET = 2  # re-make the KV pool (process 0 restarted its engine)
    STOP = 3  # process 0 is shutting down: exit cleanly
    KEEPALIVE = 4  # nothing to run


class ProcessGroupError(RuntimeError):
    """A collective of the multi-process run failed: a process is gone or unreachable."""


def initialize(coordinator_address: str | None, num_processes: int, process_id: int) -> None:
    """Join a run of `num_processes` processes (JAX's names) before any other JAX call (a
    process that must use JAX first, e.g. to load a model, calls this first itself)."""
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id must be in [0, num_processes={num_processes}), got {process_id}"
        )
    if num_processes == 1 or jax.distributed.is_initialized():
        return
    if not coordinator_address:
        raise ValueError(
            "a multi-process run needs --coordinator-address HOST:PORT (process 0's host and a "
            "free port, the same on every process)"
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption notifier would take SIGTERM, which the server needs to drain.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
    log.info(
        "process %d of %d joined %s: %d local of %d devices",
        process_id, num_processes, coordinator_address, jax.local_device_count(),
        jax.device_count(),
    )  # fmt: skip


_FIELDS = [f.name for f in dataclasses.fields(StepInputs) if not f.metadata.get("static")]


class StepChannel:
    """Process 0's step messages to every other process, over one precompiled broadcast.

    Args:
        example_inputs: StepInputs of a bucket (shapes only are read), as for precompiling.
        pairs: every (token bucket, sequence bucket) a step may have.
    """

    def __init__(
        self,
        example_inputs: Callable[[int, int], StepInputs],
        pairs: list[tuple[int, int]],
    ) -> None:
        self.num_processes = jax.process_count()
        devices = np.array(jax.devices()).reshape(self.num_processes, jax.local_device_count())
        mesh = Mesh(devices, ("processes", "local"))
        self._rows = NamedSharding(mesh, PartitionSpec("processes"))
        replicated = NamedSharding(mesh, PartitionSpec())
        self._shapes = {
            pair: {name: getattr(example_inputs(*pair), name).shape for name in _FIELDS}
            for pair in pairs
        }
        largest = max(
            sum(math.prod(s) for s in shapes.values()) for shapes in self._shapes.values()
        )
        self.message_len = HEADER_LEN + largest
        total = jax.jit(lambda rows: jnp.sum(rows, axis=0), out_shardings=replicated)
        self._broadcast_exe = total.lower(
            jax.ShapeDtypeStruct(
                (self.num_processes, self.message_len), jnp.int32, sharding=self._rows
            )
        ).compile()
        # Held across a message and the computation it announces, so a keepalive from another
        # thread can never slip between them (every process must launch the same sequence).
        self.lock = threading.RLock()
        self.last_sent = time.monotonic()
        self.steps_sent = 0  # STEP messages, and the wall seconds process 0 spent sending them
        self.step_send_seconds = 0.0
        self.error: ProcessGroupError | None = None
        atexit.register(self._exit_if_broken)  # runs before JAX's handler (registered earlier)

    def _exit_if_broken(self) -> None:
        """After a lost process, exit now: JAX's own exit handler would wait at a shutdown
        barrier the lost process never reaches, until its heartbeat timeout aborts this one."""
        if self.error is not None:
            exit_now(1)

    def _broadcast(self, message: np.ndarray) -> np.ndarray:
        rows = jax.make_array_from_process_local_data(self._rows, message[None])
        try:
            return np.asarray(self._broadcast_exe(rows).addressable_data(0))
        except Exception as e:  # gloo's failures arrive as JaxRuntimeError or ValueError
            self.error = ProcessGroupError(
                f"a broadcast to the run's {self.num_processes} processes failed: a process is "
                f"gone or unreachable, and the run cannot go on without it ({e})"
            )
            raise self.error from e

    # ---- process 0 -----------------------------------------------------------------------

    def send(self, kind: Message, inputs: StepInputs | None = None) -> None:
        """Broadcast one message (process 0); raises ProcessGroupError once a peer is lost."""
        if self.error is not None:
            raise self.error
        with self.lock:
            start = time.perf_counter()
            message = np.zeros(self.message_len, np.int32)
            message[0] = kind
            if inputs is not None:
                message[1:3] = inputs.num_tokens, inputs.max_seqs
                offset = HEADER_LEN
                for name in _FIELDS:
                    flat = np.ravel(getattr(inputs, name))
                    message[offset : offset + flat.size] = flat
                    offset += flat.size
                message[3] = offset - HEADER_LEN
            self._broadcast(message)
            self.last_sent = time.monotonic()
            if kind is Message.STEP:
                self.steps_sent += 1
                self.step_send_seconds += time.perf_counter() - start

    # ---- every other process -------------------------------------------------------------

    def receive(self) -> tuple[Message, StepInputs | None]:
        """The next message from process 0 (blocks until it is sent)."""
        message = self._broadcast(np.zeros(self.message_len, np.int32))
        kind, t, s, n = (int(x) for x in message[:HEADER_LEN])
        if n == 0:
            return Message(kind), None
        fields, offset = {}, HEADER_LEN
        for name, shape in self._shapes[(t, s)].items():
            size = math.prod(shape)
            fields[name] = message[offset : offset + size].reshape(shape)
            offset += size
        return Message(kind), StepInputs(**fields, num_tokens=t, max_seqs=s)


def exit_now(code: int) -> None:
    """Flush what was logged and printed, then end the process at once."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class LeaderRunner(ModelRunner):
    """Process 0's runner: announces each device computation to the others, then runs it.

    The channel opens once every process has built and precompiled the same runner; until then
    (construction, precompilation) nothing is announced, as every process does the same.
    """

    channel: StepChannel | None = None
    _stopped = False

    def precompile(
        self, example_inputs: Callable[[int, int], StepInputs], pairs: list[tuple[int, int]]
    ) -> float:
        seconds = super().precompile(example_inputs, pairs)
        start = time.perf_counter()
        self.channel = StepChannel(example_inputs, pairs)
        self.channel.send(Message.KEEPALIVE)  # returns once every process follows: ready
        log.info("all %d processes follow process 0", self.channel.num_processes)
        threading.Thread(target=self._keepalive, name="jserve-keepalive", daemon=True).start()
        atexit.register(self.stop)  # runs before JAX's own exit handler (registered earlier)
        return seconds + time.perf_counter() - start

    def run(self, inputs: StepInputs) -> jax.Array:
        if self.channel is None:
            return super().run(inputs)
        with self.channel.lock:
            self.channel.send(Message.STEP, inputs)
            return super().run(inputs)

    def reset_kv_cache(self) -> None:
        if self.channel is None:
            return super().reset_kv_cache()
        with self.channel.lock:
            self.channel.send(Message.RESET)
            super().reset_kv_cache()

    def stop(self) -> None:
        """Tell the others to exit (at process exit); a lost peer only logs."""
        channel = self.channel
        if channel is None:
            return
        with channel.lock:
            self._stopped = True
            if channel.error is None:
                try:
                    channel.send(Message.STOP)
                except ProcessGroupError as e:
                    log.warning("could not tell the other processes to stop: %s", e)

    def _keepalive(self) -> None:
        channel = self.channel
        while True:
            time.sleep(KEEPALIVE_SECONDS / 4)
            with channel.lock:
                if self._stopped or channel.error is not None:
                    return
                if time.monotonic() - channel.last_sent < KEEPALIVE_SECONDS:
                    continue
                try:
                    channel.send(Message.KEEPALIVE)
                except ProcessGroupError as e:  # idle, so no request is lost: stop the server
                    log.error("%s; process 0 exits", e)
                    exit_now(1)


def follow(runner: ModelRunner, channel: StepChannel) -> int:
    """Run process 0's steps on this process's share of the mesh until it says stop.

    Returns the exit code: 0 after STOP, 1 when the run lost a process.
    """
    steps = 0
    try:
        while True:
            kind, inputs = channel.receive()
            if kind is Message.STEP:
                runner.run(inputs)
                steps += 1
            elif kind is Message.RESET:
                runner.reset_kv_cache()
            elif kind is Message.STOP:
                log.info("process 0 stopped the run after %d steps", steps)
                return 0
    except ProcessGroupError as e:
        log.error("process %d stops after %d steps: %s", jax.process_index(), steps, e)
        return 1
