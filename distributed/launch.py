"""``mlx-infer launch``: start one rank per host (ssh, or a local process for 127.0.0.1/localhost).

Unlike ``mlx.launch`` 0.32.4 it exits non-zero when any rank fails (and stops the others at once: each
rank runs in its own process group, killed as a whole; over ssh, ``-tt`` makes the remote side hang up
with the connection), takes ``generate``/``serve`` or a bare ``script.py`` as the command, and runs a
one-host "ring" as a plain single process. Every output line is prefixed with ``[rank N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from mlx_infer.cli_options import CPU_ACTIVATIONS, FINAL_ERROR_S, SHUTDOWN_TIMEOUT_S, ring_port, stdin_prompt
from mlx_infer.cpu_kernels import ACTIVATIONS_ENV_VAR
from mlx_infer.errors import DistributedError, InvalidRequest

from . import hostfile as hf
from .runtime import BACKEND_ENV, LAUNCHER_PID_ENV, STRATEGIES, STRATEGY_ENV, TEMP_PREFIX

# LogLevel=ERROR: ssh's own reason for a failure (no route, refused, a key not accepted) reaches the user,
# its "Connection closed" notes do not; ConnectTimeout: an address that never answers is an error in
# seconds, not after the system's TCP timeout (minutes).
DEFAULT_SSH = "ssh -tt -o LogLevel=ERROR -o BatchMode=yes -o ConnectTimeout=15"
DEFAULT_PORT = 32323
STOP_GRACE_S = 3.0
# A serving rank 0 stops as serve does: its requests finish for --shutdown-timeout, then their final errors
# go out (FINAL_ERROR_S); it is given that long, and this margin, before it is stopped harder.
SERVE_STOP_MARGIN_S = 5.0
PARTIAL_LINE_S = 0.1  # a partial line waits this long for the rest of its line
_LINES = re.compile(b"(?<=\n)")  # split after each newline, keeping it
# Passed on to every rank when set here (ssh does not carry the environment): every rank must compute with
# the kernels and activations the user chose, or a sharded run stops computing what one process does.
FORWARDED_ENV = (
    "HF_HUB_OFFLINE", "HF_HOME", "MLX_INFER_BLAS", "MLX_INFER_KERNELS", "MLX_INFER_DEBUG",
    "MLX_INFER_CPU_KERNELS", "MLX_INFER_CPU_ACTIVATIONS",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--hosts", help="comma-separated hosts, one rank each (addresses, or names to resolve)"
    )
    where.add_argument("--hostfile", help="an MLX host file (JSON, as mlx.distributed_config writes)")
    parser.add_argument(
        "--backend", choices=hf.BACKENDS, default=None, help="default: the host file's, else ring"
    )
    parser.add_argument("--strategy", choices=STRATEGIES, default="pipeline", help="default: pipeline")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the host file and the commands, run nothing"
    )
    parser.add_argument("--save-hostfile", metavar="FILE", help="write the host file (MLX format) to FILE")
    parser.add_argument(
        "--ssh", default=DEFAULT_SSH, help=f"command to reach a remote host (default: {DEFAULT_SSH!r})"
    )
    parser.add_argument("--python", default=sys.executable, help="python on the hosts (default: this one)")
    parser.add_argument(
        "--cwd", default=None, help="working directory on the hosts (default: this one, if there)"
    )
    parser.add_argument(
        "--port", type=ring_port, default=DEFAULT_PORT, help=f"first ring port (default: {DEFAULT_PORT})"
    )
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="set on every rank (repeatable)"
    )
    parser.add_argument(
        "--cpu-activations",
        choices=CPU_ACTIVATIONS,
        default=None,
        help=f"{ACTIVATIONS_ENV_VAR} on every rank: int8, int16 or float32 (default: this process's "
        "setting, else each rank's default, int16)",
    )
    parser.add_argument("--verbose", action="store_true", help="MLX_RING_VERBOSE=1 on every rank")
    parser.add_argument(
        "program",
        nargs=argparse.REMAINDER,
        help="-- generate|serve ARGS, or -- PROGRAM ARGS (a .py script or python runs under --python)",
    )


@dataclass
class RankPlan:
    rank: int
    host: hf.Host
    argv: list[str]  # what runs on this machine (bash -c SCRIPT, or SSH HOST SCRIPT)


def run(args: argparse.Namespace) -> int:
    table = hf.read(args.hostfile) if args.hostfile else hf.from_list(args.hosts)
    table.backend = args.backend or table.backend or "ring"
    if table.backend not in hf.BACKENDS:
        raise DistributedError(f"backend {table.backend!r} is not one of {', '.join(hf.BACKENDS)}")
    if not args.dry_run:
        args.program = prompt_from_stdin(args.program)
    plans = plan_ranks(table, args)
    if args.save_hostfile:
        Path(args.save_hostfile).write_text(json.dumps(table.to_json(), indent=2) + "\n")
    if args.dry_run:
        print(json.dumps(table.to_json(), indent=2))
        for p in plans:
            print(f"# rank {p.rank} on {p.host.ssh}")
            print(shlex.join(p.argv))
        return 0
    return Launcher(plans, stop_grace_s(command_of(args))).run()


def command_of(args: argparse.Namespace) -> list[str]:
    """The command after ``--``."""
    command = list(args.program)
    return command[1:] if command[:1] == ["--"] else command


def stop_grace_s(command: list[str]) -> float:
    """How long rank 0 may take to stop by itself once interrupted: a ``serve`` drains its requests for
    its ``--shutdown-timeout``; anything else stops at once."""
    if command[:1] != ["serve"]:
        return STOP_GRACE_S
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S)
    try:
        timeout = parser.parse_known_args(command[1:])[0].shutdown_timeout
    except argparse.ArgumentError:
        timeout = SHUTDOWN_TIMEOUT_S  # serve refuses it itself
    return timeout + SERVE_STOP_MARGIN_S


def plan_ranks(table: hf.HostFile, args: argparse.Namespace) -> list[RankPlan]:
    command = command_of(args)
    if not command:
        raise InvalidRequest("no command: add -- generate|serve ARGS (or -- PROGRAM ARGS)")  # usage: 2
    argv = rank_command(command, args.python)
    env = {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
    if args.cpu_activations is not None:
        env[ACTIVATIONS_ENV_VAR] = args.cpu_activations
    env["PYTHONUNBUFFERED"] = "1"  # output reaches the prefixer as it is written
    files: dict[str, str] = {}
    distributed = len(table.hosts) > 1  # one host: a plain process (mlx.launch crashes on a one-rank ring)
    if distributed:
        backend_env, files = hf.rank_setup(table, table.backend, args.port)
        if table.backend == "jaccl":
            table.envs = [e for e in table.envs if not e.startswith("MLX_JACCL_COORDINATOR=")] + [
                f"MLX_JACCL_COORDINATOR={backend_env['MLX_JACCL_COORDINATOR']}"
            ]
        env.update(backend_env)
        env[BACKEND_ENV] = table.backend
        env[STRATEGY_ENV] = args.strategy
        if args.verbose:
            env["MLX_RING_VERBOSE"] = "1"
    for item in [*table.envs, *args.env]:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise DistributedError(f"--env {item!r}: expected NAME=VALUE")
        env[name] = value
    plans = []
    for rank, host in enumerate(table.hosts):
        rank_env = {**env, "MLX_RANK": str(rank)} if distributed else env
        local = host.is_local
        if local:  # its parent is this process: it stops when this one is gone, killed or hung up on
            rank_env = {**rank_env, LAUNCHER_PID_ENV: str(os.getpid())}
        script = rank_script(rank_env, files, args.cwd, argv)
        plans.append(
            RankPlan(
                rank, host, ["bash", "-c", script] if local else [*shlex.split(args.ssh), host.ssh, script]
            )
        )
    return plans


def prompt_from_stdin(command: list[str]) -> list[str]:
    """``generate -p -`` reads the prompt from stdin, which no rank has (rank 0 may be another host):
    launch reads it and passes it as the prompt itself."""
    out = list(command)
    for i, arg in enumerate(out):
        if arg in ("-p", "--prompt") and out[i + 1 : i + 2] == ["-"]:
            out[i + 1] = stdin_prompt()
        elif arg == "--prompt=-":
            out[i] = "--prompt=" + stdin_prompt()
    return out


def rank_command(command: list[str], python: str) -> list[str]:
    """``generate``/``serve`` run the mlx-infer CLI; a ``.py`` script and ``python`` get ``--python``."""
    head, rest = command[0], command[1:]
    if head in ("generate", "serve"):
        return [python, "-m", "mlx_infer.cli", head, *rest]
    if head.endswith(".py"):
        return [python, *command]
    if head in ("python", "python3"):
        return [python, *rest]
    return command


def own_temp_prefix() -> str:
    """The name start of the host files this launch's ranks write: a rank removes its own once it joined
    the ring (runtime.init_group); those of ranks stopped before that, launch removes on this machine."""
    return f"{TEMP_PREFIX}{os.getpid()}."


def remove_own_temp_files() -> None:
    for path in Path(os.environ.get("TMPDIR") or "/tmp").glob(own_temp_prefix() + "*"):
        path.unlink(missing_ok=True)


def rank_script(env: dict[str, str], files: dict[str, str], cwd: str | None, argv: list[str]) -> str:
    """A POSIX shell script (bash locally, the login shell over ssh) that becomes the rank's process."""
    steps = ["set -e"]
    steps += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    for name, content in files.items():
        steps.append(
            f'{name}="$(mktemp "${{TMPDIR:-/tmp}}/{own_temp_prefix()}XXXXXX")"; '
            f'printf %s {shlex.quote(content)} > "${name}"; export {name}'
        )
    if cwd:
        steps.append(f"cd {shlex.quote(cwd)}")
    else:
        steps.append(f"cd {shlex.quote(os.getcwd())} 2>/dev/null || true")
    steps.append("exec " + shlex.join(argv))
    return "; ".join(steps)


