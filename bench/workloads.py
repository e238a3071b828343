"""Every benchmark's workloads, built before any clock starts: what each request asks for.

Serving workloads (bench.serve, bench.serve_compare and its presets, bench.load_curve,
bench.router_bench) are lists of `RequestSpec`s of text. Prompt lengths are in tokens of the
*server's* tokenizer: a seeded pool of English words is tokenized once with the server's
/tokenize, and a prompt of L tokens is the /detokenize of L consecutive pool tokens, so counts
are exact up to the merge at the edges. A server without those endpoints gets an estimate
(`WORDS_PER_TOKEN`). The same seed and tokenizer give the same prompts on every server
(`workload_digest` proves it). Kinds:
- synthetic: prompt and output lengths drawn from a `LengthDist` (constant, uniform, lognormal);
- shared-prefix: one long system prompt shared by every request, plus a distinct user turn;
- a JSONL file of {"prompt", "max_tokens"} lines (optional "group");
- the serving presets' own (`varying_lengths`, `shared_prefix`, ... below).

Engine workloads (bench.offline, bench.bucket_costs, bench.roofline, bench.peer_compare) are
token ids: `make_workload` slices real English prose (`text_token_pool`) at log-normal
lengths, and `peer_workloads` draws ids from the vocabulary (random, shared-prefix, batch-1),
identical for jserve and its peer.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import numpy as np

from jserve.sampling_params import SamplingParams
from jserve.simulate.workload import LengthDist

if TYPE_CHECKING:
    from jserve.engine.llm_engine import LLMEngine

# ---- serving: text of a given length in the server's tokens ---------------------------------

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


# Sizes of the serving workloads: bench.serve's --smoke, bench.load_curve's sweep (short,
# narrow lengths: a long-tailed mix would bury the queueing signal in its noise) and its smoke,
# and the online half of bench.peer_compare (its flags to bench.serve).
SERVE_SMOKE = {"num_requests": 8, "prompt_len": "uniform:8:48", "output_len": "uniform:4:24",
               "prefix_len": 64}  # fmt: skip
LATENCY_CURVE = {"num_requests": 40, "prompt_len": "uniform:32:96", "output_len": "uniform:16:48"}
LATENCY_CURVE_SMOKE = {
    "num_requests": 8,
    "prompt_len": "uniform:8:32",
    "output_len": "uniform:4:24",
}
PEER_ONLINE = [
    "--num-requests", "64", "--prompt-len", "lognormal:128:0.8:1024",
    "--output-len", "lognormal:64:1.0:512", "--seed", "0",
]  # fmt: skip


# ---- serving presets (bench.serve_presets): each a full size and a tiny smoke size -----------

WorkloadBuilder = Callable[[TextMaker, np.random.Generator, bool], Awaitable[list[RequestSpec]]]


async def preset_workload(
    build: WorkloadBuilder, base_url: str, text_seed: int, order_seed: int, smoke: bool
) -> list[RequestSpec]:
    """A preset's workload in a server's tokens: texts from `text_seed`, lengths and order from
    `order_seed` (bench.router_bench gives each side its own texts, so no side's cached blocks
    are another's hits, and the same order, so sides differ only in routing)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        maker = TextMaker(session, base_url, text_seed)
        await maker.setup()
        return await build(maker, np.random.default_rng(order_seed), smoke)


async def _specs(
    maker: TextMaker, rng: np.random.Generator, n: int, prompt: str, output: str, **kw: object
) -> list[RequestSpec]:
    prompt_lens = LengthDist.parse(prompt).sample(rng, n)
    output_lens = LengthDist.parse(output).sample(rng, n)
    return [
        RequestSpec(await maker.text(p), o, **kw)  # type: ignore[arg-type]
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


async def varying_lengths(maker: TextMaker, rng: np.random.Generator, smoke: bool) -> list:
    """All at once, six times the sequence cap; short prompts and log-normal output lengths with
    a long tail (median 24, a few past 200: what static batching hates)."""
    if smoke:
        return await _specs(maker, rng, 12, "uniform:8:32", "uniform:2:40")
    return await _specs(maker, rng, 96, "lognormal:32:0.5:256", "lognormal:24:1.2:256")


async def shared_prefix(maker: TextMaker, rng: np.random.Generator, smoke: bool) -> list:
    """One long system prompt, short distinct user turns, short answers."""
    n, prefix_len, user, output = (8, 96, "8", "4") if smoke else (24, 1024, "32", "16")
    system = await maker.text(prefix_len)
    return await _specs(maker, rng, n, user, output, system=system)


async def decodes_then_long_prompts(
    maker: TextMaker, rng: np.random.Generator, smoke: bool
) -> list:
    """Group "decode": short prompts with long outputs, all sent at t=0. Group "prefill": long
    prompts with tiny outputs arriving one by one while those decodes run."""
    if smoke:
        decode_n, decode_out, prefill_n, prefill_len, gap = 4, "60", 2, "100", 0.2
    else:
        decode_n, decode_out, prefill_n, prefill_len, gap = 8, "160", 4, "1536", 4.0
    decodes = await _specs(maker, rng, decode_n, "32", decode_out, group="decode", arrival_s=0.0)
    prefills = [
        RequestSpec(s.prompt, s.max_tokens, group="prefill", arrival_s=gap * (i + 1))
        for i, s in enumerate(await _specs(maker, rng, prefill_n, prefill_len, "4"))
    ]
    return decodes + prefills


async def flood_then_light_tenant(maker: TextMaker, rng: np.random.Generator, smoke: bool) -> list:
    """Tenant A floods the queue with four times tenant B's requests at t=0 and stays
    backlogged behind the sequence cap; B's arrive one every `gap` seconds from t=0.5, about
    1.4x the half of the engine that is B's fair share (4 sequences serve about 2 of these
    requests a second on a 2-core CPU), so B keeps a queue too. Groups and tenants are "A"
    and "B".

    B's requests arrive over time, not all at once: a burst of B's gets, with equal weights,
    at best every other free slot, so its last request still waits for about twice its
    burst's admissions, which caps the p99 gain near 2.3x whatever the policy. B's 40 keep
    both tenants waiting for about 28 s: long against what fair share may let a tenant's
    admitted requests run ahead (4 sequences' worth, jserve.core.fairness), so B's share of
    the tokens served meanwhile shows the policy, not that allowance."""
    heavy, light, gap = (8, 2, 0.05) if smoke else (160, 40, 0.7)
    a = await _specs(maker, rng, heavy, "uniform:48:96", "32", group="A", arrival_s=0.0)
    b = await _specs(maker, rng, light, "uniform:48:96", "32", group="B")
    return [RequestSpec(s.prompt, s.max_tokens, group=s.group, tenant=s.group,
                        arrival_s=0.0 if s.group == "A" else 0.5 + gap * (i - heavy))
            for i, s in enumerate(a + b)]  # fmt: skip


async def tenants(
    maker: TextMaker, rng: np.random.Generator, n: int, num_systems: int, system_len: int,
    user_len: int, output_len: int,
) -> list[RequestSpec]:  # fmt: skip
    """`n` requests, each with one of `num_systems` system prompts (its tenant's) and its own
    user turn, in a seeded random order (an order that alternated tenants would let round
    robin partition them by parity, which no real traffic does)."""
    systems = [await maker.text(system_len) for _ in range(num_systems)]
    owners = rng.permutation(np.arange(n) % num_systems)
    return [RequestSpec(await maker.text(user_len), output_len, system=systems[int(o)],
                        tenant=f"tenant{int(o)}") for o in owners]  # fmt: skip


async def shared_system_prompts(maker: TextMaker, rng: np.random.Generator, smoke: bool) -> list:
    """8 tenants' system prompts of 512 tokens (32 blocks; a replica's KV pool holds about 4
    of them besides its running requests), 128 requests with their own 32-token user turns and
    16-token answers (16 a tenant, so the 8 first requests, which no router can place on a
    cached prompt, are a sixteenth of the run)."""
    if smoke:
        return await tenants(maker, rng, 12, 4, 64, 8, 20)
    return await tenants(maker, rng, 128, 8, 512, 32, 16)


# ---- engines: token ids --------------------------------------------------------------------

# bench.offline's workload (also run by bench.bucket_costs): prompt_len / output_len are
# (median, min, max) of a log-normal with sigma 1.
OFFLINE_WORKLOAD = {"num_requests": 64, "prompt_len": (80, 10, 500), "output_len": (48, 4, 256)}
OFFLINE_WORKLOAD_SMOKE = {"num_requests": 8, "prompt_len": (20, 10, 40), "output_len": (8, 4, 16)}
# The engine sizes of the smoke modes (bench.offline, bench.peer_compare): the test suite's
# (tests/shared_engine.py), whose compiled steps a test run's compilation cache already holds.
SMOKE_ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 512,
                "num_kv_blocks": 49}  # fmt: skip
TEXT_MODULES = ("argparse", "collections", "dataclasses", "functools", "json", "logging",
                "pathlib", "statistics", "textwrap", "threading")  # fmt: skip


@dataclass
class Workload:
    """Token-id prompts and how many tokens each request generates (greedy, EOS ignored)."""

    prompts: list[list[int]]
    output_lens: list[int]


def text_token_pool(tokenizer) -> list[int]:
    """Real English prose that is the same on every run: some standard-library docstrings."""
    docs = []
    for name in TEXT_MODULES:
        module = importlib.import_module(name)
        docs.append(inspect.getdoc(module))
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            is_documented = inspect.isclass(obj) or inspect.isfunction(obj)
            if is_documented and getattr(obj, "__module__", None) == name:
                docs.append(inspect.getdoc(obj))
    return tokenizer.encode("\n\n".join(d for d in docs if d), add_special_tokens=False)


def lognormal_lengths(rng, n: int, spec: tuple[int, int, int]) -> list[int]:
    """`n` lengths, log-normal around `median` (sigma 1), clipped to [lo, hi]."""
    median, lo, hi = spec
    draws = rng.lognormal(math.log(median), 1.0, size=n)
    return [int(x) for x in np.clip(np.rint(draws), lo, hi)]


def make_workload(pool: list[int], n: int, prompt_len, output_len, seed: int) -> Workload:
    """Prompts are slices of the text pool at random offsets, of log-normal token lengths."""
    rng = np.random.default_rng(seed)
    lens = lognormal_lengths(rng, n, prompt_len)
    starts = [int(rng.integers(0, len(pool) - length)) for length in lens]
    prompts = [pool[s : s + length] for s, length in zip(starts, lens, strict=True)]
    return Workload(prompts, lognormal_lengths(rng, n, output_len))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def add_requests(engine: LLMEngine, workload: Workload) -> None:
    """Queue the workload; request ids are the indices "0", "1", ..."""
    for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy(out_len))


