"""Serving-benchmark workloads: what each request asks for, built before the clock starts.

A workload is a list of `RequestSpec`s. Prompt lengths are in tokens of the *server's*
tokenizer: a seeded pool of English words is tokenized once with the server's /tokenize, and a
prompt of L tokens is the /detokenize of L consecutive pool tokens, so counts are exact up to
the merge at the edges. A server without those endpoints gets an estimate (`WORDS_PER_TOKEN`).
The same seed and tokenizer give the same prompts on every server (`workload_digest` proves it).

Kinds:
- synthetic: prompt and output lengths drawn from a `LengthDist` (constant, uniform, lognormal).
- shared-prefix: one long system prompt shared by every request, plus a distinct user turn.
- a JSONL file of {"prompt", "max_tokens"} lines (optional "group").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import numpy as np

WORDS_PER_TOKEN = 0.75  # common English words in a byte-level BPE: about 1.3 tokens per word
_POOL_WORDS = 6000
_COMMON_WORDS = (
    "the of and to in is was that for on are with as his they be at one have this from or had "
    "by hot word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low line "
    "differ turn cause much mean before move right boy old too same tell does set three want "
    "air well also play small end put home read hand port large spell add even land here must "
    "big high such follow act why ask men change went light kind off need house picture try us "
    "again animal point mother world near build self earth father head stand own page should "
    "country found answer school grow study still learn plant cover food sun four between state "
    "keep eye never last let thought city tree cross farm hard start might story saw far sea "
    "draw left late run while press close night real life few north open seem together next "
    "white children begin got walk example ease paper group always music those both mark often "
    "letter until mile river car feet care second book carry took science eat room friend began "
    "idea fish mountain stop once base hear horse cut sure watch color face wood main enough"
)


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    Attributes:
        prompt: the user text (the whole prompt on /v1/completions).
        max_tokens: output tokens asked for (with ignore_eos, exactly what is generated).
        system: a system prompt sent before `prompt` (shared-prefix workload), or None.
        group: a label; metrics are also reported per group.
        arrival_s: send time in seconds after the start, or None to follow the arrival process.
        tenant: sent as the OpenAI `user` field (jserve's tenant), or None for none.
    """

    prompt: str
    max_tokens: int
    system: str | None = None
    group: str = "all"
    arrival_s: float | None = None
    tenant: str | None = None


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


class TextMaker:
    """Text of a given length in the server's tokens (see the module docstring)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, seed: int) -> None:
        self.session, self.base_url = session, base_url.rstrip("/")
        self.rng = np.random.default_rng(seed)
        words = self.rng.choice(_COMMON_WORDS.split(), size=_POOL_WORDS)
        self.pool_text = " ".join(str(w) for w in words)
        self.pool_ids: list[int] | None = None
        self.exact = False

    async def _post(self, path: str, body: dict) -> dict | None:
        try:
            async with self.session.post(self.base_url + path, json=body) as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, json.JSONDecodeError):
            return None

    async def setup(self) -> None:
        tokenized = await self._post("/tokenize", {"prompt": self.pool_text})
        if tokenized and isinstance(tokenized.get("tokens"), list):
            self.pool_ids = tokenized["tokens"]
            probe = await self._post("/detokenize", {"tokens": self.pool_ids[:8]})
            self.exact = bool(probe and isinstance(probe.get("prompt"), str))

    async def text(self, num_tokens: int) -> str:
        if self.exact and self.pool_ids:
            start = int(self.rng.integers(0, len(self.pool_ids)))
            reps = (start + num_tokens) // len(self.pool_ids) + 1
            ids = (self.pool_ids * reps)[start : start + num_tokens]
            result = await self._post("/detokenize", {"tokens": ids})
            if result is not None:
                return result["prompt"]
        words = self.pool_text.split()
        start = int(self.rng.integers(0, len(words)))
        count = max(1, round(num_tokens * WORDS_PER_TOKEN))
        return " ".join((words * (count // len(words) + 2))[start : start + count])


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", choices=["synthetic", "shared-prefix"], default="synthetic")
    group.add_argument("--dataset", default=None, help="JSONL of {prompt, max_tokens} (overrides)")
    group.add_argument("--num-requests", type=int, default=64)
    group.add_argument("--prompt-len", default="lognormal:128:0.8:1024", help="LengthDist")
    group.add_argument("--output-len", default="lognormal:64:1.0:512", help="LengthDist")
    group.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix system tokens")
    group.add_argument("--seed", type=int, default=0)


async def build_workload(
    args: argparse.Namespace, session: aiohttp.ClientSession, base_url: str
) -> tuple[list[RequestSpec], bool]:
    """The workload the arguments describe, and whether its token counts are exact."""
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.dataset:
        return load_dataset(Path(args.dataset), args.num_requests), True
    rng = np.random.default_rng(args.seed)
    maker = TextMaker(session, base_url, args.seed)
    await maker.setup()
    prompt_lens = LengthDist.parse(args.prompt_len).sample(rng, args.num_requests)
    output_lens = LengthDist.parse(args.output_len).sample(rng, args.num_requests)
    system = await maker.text(args.prefix_len) if args.workload == "shared-prefix" else None
    specs = [
        RequestSpec(await maker.text(p), o, system=system)
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]
    return specs, maker.exact


def load_dataset(path: Path, limit: int) -> list[RequestSpec]:
    specs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("max_tokens"), int):
            raise ValueError(
                f"{path}:{number}: each line needs 'prompt' (string) and 'max_tokens' (integer)"
            )
        specs.append(RequestSpec(row["prompt"], row["max_tokens"], group=row.get("group", "all")))
        if len(specs) == limit:
            break
    if not specs:
        raise ValueError(f"{path} holds no requests")
    return specs


def workload_digest(specs: list[RequestSpec]) -> str:
    """sha256 of the requests, so two runs can show they sent the same workload."""
    blob = json.dumps([asdict(s) for s in specs], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