class Launcher:
    """``stop_grace_s``: how long rank 0 may take to stop by itself when the launcher is interrupted."""

    def __init__(self, plans: list[RankPlan], stop_grace_s: float = STOP_GRACE_S):
        self.plans = plans
        self.stop_grace_s = stop_grace_s
        self.procs: list[subprocess.Popen] = []
        self.lock = threading.Lock()
        self._open_line: int | None = None  # the rank whose partial line ends the output so far

    def run(self) -> int:
        self.interrupted_by = signal.SIGINT  # or SIGTERM, SIGHUP: the exit status says which (130, 143, 129)

        def terminated(signum, frame) -> None:
            self.interrupted_by = signum
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, terminated)
        # Also when SIGINT came ignored (a background job of a script): the launcher still stops on it,
        # and the ranks, which inherit an ignored signal across exec but not a handler, take it again.
        previous_int = signal.signal(signal.SIGINT, terminated)
        # A closed terminal or ssh session (SIGHUP) stops the job as SIGTERM does.
        previous_hup = signal.signal(signal.SIGHUP, terminated)
        threads: list[threading.Thread] = []
        try:
            for p in self.plans:
                proc = subprocess.Popen(
                    p.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
                self.procs.append(proc)
                self._note(f"rank {p.rank} on {p.host.ssh}: pid {proc.pid}")
                for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                    t = threading.Thread(target=self._forward, args=(p.rank, stream, out), daemon=True)
                    t.start()
                    threads.append(t)
            return self._watch()
        except KeyboardInterrupt:
            self._note("interrupted; stopping every rank")
            # A hang-up reaches rank 0 as SIGTERM: what stops a rank (a serve) cleanly.
            first = signal.SIGTERM if self.interrupted_by == signal.SIGHUP else self.interrupted_by
            self._stop_all(first, self.stop_grace_s)
            # Rank 0's own status when it stopped by itself (a serve that drained its requests: 0).
            code = self.procs[0].poll() if self.procs else None
            return code if code is not None and code >= 0 else 128 + self.interrupted_by
        finally:
            self._stop_all()
            remove_own_temp_files()
            for t in threads:
                t.join(timeout=2)
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGHUP, previous_hup)

    def _watch(self) -> int:
        while True:
            codes = [proc.poll() for proc in self.procs]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                for rank, code in failed:
                    host = self.plans[rank].host.ssh
                    self._note(f"rank {rank} ({host}) {_describe(code)}; stopping the other ranks")
                code = failed[0][1]
                return code if code > 0 else 128 - code
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.05)

    def _stop_all(self, first: int = signal.SIGTERM, first_grace_s: float = STOP_GRACE_S) -> None:
        """Rank 0 first, with the signal the launcher got (a serve then drains its requests): it tells the
        others to stop, so the ring ends cleanly rather than on lost peers. Another Ctrl-C meanwhile is
        passed on to rank 0 as such (a serve then ends its requests with their final errors at once).
        Then SIGTERM for whoever is left, and SIGKILL for whoever outlives that."""
        rank0 = self.procs[:1]
        self._signal(rank0, first)
        if not self._wait(first_grace_s):
            self._signal(rank0, first)
            self._wait(STOP_GRACE_S + FINAL_ERROR_S)
        self._signal(self.procs, signal.SIGTERM)
        self._wait(STOP_GRACE_S)
        self._signal(self.procs, signal.SIGKILL)
        self._wait(STOP_GRACE_S)

    @staticmethod
    def _signal(procs: list[subprocess.Popen], sig: int) -> None:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)  # the rank's whole process group
                except ProcessLookupError:
                    pass

    def _wait(self, seconds: float) -> bool:
        """Until every rank has ended or ``seconds`` passed; False when a Ctrl-C came meanwhile."""
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline and any(proc.poll() is None for proc in self.procs):
                time.sleep(0.05)
        except KeyboardInterrupt:
            return False
        return True

    def _forward(self, rank: int, stream, out) -> None:
        """Copy a rank's output with ``[rank N]`` before each line, whole lines at a time so ranks do not
        interleave mid-line; a partial line (streamed tokens) goes out once the rank pauses."""
        prefix = f"[rank {rank}] ".encode()
        fd, held, at_line_start = stream.fileno(), b"", True
        while True:
            ready = select.select([fd], [], [], PARTIAL_LINE_S)[0]
            chunk = os.read(fd, 65536) if ready else b""
            held += chunk.replace(b"\r\n", b"\n")  # ssh -tt's terminal line endings
            # Whole lines while output flows; the rest too once the rank pauses or ends.
            cut = held.rfind(b"\n") + 1 if chunk else len(held)
            continues_line = not at_line_start
            text = bytearray()
            for piece in _LINES.split(held[:cut]):
                if piece:
                    text += prefix + piece if at_line_start else piece
                    at_line_start = piece.endswith(b"\n")
            held = held[cut:]
            if text:
                with self.lock:
                    if self._open_line not in (None, rank):
                        out.buffer.write(b"\n")  # another rank's partial line: close it first
                    if continues_line and self._open_line != rank:
                        text = prefix + text  # our partial line was closed: name the rank again
                    out.buffer.write(bytes(text))
                    out.buffer.flush()
                    self._open_line = None if text.endswith(b"\n") else rank
            if ready and not chunk:
                return

    def _note(self, message: str) -> None:
        with self.lock:
            print(f"[launch] {message}", file=sys.stderr, flush=True)


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlx-infer launch", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except DistributedError as e:
        print(f"mlx-infer launch: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
