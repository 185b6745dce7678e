"""Serving benchmark: throughput, TTFT and TPOT of any OpenAI-compatible endpoint over a concurrency sweep.

    python benchmarks/bench_serve.py --base-url http://127.0.0.1:8080/v1 [--model NAME]
        [--input-words 150] [--output-tokens 48] [--num-requests 32] [--concurrency 1,2,4,8,16]
        [--shared-prefix WORDS] [--endpoint completions|chat|messages] [--json FILE]
        [--structured free|json|both] [--json-schema FILE]

    # start the servers itself, one after the other, and compare them ({port} is filled in):
    python benchmarks/bench_serve.py --concurrency 1,16 \\
        --target mlx-infer="mlx-infer serve -m MODEL.gguf --port {port}" \\
        --target mlx-lm="mlx_lm.server --model BF16_FOLDER --port {port}"

Every concurrency level sends ``--num-requests`` streamed requests with prompts of fresh random words
(new words per level, so no prefix cache flatters a level), ``max_tokens`` = ``--output-tokens`` and
``ignore_eos`` (servers that know it generate exactly that many tokens; the table reports the mean they
did produce). ``--shared-prefix N`` starts every prompt of a level with the same N random words, to
measure prefix caching. ``--structured json`` constrains every request by a JSON schema
(``response_format``; a built-in one whose answers outgrow any ``--output-tokens``, or ``--json-schema``);
``both`` measures each level free and then constrained, against the same server. TTFT is the time to
the first streamed text, TPOT the time per output token after it; output tokens come from the server's
usage report, or the streamed chunk count without one.
``--endpoint messages`` drives Anthropic's ``/v1/messages`` stream (text from its ``text_delta`` events,
tokens from ``message_delta``'s usage); ``--endpoint chat,messages`` measures each level on both in turn,
against the same server, with prompts of the same shape (fresh words, so no prefix cache favours one).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

# Short, common words: each is one token or two for most tokenizers, so words track tokens closely.
WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community "
    "name president team minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death experience effect "
    "class control care field development role effort rate heart drug show leader light voice wife police "
    "mind price report decision son view relationship town road arm difference value building action model "
    "season society tax director position player record paper space ground form event official matter "
    "river stone garden bridge forest island summer winter letter table street yellow"
).split()


@dataclass
class RequestResult:
    ok: bool
    ttft: float = math.nan  # seconds from sending to the first streamed text
    latency: float = math.nan  # seconds from sending to the end of the stream
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str = ""

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first."""
        if self.output_tokens < 2:
            return math.nan
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class LevelResult:
    target: str
    concurrency: int
    num_requests: int
    wall_seconds: float
    output_tokens: int
    errors: int
    ttft: dict[str, float] = field(default_factory=dict)  # p50/p90/p99 seconds
    tpot: dict[str, float] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)
    mean_output_tokens: float = 0.0
    mean_cached_tokens: float | None = None
    first_error: str = ""

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def requests_per_second(self) -> float:
        ok = self.num_requests - self.errors
        return ok / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "output_tokens_per_second": self.output_tokens_per_second,
            "requests_per_second": self.requests_per_second,
        }


# Every answer must list at least 40 short strings: longer than any --output-tokens run here, so a
# constrained request generates as many tokens as a free one.
BUILTIN_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "words": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 40},
    },
    "required": ["title", "words"],
}


# ---- prompts ------------------------------------------------------------------------------------
def random_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def level_prompts(seed: int, level: int, args: argparse.Namespace, mode: str = "free") -> list[str]:
    """The prompts of one concurrency level: the same for every target, new for every level and mode."""
    rng = random.Random(f"{seed}-{level}" + ("" if mode == "free" else f"-{mode}"))
    prefix = random_text(rng, args.shared_prefix) + "\n" if args.shared_prefix else ""
    return [prefix + random_text(rng, args.input_words) for _ in range(args.num_requests)]


