"""What the simulator replays: requests with an arrival time, lengths in tokens, a tenant.

A workload is synthetic (Poisson arrivals, tenants drawn by share, lengths from a `LengthDist`)
or a JSONL file of {"arrival_s", "prompt_tokens", "max_tokens", "tenant", "lane", "timeout"}
(the last three optional).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: "N" (constant), "uniform:LO:HI" or "lognormal:MEDIAN:SIGMA[:MAX]"."""

    kind: str
    a: float
    b: float = 0.0
    cap: int = 0

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        parts = text.split(":")
        try:
            if len(parts) == 1:
                dist = cls("constant", int(parts[0]))
            elif parts[0] == "uniform" and len(parts) == 3:
                dist = cls("uniform", int(parts[1]), int(parts[2]))
            elif parts[0] == "lognormal" and len(parts) in (3, 4):
                median, sigma = float(parts[1]), float(parts[2])
                cap = int(parts[3]) if len(parts) == 4 else int(8 * median)
                dist = cls("lognormal", median, sigma, cap)
            else:
                raise ValueError(text)
        except ValueError:
            raise ValueError(
                f"bad length distribution {text!r}: use N, uniform:LO:HI or "
                "lognormal:MEDIAN:SIGMA[:MAX]"
            ) from None
        if dist.a < 1 or dist.b < 0 or (dist.kind == "uniform" and dist.b < dist.a):
            raise ValueError(
                f"bad length distribution {text!r}: N, LO and MEDIAN must be >= 1, LO <= HI, "
                "SIGMA >= 0"
            )
        if dist.kind == "lognormal" and dist.cap < 1:
            raise ValueError(f"bad length distribution {text!r}: MAX must be >= 1")
        return dist

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "constant":
            return [int(self.a)] * n
        if self.kind == "uniform":
            return [int(x) for x in rng.integers(int(self.a), int(self.b) + 1, size=n)]
        draws = rng.lognormal(math.log(self.a), self.b, size=n)
        return [int(x) for x in np.clip(np.rint(draws), 1, self.cap)]


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    tenant: str = "default"
    lane: str = "interactive"
    timeout: float | None = None


def synthetic(
    num_requests: int,
    rate: float,
    prompt_len: str,
    output_len: str,
    tenant_shares: dict[str, float],
    seed: int = 0,
    lane: str = "interactive",
    timeout: float | None = None,
    timeout_fraction: float = 0.0,
) -> list[SimRequest]:
    """Poisson arrivals at `rate` req/s (inf: all at 0), tenants drawn by share; a
    `timeout_fraction` of the requests (drawn at random) carry `timeout`."""
    if num_requests < 1:
        raise ValueError(f"the number of requests must be >= 1, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0 (inf: all at once), got {rate}")
    rng = np.random.default_rng(seed)
    prompts = LengthDist.parse(prompt_len).sample(rng, num_requests)
    outputs = LengthDist.parse(output_len).sample(rng, num_requests)
    names = list(tenant_shares)
    weights = np.array([tenant_shares[n] for n in names], float)
    tenants = rng.choice(len(names), size=num_requests, p=weights / weights.sum())
    gaps = np.zeros(num_requests) if math.isinf(rate) else rng.exponential(1 / rate, num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    with_deadline = rng.random(num_requests) < timeout_fraction
    return [
        SimRequest(
            float(arrivals[i]),
            prompts[i],
            outputs[i],
            names[tenants[i]],
            lane,
            timeout if with_deadline[i] else None,
        )
        for i in range(num_requests)
    ]


def parse_tenant_shares(text: str) -> dict[str, float]:
    """Tenant shares from "NAME:SHARE,..." (a missing share is 1)."""
    shares = {}
    for item in text.split(","):
        name, _, share = item.partition(":")
        try:
            shares[name] = float(share or 1)
        except ValueError:
            raise ValueError(f"bad tenant share {item!r}: use NAME:SHARE,...") from None
        if not name or not shares[name] > 0:
            raise ValueError(f"bad tenant share {item!r}: a name and a share > 0")
    return shares


def load_jsonl(path: str) -> list[SimRequest]:
    out = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(
                SimRequest(
                    float(row["arrival_s"]),
                    int(row["prompt_tokens"]),
                    int(row["max_tokens"]),
                    str(row.get("tenant", "default")),
                    str(row.get("lane", "interactive")),
                    None if row.get("timeout") is None else float(row["timeout"]),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: {type(exc).__name__}: {exc}") from None
    if not out:
        raise ValueError(f"{path} holds no requests")
    return out
