"""Resident memory of a server at start, under load and after an idle period, for any OpenAI-compatible
server started from a command line; several servers one after the other, the same load for each.

    python benchmarks/bench_memory.py --json memory.json \\
        --target mlx-infer="mlx-infer serve -m MODEL.gguf --port {port} --kv-idle-release 10" \\
        --target llama-server="llama-server -m MODEL.gguf --port {port} -c 8192 -np 16" \\
        --target mlx-lm="mlx_lm.server --model MLX_FOLDER --port {port}"

For each target: start it and wait until ``/v1/models`` answers; wait ``--settle`` seconds and read the
resident size (VmRSS of the process and its descendants, from /proc: Linux only); send ``--concurrency``
streamed completions at once (fresh random prompts of ``--input-words`` words, ``--output-tokens``
tokens each with ignore_eos), sampling the resident size every 0.1 s (the peak is "load"); then wait
``--idle`` seconds without requests and read it again ("idle"). Run it with nothing else loading the
machine: the load phase's timing is only reported, not compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_serve import Launched, Target, discover_model, random_text, run_level, targets_from_specs
from rich.console import Console
from rich.table import Table

MIB = 2**20


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (children listed by the kernel per thread)."""
    found, stack = [], [pid]
    while stack:
        p = stack.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                stack += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


def rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (a process that is gone counts 0)."""
    total = 0
    for p in descendants(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class PeakSampler:
    """The highest resident size of a process tree, sampled on a thread until ``stop()``."""

    def __init__(self, pid: int, interval: float = 0.1):
        self.pid, self.interval, self.peak = pid, interval, rss_bytes(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@dataclass
class MemoryResult:
    target: str
    command: str
    start_bytes: int
    load_peak_bytes: int
    idle_bytes: int
    idle_seconds: float
    requests_ok: int
    requests: int
    output_tokens: int
    load_seconds: float


def measure(target: Target, args: argparse.Namespace) -> MemoryResult:
    server = Launched(target.command, target.base_url, args.startup_timeout, None)
    try:
        time.sleep(args.settle)
        start = rss_bytes(server.process.pid)
        rng = random.Random(args.seed)
        prompts = [random_text(rng, args.input_words) for _ in range(args.concurrency)]
        level_args = argparse.Namespace(
            endpoint="completions",
            output_tokens=args.output_tokens,
            temperature=0.0,
            api_key=None,
            timeout=args.timeout,
        )
        # mlx_lm.server lists no models and answers for its own under "default_model".
        model = args.model or asyncio.run(discover_model(target.base_url, None)) or "default_model"
        sampler = PeakSampler(server.process.pid)
        level = asyncio.run(
            run_level(target.name, target.base_url, model, prompts, args.concurrency, level_args)
        )
        if level.errors:
            print(f"{target.name}: {level.errors} requests failed, the first with: {level.first_error}")
        peak = sampler.stop()
        time.sleep(args.idle)
        idle = rss_bytes(server.process.pid)
    finally:
        server.stop()
    return MemoryResult(
        target.name,
        target.command,
        start,
        peak,
        idle,
        args.idle,
        level.num_requests - level.errors,
        level.num_requests,
        level.output_tokens,
        level.wall_seconds,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="NAME=COMMAND",
        help="a server command line with {port} where its port goes (repeatable)",
    )
    p.add_argument(
        "--model", default=None, help="the model field sent (default: the first of each server's /v1/models)"
    )
    p.add_argument("--concurrency", type=int, default=16, help="requests sent at once (default: 16)")
    p.add_argument("--input-words", type=int, default=300, help="words per prompt (default: 300)")
    p.add_argument("--output-tokens", type=int, default=64, help="tokens per answer (default: 64)")
    p.add_argument("--settle", type=float, default=3.0, help="seconds after the server answers (default: 3)")
    p.add_argument(
        "--idle", type=float, default=20.0, help="seconds idle before the last reading (default: 20)"
    )
    p.add_argument("--startup-timeout", type=float, default=300.0, help="default: 300")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds (default: 600)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    results = []
    for target in targets_from_specs(args.target):
        console.print(f"[dim]{target.name}: {target.command}[/dim]")
        results.append(measure(target, args))
    table = Table(
        title=f"resident memory: {args.concurrency} concurrent requests of {args.input_words} words, "
        f"{args.output_tokens} tokens out; idle = {args.idle:g} s after the load"
    )
    for column in ("server", "start MiB", "load peak MiB", "idle MiB", "requests ok", "load s"):
        table.add_column(column, justify="left" if column == "server" else "right")
    for r in results:
        table.add_row(
            r.target,
            f"{r.start_bytes / MIB:.0f}",
            f"{r.load_peak_bytes / MIB:.0f}",
            f"{r.idle_bytes / MIB:.0f}",
            f"{r.requests_ok}/{r.requests}",
            f"{r.load_seconds:.1f}",
        )
    console.print(table)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "results": [asdict(r) for r in results]}, indent=2)
        )
    return 0 if all(r.requests_ok == r.requests for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
