"""``mlx-infer hosts check``: can every rank reach every other, and over which interface?

Each host runs a small probe (over the same ssh, or locally) that, for every other rank's ring address,
asks the OS which interface and source address the connection would take and tries a TCP connection to the
rank's ring port (refused counts as reachable: nobody listens before the launch). On macOS it warns when the
interface is not a Thunderbolt bridge: the ring then runs over Wi-Fi or Ethernet, a common slow setup.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys

from mlx_infer.cli_options import ring_port
from mlx_infer.errors import DistributedError

from . import hostfile as hf
from .launch import DEFAULT_PORT, DEFAULT_SSH

PROBE = r"""
import json, platform, re, socket, subprocess, sys, time

def out(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""

def route(ip):
    if sys.platform == "darwin":
        m = re.search(r"interface: (\S+)", out(["route", "-n", "get", ip]))
        iface = m.group(1) if m else None
    else:
        m = re.search(r"\bdev (\S+)", out(["ip", "route", "get", ip]))
        iface = m.group(1) if m else None
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect((ip, 9))
        src = s.getsockname()[0]
        s.close()
    except OSError:
        src = None
    return iface, src

def thunderbolt():
    if sys.platform != "darwin":
        return []
    text = out(["networksetup", "-listallhardwareports"])
    ports = re.findall(r"Hardware Port: (.*)\nDevice: (\S+)", text)
    return [dev for name, dev in ports if name.startswith("Thunderbolt")]

def reach(ip, port):
    start = time.perf_counter()
    try:
        socket.create_connection((ip, port), timeout=2).close()
        state = "listening"
    except ConnectionRefusedError:
        state = "refused"
    except OSError as e:
        return False, None, str(e)
    return True, (time.perf_counter() - start) * 1e3, state

results = []
for ip, port in json.loads(sys.argv[1]):
    iface, src = route(ip)
    ok, ms, state = reach(ip, port)
    results.append(dict(ip=ip, port=port, iface=iface, src=src, reachable=ok, ms=ms, state=state))
print(json.dumps(dict(system=platform.system(), thunderbolt=thunderbolt(), results=results)))
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["check"], help="check: reachability and interfaces per host pair")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--hosts", help="comma-separated hosts, as for launch")
    where.add_argument("--hostfile", help="an MLX host file (JSON)")
    parser.add_argument(
        "--ssh", default=DEFAULT_SSH, help=f"command to reach a remote host (default: {DEFAULT_SSH!r})"
    )
    parser.add_argument("--python", default="python3", help="python on the hosts (default: python3)")
    parser.add_argument(
        "--port", type=ring_port, default=DEFAULT_PORT, help=f"first ring port (default: {DEFAULT_PORT})"
    )


def run(args: argparse.Namespace) -> int:
    table = hf.read(args.hostfile) if args.hostfile else hf.from_list(args.hosts)
    hosts = table.hosts
    addresses = hf.ring_addresses(hosts, args.port)
    problems = 0
    for i, host in enumerate(hosts):
        targets = [a.rsplit(":", 1) for j in range(len(hosts)) if j != i for a in addresses[j][:1]]
        others = [j for j in range(len(hosts)) if j != i]
        report = _probe(host, args, [[ip, int(port)] for ip, port in targets])
        print(f"rank {i} {host.ssh} ({report['system']})")
        for j, r in zip(others, report["results"]):
            via = f"via {r['iface'] or '?'} from {r['src'] or '?'}"
            if r["reachable"] and r["state"] == "listening":
                # Before launch nothing of ours listens there: the ring would fail to bind that port.
                problems += 1
                print(
                    f"  -> rank {j} {r['ip']}:{r['port']}: IN USE (something already listens there; another "
                    f"launch? choose --port), {via}"
                )
            elif r["reachable"]:
                print(
                    f"  -> rank {j} {r['ip']}:{r['port']}: reachable, {r['ms']:.1f} ms ({r['state']}), {via}"
                )
            else:
                problems += 1
                print(f"  -> rank {j} {r['ip']}:{r['port']}: UNREACHABLE ({r['state']}), {via}")
            if report["system"] == "Darwin" and r["iface"] not in report["thunderbolt"]:
                print(
                    f"  warning: rank {i} -> rank {j} goes over {r['iface']}, not a Thunderbolt bridge; put "
                    "the Thunderbolt bridge addresses in the host file (mlx.distributed_config writes one)"
                )
    if problems:
        print(f"{problems} pair(s) a ring cannot use")
        return DistributedError.exit_code
    return 0


def _probe(host: hf.Host, args: argparse.Namespace, targets: list[list]) -> dict:
    script = shlex.join([args.python, "-c", PROBE, json.dumps(targets)])
    argv = ["bash", "-c", script] if host.is_local else [*shlex.split(args.ssh), host.ssh, script]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise DistributedError(f"{host.ssh}: the probe did not answer within 30 s") from None
    lines = [line for line in done.stdout.replace("\r", "").splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        detail = (done.stderr or done.stdout).strip().replace("\n", " ")[:200]
        raise DistributedError(f"{host.ssh}: cannot run the probe ({detail or f'exit {done.returncode}'})")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlx-infer hosts", description=__doc__)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except DistributedError as e:
        print(f"mlx-infer hosts check: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
