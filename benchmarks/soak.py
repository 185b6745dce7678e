"""Soak test: valid requests at concurrency 16 interleaved with hostile ones, round after round.

Each round sends ``--concurrency`` valid chat requests (streamed and not, greedy) at once, together with
``--hostile`` hostile ones of seven kinds (bad fields, a body over the size limit, a 10,000-deep nested
body, non-UTF-8, a truncated body, a client that leaves mid-stream, a slow reader). Every valid answer
must equal the same prompt's solo answer, no hostile request may get a 5xx, the server's resident memory
after the last round must stay within 10% of after the first, and when the server is idle again its KV
blocks and request tables must be back to where they started.

    python benchmarks/soak.py --mlx-infer MODEL.gguf --llama-server /path/to/llama-server --rounds 20

runs both servers on the same GGUF, one after the other, and prints their figures side by side; the
exit status is 1 if mlx-infer misses a criterion (llama-server's figures are reported, not judged).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about rain.",
    "Why is the sky blue?",
    "What is a noun?",
    "Suggest a name for a dog.",
    "What do bees make?",
    "Explain gravity briefly.",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Give me a synonym for happy.",
    "What is two plus two?",
    "Who wrote Romeo and Juliet?",
    "What colour is a banana?",
    "Name a planet in our solar system.",
    "What is the opposite of cold?",
]
VALID_KINDS = ("chat", "chat_stream")
HOSTILE_KINDS = (
    "bad_field",
    "huge_body",
    "deep_nesting",
    "non_utf8",
    "truncated_body",
    "disconnect_mid_stream",
    "slow_reader",
)
# Fields no server may accept as they are (a 4xx is the right answer; a 5xx or a reset is not).
BAD_FIELDS = [
    {"temperature": "hot"},
    {"max_tokens": -1},
    {"n": 0},
    {"top_p": 5},
    {"messages": "not a list"},
    {"messages": [{"role": "robot", "content": "hi"}]},
    {"logit_bias": [1, 2]},
    {"stop": 5},
    {"top_k": "many"},
    {"presence_penalty": 50},
]


@dataclass
class Target:
    """A running server: where it listens and which process to measure."""

    name: str
    base_url: str
    model: str
    pid: int

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.pid}/status")
        if status.exists():
            line = next(x for x in status.read_text().splitlines() if x.startswith("VmRSS:"))
            return int(line.split()[1]) / 1024
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(self.pid)], capture_output=True, text=True)
        return int(out.stdout.strip()) / 1024

    def metrics(self) -> dict[str, float]:
        try:
            text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        except httpx.HTTPError:
            return {}
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    values[name] = float(value)
                except ValueError:
                    pass
        return values

    def load(self) -> dict[str, float | None]:
        """KV blocks in use and entries in the request tables, where the server reports them."""
        m = self.metrics()
        if "mlx_infer_kv_blocks_used" in m:
            tables = sum(
                m[k]
                for k in (
                    "mlx_infer_requests_running",
                    "mlx_infer_requests_waiting",
                    "mlx_infer_engine_requests_tracked",
                    "mlx_infer_requests_pending",
                )
            )
            return {"blocks": m["mlx_infer_kv_blocks_used"], "tables": tables}
        busy = [m[k] for k in ("llamacpp:requests_processing", "llamacpp:requests_deferred") if k in m]
        return {"blocks": None, "tables": sum(busy) if busy else None}


@dataclass
class Report:
    target: str
    sent: Counter = field(default_factory=Counter)
    statuses: dict[str, Counter] = field(default_factory=dict)  # kind -> status code or "reset" counts
    mismatches: int = 0  # valid answers that differ from the prompt's solo answer
    incomplete: int = 0  # valid requests that did not complete with a whole answer
    rss_first: float = 0.0
    rss_last: float = 0.0
    start: dict = field(default_factory=dict)
    end: dict = field(default_factory=dict)
    seconds: float = 0.0

    def record(self, kind: str, outcome: int | str) -> None:
        self.sent[kind] += 1
        self.statuses.setdefault(kind, Counter())[outcome] += 1

    @property
    def server_errors(self) -> int:
        return sum(n for c in self.statuses.values() for s, n in c.items() if isinstance(s, int) and s >= 500)

    @property
    def resets(self) -> int:
        return sum(c["reset"] for c in self.statuses.values())

    def failures(self) -> list[str]:
        """The criteria this run missed (empty: it passed)."""
        out = []
        if self.mismatches or self.incomplete:
            out.append(f"{self.mismatches} valid answers differ from solo runs, {self.incomplete} incomplete")
        if self.server_errors:
            out.append(f"{self.server_errors} responses were 5xx")
        valid_resets = sum(self.statuses.get(k, Counter())["reset"] for k in VALID_KINDS)
        if valid_resets:
            out.append(f"{valid_resets} valid requests were reset")
        if self.rss_last > self.rss_first * 1.10:
            out.append(f"RSS grew {self.rss_first:.0f} -> {self.rss_last:.0f} MiB (> 10%)")
        if self.end != self.start:
            out.append(f"not back to baseline when idle: {self.end} vs {self.start}")
        return out

    def as_dict(self) -> dict:
        return {
            "target": self.target,
            "sent": dict(self.sent),
            "statuses": {k: {str(s): n for s, n in c.items()} for k, c in self.statuses.items()},
            "server_errors": self.server_errors,
            "resets": self.resets,
            "mismatches": self.mismatches,
            "incomplete": self.incomplete,
            "rss_first_mib": round(self.rss_first, 1),
            "rss_last_mib": round(self.rss_last, 1),
            "start": self.start,
            "end": self.end,
            "seconds": round(self.seconds, 1),
            "failures": self.failures(),
        }


# ---- one request of each kind ---------------------------------------------------------------------
def chat_body(target: Target, prompt: str, max_tokens: int, **extra) -> dict:
    return {
        "model": target.model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        **extra,
    }


async def valid_chat(client: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int, stream: bool):
    """(status or "reset", answer text or None when the answer is not whole)."""
    body = chat_body(target, prompt, max_tokens, stream=stream)
    try:
        if not stream:
            r = await client.post("/v1/chat/completions", json=body)
            text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
            return r.status_code, text
        parts, done = [], False
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return r.status_code, None
                    for choice in event.get("choices", []):
                        parts.append(choice.get("delta", {}).get("content") or "")
        return r.status_code, "".join(parts) if done and r.status_code == 200 else None
    except httpx.TransportError:
        return "reset", None


async def post_raw(client: httpx.AsyncClient, body: bytes) -> int | str:
    try:
        headers = {"content-type": "application/json"}
        r = await client.post("/v1/chat/completions", content=body, headers=headers)
        return r.status_code
    except httpx.TransportError:
        return "reset"


async def raw_exchange(target: Target, head: bytes, body: bytes, read_for: float | None) -> int | str:
    """Send a request over a bare socket; returns the status line's code, or "reset"/"closed".

    ``read_for``: read the answer slowly, a little now and then, for this many seconds, then leave;
    None: leave at once (with the body unfinished, a truncated request)."""
    url = httpx.URL(target.base_url)
    try:
        reader, writer = await asyncio.open_connection(url.host, url.port)
    except OSError:
        return "reset"
    try:
        writer.write(head + body)
        await writer.drain()
        if read_for is None:
            writer.close()  # a truncated body: the client leaves before sending the rest
            return "closed"
        first = await asyncio.wait_for(reader.readline(), 60)
        deadline = time.monotonic() + read_for
        while time.monotonic() < deadline:
            if not await reader.read(64):
                break
            await asyncio.sleep(0.2)
        parts = first.split()
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else "reset"
    except (OSError, asyncio.TimeoutError):
        return "reset"
    finally:
        writer.close()


def http_head(target: Target, length: int) -> bytes:
    url = httpx.URL(target.base_url)
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


async def hostile(client: httpx.AsyncClient, target: Target, kind: str, rng: random.Random, args):
    """One hostile request; its outcome: the status code, "reset", or "closed" (the client left)."""
    good = chat_body(target, rng.choice(PROMPTS), args.max_tokens)
    if kind == "bad_field":
        return await post_raw(client, json.dumps({**good, **rng.choice(BAD_FIELDS)}).encode())
    if kind == "huge_body":
        filler = "w " * (args.huge_bytes // 2)
        return await post_raw(client, json.dumps(chat_body(target, filler, args.max_tokens)).encode())
    if kind == "deep_nesting":
        return await post_raw(client, b'{"model": "m", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}")
    if kind == "non_utf8":
        body = json.dumps(good).encode().replace(b'"content": "', b'"content": "\xff\xc3\x28')
        return await post_raw(client, body)
    if kind == "truncated_body":
        body = json.dumps(good).encode()
        return await raw_exchange(target, http_head(target, len(body)), body[: len(body) // 2], None)
    if kind == "slow_reader":
        body = json.dumps({**good, "stream": True, "max_tokens": args.max_tokens * 4}).encode()
        return await raw_exchange(target, http_head(target, len(body)), body, args.slow_read_seconds)
    if kind == "disconnect_mid_stream":
        body = {**good, "stream": True, "max_tokens": args.max_tokens * 8}
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = 0
                async for _ in r.aiter_lines():
                    lines += 1
                    if lines >= 4:
                        break  # leaving the block closes the connection mid-stream
                return r.status_code
        except httpx.TransportError:
            return "reset"
    raise ValueError(kind)


# ---- the soak -------------------------------------------------------------------------------------
async def solo_answers(target: Target, args) -> dict[str, str]:
    async with httpx.AsyncClient(base_url=target.base_url, timeout=300) as client:
        answers = {}
        for prompt in PROMPTS[: args.prompts]:
            status, text = await valid_chat(client, target, prompt, args.max_tokens, stream=False)
            if status != 200 or text is None:
                raise RuntimeError(f"{target.name}: the solo run of {prompt!r} failed ({status})")
            answers[prompt] = text
        return answers


async def one_round(target: Target, report: Report, solo: dict[str, str], rng: random.Random, args) -> None:
    limits = httpx.Limits(max_connections=args.concurrency + args.hostile + 4)
    async with httpx.AsyncClient(base_url=target.base_url, timeout=300, limits=limits) as client:

        async def valid(prompt: str, stream: bool) -> None:
            status, text = await valid_chat(client, target, prompt, args.max_tokens, stream)
            report.record("chat_stream" if stream else "chat", status)
            if text is None:
                report.incomplete += 1
            elif text != solo[prompt]:
                report.mismatches += 1

        async def bad(kind: str) -> None:
            report.record(kind, await hostile(client, target, kind, rng, args))

        prompts = PROMPTS[: args.prompts]
        tasks = [valid(prompts[(i // 2) % len(prompts)], stream=i % 2 == 1) for i in range(args.concurrency)]
        tasks += [bad(HOSTILE_KINDS[i % len(HOSTILE_KINDS)]) for i in range(args.hostile)]
        rng.shuffle(tasks)
        await asyncio.gather(*tasks)


def wait_idle(target: Target, baseline: dict, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        load = target.load()
        if load == baseline or time.monotonic() > deadline:
            return load
        time.sleep(0.2)


def soak(target: Target, args) -> Report:
    report = Report(target.name)
    rng = random.Random(args.seed)
    start = time.perf_counter()
    report.start = target.load()
    solo = asyncio.run(solo_answers(target, args))
    for round_index in range(args.rounds):
        asyncio.run(one_round(target, report, solo, rng, args))
        if round_index == 0:
            report.rss_first = target.rss_mib()
        print(f"  {target.name}: round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    report.rss_last = target.rss_mib()
    report.end = wait_idle(target, report.start)
    report.seconds = time.perf_counter() - start
    return report


# ---- servers --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launched:
    """A server subprocess on a free loopback port, healthy on entry, terminated on exit."""

    def __init__(self, name: str, command: list[str], port: int, model: str):
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"soak-{name}-", suffix=".log", delete=False)
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self.target = Target(name, f"http://127.0.0.1:{port}", model, self.process.pid)

    def __enter__(self) -> Target:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.target.name} exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.target.base_url}/health", timeout=2).status_code == 200:
                    return self.target
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.target.name} did not become healthy")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def launch_mlx_infer(model: str, args) -> Launched:
    port = free_port()
    command = [sys.executable, "-m", "mlx_infer.cli", "serve", "-m", model, "--port", str(port)]
    command += ["--served-model-name", "soak", "--max-num-seqs", str(args.concurrency)]
    command += ["--kv-memory", str(args.kv_memory), *args.mlx_infer_args]
    return Launched("mlx-infer", command, port, "soak")


def launch_llama_server(binary: str, model: str, args) -> Launched:
    port = free_port()
    slots = args.concurrency + args.hostile
    command = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots)]
    command += ["-c", str(1024 * slots), "--metrics", "-t", str(os.cpu_count() or 1)]
    return Launched("llama-server", command, port, "soak")


# ---- report ---------------------------------------------------------------------------------------
def table(reports: list[Report]) -> str:
    def cell(r: Report, kind: str) -> str:
        c = r.statuses.get(kind, Counter())
        return " ".join(f"{s}:{n}" for s, n in sorted(c.items(), key=lambda x: str(x[0])))

    rows = [("", *[r.target for r in reports])]
    for kind in VALID_KINDS + HOSTILE_KINDS:
        rows.append((f"{kind} (sent: outcomes)", *[f"{r.sent[kind]}: {cell(r, kind)}" for r in reports]))
    rows += [
        ("valid answers != solo", *[str(r.mismatches) for r in reports]),
        ("valid answers incomplete", *[str(r.incomplete) for r in reports]),
        ("5xx responses", *[str(r.server_errors) for r in reports]),
        ("resets", *[str(r.resets) for r in reports]),
        ("RSS after round 1 (MiB)", *[f"{r.rss_first:.0f}" for r in reports]),
        ("RSS after last round (MiB)", *[f"{r.rss_last:.0f}" for r in reports]),
        ("KV blocks used, start -> end", *[_span(r, "blocks") for r in reports]),
        ("request tables, start -> end", *[_span(r, "tables") for r in reports]),
        ("seconds", *[f"{r.seconds:.0f}" for r in reports]),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _span(report: Report, key: str) -> str:
    return f"{report.start.get(key)} -> {report.end.get(key)}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mlx-infer", metavar="MODEL", help="launch `mlx-infer serve -m MODEL` and soak it")
    p.add_argument("--mlx-infer-args", nargs=argparse.REMAINDER, default=[], help="more serve flags (last)")
    p.add_argument("--llama-server", metavar="BINARY", help="launch this llama-server on --gguf and soak it")
    p.add_argument("--gguf", help="the GGUF llama-server loads (default: the --mlx-infer model)")
    p.add_argument("--base-url", help="soak a server already running here instead")
    p.add_argument("--pid", type=int, help="the process of --base-url, for its RSS")
    p.add_argument("--model-name", default="soak", help="the model name --base-url serves (default: soak)")
    p.add_argument("--kv-memory", type=float, default=1.0, help="--kv-memory of the launched mlx-infer (GiB)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=16, help="valid requests per round, sent at once")
    p.add_argument("--hostile", type=int, default=14, help="hostile requests per round, among them")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="distinct prompts (each run solo first)")
    p.add_argument("--slow-read-seconds", type=float, default=8.0, help="how long a slow reader stays")
    p.add_argument("--huge-bytes", type=int, default=9 * 2**20, help="size of the over-limit body")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the reports here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reports = []
    if args.base_url:
        reports.append(soak(Target("server", args.base_url, args.model_name, args.pid or 0), args))
    if args.mlx_infer:
        with launch_mlx_infer(args.mlx_infer, args) as target:
            reports.append(soak(target, args))
    if args.llama_server:
        gguf = args.gguf or args.mlx_infer
        with launch_llama_server(args.llama_server, gguf, args) as target:
            reports.append(soak(target, args))
    if not reports:
        raise SystemExit("nothing to soak: give --mlx-infer, --llama-server or --base-url")
    print(table(reports))
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict() for r in reports], indent=2))
    judged = [r for r in reports if r.target != "llama-server"]
    for r in judged:
        for failure in r.failures():
            print(f"{r.target}: FAIL: {failure}", file=sys.stderr)
    return 1 if any(r.failures() for r in judged) else 0


if __name__ == "__main__":
    sys.exit(main())