# ---- one streamed request -----------------------------------------------------------------------
def request_body(args: argparse.Namespace, model: str, prompt: str, schema: dict | None = None) -> dict:
    body = {
        "model": model,
        "max_tokens": args.output_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    if args.endpoint in ("chat", "messages"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.endpoint == "messages":
        del body["stream_options"]  # Anthropic's stream always ends with its usage
    return body


ENDPOINT_PATHS = {"completions": "completions", "chat": "chat/completions", "messages": "messages"}


def _chunk_text(chunk: dict, endpoint: str) -> str:
    if endpoint == "messages":
        if chunk.get("type") != "content_block_delta":
            return ""
        return (chunk.get("delta") or {}).get("text") or ""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _chunk_usage(chunk: dict, endpoint: str) -> dict | None:
    """The chunk's usage in OpenAI's terms (Anthropic's message_delta carries the final counts)."""
    if endpoint != "messages":
        return chunk.get("usage")
    if chunk.get("type") != "message_delta":
        return None
    usage = chunk.get("usage") or {}
    return {
        "completion_tokens": usage.get("output_tokens"),
        "prompt_tokens_details": {"cached_tokens": usage.get("cache_read_input_tokens")},
    }


async def stream_one(client: httpx.AsyncClient, url: str, body: dict, endpoint: str) -> RequestResult:
    start = time.perf_counter()
    first = None
    chunks, usage = 0, None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"])[:200])
                if _chunk_text(chunk, endpoint):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
                usage = _chunk_usage(chunk, endpoint) or usage
                if chunk.get("type") == "message_stop":
                    break
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}"[:200])
    end = time.perf_counter()
    if first is None:
        return RequestResult(False, error="no text was streamed")
    tokens = usage.get("completion_tokens", chunks) if usage else chunks
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return RequestResult(True, first - start, end - start, tokens, cached)


# ---- one concurrency level ----------------------------------------------------------------------
def percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan}
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98]}


async def run_level(
    target: str,
    base_url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    args: argparse.Namespace,
    schema: dict | None = None,
) -> LevelResult:
    url = f"{base_url}/{ENDPOINT_PATHS[args.endpoint]}"
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=headers) as client:

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                body = request_body(args, model, prompt, schema)
                results.append(await stream_one(client, url, body, args.endpoint))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return LevelResult(
        target=target,
        concurrency=concurrency,
        num_requests=len(results),
        wall_seconds=wall,
        output_tokens=sum(r.output_tokens for r in ok),
        errors=len(results) - len(ok),
        ttft=percentiles([r.ttft for r in ok]),
        tpot=percentiles([r.tpot for r in ok]),
        latency=percentiles([r.latency for r in ok]),
        mean_output_tokens=statistics.fmean(r.output_tokens for r in ok) if ok else 0.0,
        mean_cached_tokens=statistics.fmean(cached) if cached else None,
        first_error=next((r.error for r in results if not r.ok), ""),
    )


