"""Hosts, the MLX host file, and what each rank's environment must hold for the ring and JACCL backends.

The host file is the JSON ``mlx.launch --hostfile`` reads and ``mlx.distributed_config`` writes::

    {"backend": "jaccl", "envs": ["MLX_JACCL_COORDINATOR=10.0.0.1:32323"],
     "hosts": [{"ssh": "mac1", "ips": ["10.0.0.1"], "rdma": [null, "rdma_en3"]},
               {"ssh": "mac2", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", null]}]}

Each rank then gets what ``mlx.launch`` 0.32 gives it: ``MLX_RANK``; for the ring ``MLX_HOSTFILE``, a file
listing every rank's ``ip:port`` (one port per rank and address, counting up from the starting port); for
JACCL ``MLX_IBV_DEVICES``, a file holding the RDMA device matrix, and ``MLX_JACCL_COORDINATOR``.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from dataclasses import dataclass, field
from pathlib import Path

from mlx_infer.errors import DistributedError

BACKENDS = ("ring", "jaccl")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class Host:
    ssh: str  # what to ssh into
    ips: list[str]  # the addresses the ring listens on / the coordinator is reached at
    rdma: list[str | list[str] | None] = field(default_factory=list)  # JACCL: device towards each rank

    @property
    def is_local(self) -> bool:
        return self.ssh in LOCAL_HOSTS


@dataclass
class HostFile:
    hosts: list[Host]
    backend: str = ""
    envs: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "backend": self.backend,
            "envs": self.envs,
            "hosts": [{"ssh": h.ssh, "ips": h.ips, "rdma": h.rdma} for h in self.hosts],
        }


def from_list(spec: str) -> HostFile:
    """``--hosts H1,H2,...``: addresses are used as they are, names are resolved here (IPv4)."""
    hosts = []
    for name in spec.split(","):
        name = name.strip()
        if not name:
            raise DistributedError(f"--hosts {spec!r}: empty host name")
        hosts.append(Host(name, [_address(name)]))
    return HostFile(hosts)


def read(path: str | Path) -> HostFile:
    try:
        data = json.loads(Path(path).read_text())
        entries = data["hosts"] if isinstance(data, dict) else data
        hosts = [
            Host(e["ssh"], list(e.get("ips") or [_address(e["ssh"])]), list(e.get("rdma", [])))
            for e in entries
        ]
    except OSError as e:
        raise DistributedError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise DistributedError(f"{path}: not JSON ({e})") from None
    except (KeyError, TypeError, AttributeError):
        # Python's words for a wrong shape (list indices must be integers...) tell a user nothing.
        raise DistributedError(
            f'{path}: not an MLX host file: expected a list of {{"ssh": HOST, "ips": [ADDRESS, ...]}} '
            '(or {"hosts": [...]}, as mlx.launch writes it)'
        ) from None
    if not hosts:
        raise DistributedError(f"{path}: no hosts")
    backend = data.get("backend", "") if isinstance(data, dict) else ""
    envs = list(data.get("envs", [])) if isinstance(data, dict) else []
    return HostFile(hosts, backend, envs)


def check_jaccl(hosts: list[Host]) -> None:
    """Each host's ``rdma`` names a device towards every other rank, and null towards itself."""
    n = len(hosts)
    for i, h in enumerate(hosts):
        if len(h.rdma) != n:
            raise DistributedError(
                f"jaccl: host {h.ssh} lists {len(h.rdma)} RDMA devices for {n} ranks "
                "(write the host file with mlx.distributed_config --backend jaccl)"
            )
        if h.rdma[i] is not None:
            raise DistributedError(f"jaccl: host {h.ssh} must have null as its own RDMA device (entry {i})")
        missing = [hosts[j].ssh for j in range(n) if j != i and not h.rdma[j]]
        if missing:
            raise DistributedError(f"jaccl: host {h.ssh} has no RDMA device towards {missing[0]}")
    if not hosts[0].ips:
        raise DistributedError("jaccl: rank 0 needs an address the others reach (the coordinator)")


def ring_addresses(hosts: list[Host], port: int) -> list[list[str]]:
    """What ``MLX_HOSTFILE`` holds for the ring: each rank's ``ip:port`` list."""
    last = port + sum(len(h.ips) for h in hosts) - 1
    if last > 65535:
        raise DistributedError(
            f"--port {port}: the ring needs ports {port} to {last}, past 65535; start lower"
        )
    out = []
    for h in hosts:
        out.append([f"{ip}:{port + k}" for k, ip in enumerate(h.ips)])
        port += len(h.ips)
    return out


def coordinator(hosts: list[Host], port: int) -> str:
    return f"{hosts[0].ips[0]}:{port}"


def rank_setup(hostfile: HostFile, backend: str, port: int) -> tuple[dict[str, str], dict[str, str]]:
    """(environment shared by all ranks, {variable: file content} each rank writes and points to)."""
    hosts = hostfile.hosts
    if backend == "ring":
        return {}, {"MLX_HOSTFILE": json.dumps(ring_addresses(hosts, port))}
    check_jaccl(hosts)
    env = {"MLX_JACCL_COORDINATOR": coordinator(hosts, port)}
    return env, {"MLX_IBV_DEVICES": json.dumps([h.rdma for h in hosts])}


def _address(name: str) -> str:
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0]
    except OSError:
        raise DistributedError(f"cannot resolve host {name!r}; give its address or use --hostfile") from None
