"""What the server itself counted during a run, from its Prometheus /metrics (before and after).

jserve (`jserve:`), vLLM (`vllm:`) and SGLang (`sglang:`) all export an iteration-tokens
histogram, so the number of engine steps and the tokens per step come out the same way for
each; dividing the run's wall time by the steps gives an upper bound of the time per step.
A server without /metrics just yields an empty dict.

On a shared machine wall times move with everyone else's load; the CPU seconds a local server's
process tree spent (`--server-pid`, from /proc) move much less, so CPU ms per token compares
two servers' work even when their runs saw different loads.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

import aiohttp

_SAMPLE = re.compile(r"^((?:jserve|vllm|sglang):[A-Za-z0-9_:]+?)(?:\{[^}]*\})?\s+(\S+)$")
_CUMULATIVE = ("_total", "_count", "_sum")


async def scrape(base_url: str) -> dict[str, float]:
    """Cumulative series (counters, histogram counts and sums) summed over their labels."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.get(base_url + "/metrics") as resp,
        ):
            if resp.status != 200:
                return {}
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    return parse_cumulative(text)


def parse_cumulative(text: str) -> dict[str, float]:
    """Prometheus text -> {series name: value summed over labels}, cumulative series only."""
    totals: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match[1].endswith(_CUMULATIVE):
            try:
                totals[match[1]] += float(match[2])
            except ValueError:
                continue
    return dict(totals)


def run_stats(before: dict[str, float], after: dict[str, float], duration: float) -> dict:
    """Deltas of every cumulative series, plus engine steps, tokens/step and wall ms/step."""
    deltas = {k: v - before.get(k, 0.0) for k, v in sorted(after.items())}
    deltas = {k: v for k, v in deltas.items() if v}
    stats: dict = {"deltas": deltas}
    steps = next((v for k, v in deltas.items() if "iteration_tokens" in k and k.endswith("_count")),
                 0.0)  # fmt: skip
    tokens = next((v for k, v in deltas.items() if "iteration_tokens" in k and k.endswith("_sum")),
                  0.0)  # fmt: skip
    if steps:
        stats.update(engine_steps=int(steps), tokens_per_step=tokens / steps,
                     wall_ms_per_step=duration * 1000.0 / steps)  # fmt: skip
    return stats


def _stat_fields(stat_path: Path) -> list[str] | None:
    try:
        text = stat_path.read_text()
    except OSError:  # the process ended meanwhile
        return None
    return text[text.rindex(")") + 2 :].split()  # fields from 3 (state) on; comm may hold spaces


def process_tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and all its live descendants (Linux /proc)."""
    if not Path(f"/proc/{pid}").exists():
        raise ValueError(f"no process {pid}: pass the server's own pid as --server-pid")
    children: dict[int, list[int]] = defaultdict(list)
    times: dict[int, float] = {}
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat_path)
        if fields is not None:
            child = int(stat_path.parent.name)
            children[int(fields[1])].append(child)  # field 4: ppid
            times[child] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        total += times.get(current, 0.0)
        stack.extend(children.get(current, []))
    return total