async def discover_model(base_url: str, api_key: str | None) -> str | None:
    """The first model id /models lists, or None (mlx_lm.server, for one, lists none)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=30, headers=headers) as client:
            response = await client.get(f"{base_url}/models")
            response.raise_for_status()
            data = response.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return data[0].get("id") if data and isinstance(data[0], dict) else None


async def warm_up(base_url: str, model: str, args: argparse.Namespace) -> None:
    """One short request, so a lazily compiled or loaded server is not billed to the first level."""
    short = argparse.Namespace(**{**vars(args), "output_tokens": 4})
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers) as client:
        url = f"{base_url}/{ENDPOINT_PATHS[args.endpoint]}"
        await stream_one(client, url, request_body(short, model, "warm up"), args.endpoint)


# ---- launching servers --------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launched:
    """A server command started in a subprocess; its output goes to a log file shown if it fails."""

    def __init__(self, command: str, base_url: str, timeout: float, api_key: str | None):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-serve-", suffix=".log", delete=False)
        self.process = subprocess.Popen(shlex.split(command), stdout=self.log, stderr=subprocess.STDOUT)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"`{command}` exited with {self.process.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{base_url}/models", timeout=2, headers=headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"`{command}` did not answer {base_url}/models in {timeout:.0f} s")
            time.sleep(0.5)

    def tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        os.unlink(self.log.name)


@dataclass
class Target:
    name: str
    base_url: str
    command: str | None = None


def parse_targets(args: argparse.Namespace) -> list[Target]:
    if not args.target:
        return [Target(args.name, args.base_url.rstrip("/"), args.launch)]
    return targets_from_specs(args.target)


def targets_from_specs(specs: list[str]) -> list[Target]:
    """``NAME=COMMAND`` specs as targets on free local ports (``{port}`` in COMMAND filled in)."""
    targets = []
    for spec in specs:
        name, sep, command = spec.partition("=")
        if not sep or not name or not command:
            raise SystemExit(f"--target wants NAME=COMMAND, got {spec!r}")
        port = free_port()
        targets.append(Target(name, f"http://127.0.0.1:{port}/v1", command.replace("{port}", str(port))))
    return targets


# ---- reporting ----------------------------------------------------------------------------------
def print_table(console: Console, results: list[LevelResult], args: argparse.Namespace) -> None:
    table = Table(
        title=f"bench_serve: {args.num_requests} requests/level, {args.input_words}-word prompts"
        + (f" after a shared {args.shared_prefix}-word prefix" if args.shared_prefix else "")
        + f", {args.output_tokens} output tokens, /{' and /'.join(args.endpoints)}"
    )
    for column in (
        "target",
        "c",
        "out tok/s",
        "req/s",
        "TTFT p50/p90/p99 s",
        "TPOT p50/p90/p99 ms",
        "out tok/req",
        "cached tok/req",
        "errors",
    ):
        table.add_column(column, justify="left" if column == "target" else "right")
    for r in results:
        table.add_row(
            r.target,
            str(r.concurrency),
            f"{r.output_tokens_per_second:.1f}",
            f"{r.requests_per_second:.2f}",
            "/".join(f"{r.ttft[k]:.2f}" for k in ("p50", "p90", "p99")),
            "/".join(f"{r.tpot[k] * 1000:.0f}" for k in ("p50", "p90", "p99")),
            f"{r.mean_output_tokens:.1f}",
            "-" if r.mean_cached_tokens is None else f"{r.mean_cached_tokens:.0f}",
            str(r.errors) if not r.errors else f"[red]{r.errors}[/red]",
        )
    console.print(table)
    for r in results:
        if r.first_error:
            console.print(f"[red]{r.target} c={r.concurrency}: first error: {r.first_error}[/red]")


def print_ratios(console: Console, results: list[LevelResult]) -> None:
    """Each target against the first one, per concurrency level."""
    names = list(dict.fromkeys(r.target for r in results))
    if len(names) < 2:
        return
    by_key = {(r.target, r.concurrency): r for r in results}
    table = Table(title=f"{names[0]} against each target (above 1: {names[0]} is ahead)")
    for column in ("target", "c", f"{names[0]} tok/s ÷ target's", f"target's TTFT p50 ÷ {names[0]}'s"):
        table.add_column(column, justify="right")
    for name in names[1:]:
        for (target, c), r in by_key.items():
            base = by_key.get((names[0], c))
            if target != name or base is None:
                continue
            speed = (
                base.output_tokens_per_second / r.output_tokens_per_second
                if r.output_tokens_per_second
                else math.inf
            )
            ttft = r.ttft["p50"] / base.ttft["p50"] if base.ttft["p50"] else math.nan
            table.add_row(name, str(c), f"{speed:.2f}x", f"{ttft:.2f}x")
    console.print(table)


def print_structured_ratios(console: Console, results: list[LevelResult]) -> None:
    """Constrained throughput over free throughput, per target and level (``--structured both``)."""
    by_key = {(r.target, r.concurrency): r for r in results}
    for (name, c), r in by_key.items():
        free = by_key.get((name.removesuffix("+json"), c))
        if name.endswith("+json") and free is not None and free.output_tokens_per_second:
            ratio = r.output_tokens_per_second / free.output_tokens_per_second
            console.print(
                f"{free.target} c={c}: JSON-schema constrained {r.output_tokens_per_second:.1f} vs free "
                f"{free.output_tokens_per_second:.1f} output tok/s = {ratio:.2f}x"
            )


def write_json(
    path: Path, results: list[LevelResult], targets: list[Target], args: argparse.Namespace
) -> None:
    config = {k: v for k, v in vars(args).items() if k not in ("json", "api_key")}
    out = {
        "benchmark": "bench_serve",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
        },
        "config": config,
        "targets": [asdict(t) for t in targets],
        "results": [r.to_json() for r in results],
    }
    path.write_text(json.dumps(_json_safe(out), indent=2, allow_nan=False, default=str))


def _json_safe(value):
    """NaN (a percentile of no successful request) becomes null: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


