"""What the server itself counted during a run, from its Prometheus /metrics (before and after).

jserve (`jserve:`), vLLM (`vllm:`) and SGLang (`sglang:`) all export an iteration-tokens
histogram, so the number of engine steps and the tokens per step come out the same way for
each; dividing the run's wall time by the steps gives an upper bound of the time per step.
A server without /metrics just yields an empty dict.
"""

from __future__ import annotations

import re
from collections import defaultdict

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