VOCAB_SIZE = 49_152  # SmolLM2's; ids below FIRST_TEXT_ID are control tokens
FIRST_TEXT_ID = 17


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(FIRST_TEXT_ID, VOCAB_SIZE, n).tolist()


def peer_workloads(smoke: bool, seed: int = 0) -> list[dict]:
    """bench.peer_compare's offline workloads, as JSON-able dicts both engines read:
    - random: 64 requests, prompts 16-512 and outputs 8-256 tokens (uniform, seeded);
    - shared-prefix: 32 requests of one 384-token prefix plus 32 own tokens, 64 outputs each;
    - batch-1: one 32-token prompt, 128 output tokens.
    Smoke: every count and length an eighth (batch-1's prompt stays 32 tokens)."""
    rng = np.random.default_rng(seed)
    scale = 8 if smoke else 1
    random_requests = [
        {"prompt_token_ids": _ids(rng, int(p)), "max_tokens": int(o)}
        for p, o in zip(
            rng.integers(16, 513, 64 // scale) // scale,
            rng.integers(8, 257, 64 // scale) // scale,
            strict=True,
        )
    ]
    prefix = _ids(rng, 384 // scale)
    shared = [
        {"prompt_token_ids": prefix + _ids(rng, 32 // scale), "max_tokens": 64 // scale}
        for _ in range(32 // scale)
    ]
    single = [{"prompt_token_ids": _ids(rng, 32), "max_tokens": 128 // scale}]
    return [
        {"name": "random", "requests": random_requests},
        {"name": "shared-prefix", "requests": shared},
        {"name": "batch-1", "requests": single},
    ]


def quant_workloads(smoke: bool, seed: int = 0) -> list[dict]:
    """bench.quant_compare's offline workloads (in peer_workloads' form):
    - batch-1: peer_workloads' (one 32-token prompt, 128 output tokens);
    - 32-seqs: 32 requests of their own 32-token prompt and 128 output tokens, all at once.
    Smoke: outputs an eighth, 4 requests."""
    rng = np.random.default_rng(seed)
    scale = 8 if smoke else 1
    many = [
        {"prompt_token_ids": _ids(rng, 32), "max_tokens": 128 // scale} for _ in range(32 // scale)
    ]
    [single] = [w for w in peer_workloads(smoke, seed) if w["name"] == "batch-1"]
    return [single, {"name": "32-seqs", "requests": many}]