# ---- main ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1", help="the endpoint's /v1 URL")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key, if the server wants one"
    )
    p.add_argument("--name", default="server", help="label of the --base-url target in the table")
    p.add_argument("--launch", default=None, metavar="CMD", help="start CMD first (it must serve --base-url)")
    p.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=CMD",
        help="a server to start and measure, '{port}' in CMD is replaced by a free port (repeatable)",
    )
    p.add_argument(
        "--endpoint",
        default="completions",
        help="completions, chat or messages; comma-separated to measure each level on each in turn "
        "(e.g. chat,messages; default: completions)",
    )
    p.add_argument("--input-words", type=int, default=150, help="random words per prompt (default: 150)")
    p.add_argument("--output-tokens", type=int, default=48, help="max_tokens, with ignore_eos (default: 48)")
    p.add_argument(
        "--num-requests", type=int, default=32, help="requests per concurrency level (default: 32)"
    )
    p.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated levels (default: 1,2,4,8,16)")
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="WORDS",
        help="every prompt of a level starts with the same WORDS random words (prefix caching)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--seed", type=int, default=None, help="prompt seed (default: random, so reruns miss caches)"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one request may take")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a launched server may take")
    p.add_argument("--no-warmup", action="store_true", help="skip the short request sent before each target")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument(
        "--structured",
        choices=("free", "json", "both"),
        default="free",
        help="constrain every request by a JSON schema (json), or measure each level both ways (both)",
    )
    p.add_argument(
        "--json-schema", type=Path, default=None, metavar="FILE", help="the schema (default: a built-in one)"
    )
    args = p.parse_args(argv)
    args.schema = json.loads(args.json_schema.read_text()) if args.json_schema else BUILTIN_SCHEMA
    args.modes = ["free", "json"] if args.structured == "both" else [args.structured]
    args.endpoints = [e.strip() for e in args.endpoint.split(",") if e.strip()]
    unknown = [e for e in args.endpoints if e not in ENDPOINT_PATHS]
    if unknown or not args.endpoints:
        p.error(f"--endpoint: choose from {', '.join(ENDPOINT_PATHS)}, not {', '.join(unknown) or 'nothing'}")
    args.endpoint = args.endpoints[0]
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not args.levels or min(args.levels) < 1 or args.num_requests < 1:
        p.error("--concurrency levels and --num-requests must be positive")
    if args.seed is None:
        args.seed = random.randrange(2**31)
    return args


async def measure_target(target: Target, args: argparse.Namespace, console: Console) -> list[LevelResult]:
    # mlx_lm.server answers for the model it was started with under the name "default_model".
    model = args.model or await discover_model(target.base_url, args.api_key) or "default_model"
    console.print(f"{target.name}: model {model!r}")
    if not args.no_warmup:
        await warm_up(target.base_url, model, args)
    results = []
    for level in args.levels:
        for endpoint, mode in itertools.product(args.endpoints, args.modes):
            name = target.name if mode == "free" else f"{target.name}+json"
            if endpoint != args.endpoints[0]:
                name += f" /{endpoint}"
            # Fresh words per endpoint too: the same prompt again would be served from the prefix cache.
            key = mode if endpoint == args.endpoints[0] else f"{mode}-{endpoint}"
            prompts = level_prompts(args.seed, level, args, key)
            schema = args.schema if mode == "json" else None
            endpoint_args = argparse.Namespace(**{**vars(args), "endpoint": endpoint})
            result = await run_level(name, target.base_url, model, prompts, level, endpoint_args, schema)
            console.print(
                f"{name} c={level}: {result.output_tokens_per_second:.1f} output tok/s, "
                f"TTFT p50 {result.ttft['p50']:.2f} s, TPOT p50 {result.tpot['p50'] * 1000:.0f} ms"
                + (f", {result.errors} errors" if result.errors else "")
            )
            results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=max(Console().width, 140))
    targets = parse_targets(args)
    results: list[LevelResult] = []
    for target in targets:
        server = None
        if target.command:
            console.print(f"starting {target.name}: {target.command}")
            server = Launched(target.command, target.base_url, args.startup_timeout, args.api_key)
        try:
            results.extend(asyncio.run(measure_target(target, args, console)))
        finally:
            if server is not None:
                server.stop()
    print_table(console, results, args)
    print_ratios(console, results)
    print_structured_ratios(console, results)
    if args.json:
        write_json(args.json, results, targets, args)
        console.print(f"wrote {args.json}")
    return 1 if any(r.errors == r.num_requests for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
