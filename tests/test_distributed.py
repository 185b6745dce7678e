"""Distributed sharding, the step broadcast and ``launch``, on real ring groups of local processes.

Multi-rank runs go through ``python -m mlx_infer.distributed.launch`` (ring backend, 127.0.0.1, or network
namespaces reached through an ssh stand-in) and compare against a single process: sharded greedy tokens
must equal the unsharded ones, and every architecture's sharded logits must equal its unsharded logits.
SmolLM2's pipeline runs on the default path users run (int16 activations, native block ops on every rank)
as well as on conftest's exact float32 one: the same kernels on every rank, so the same tokens and the same
log-probabilities, bit for bit.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import TINY_LLAMA_CONFIG, make_tiny_llama, write_hf_folder
from engine_helpers import greedy_reference
from mlx.utils import tree_flatten

from mlx_infer import cpu_kernels
from mlx_infer.distributed import hostfile, launch, shard_pipeline, shard_tensor
from mlx_infer.distributed.channel import StepChannel, decode_step, encode_step
from mlx_infer.distributed.pipeline import layer_ranges
from mlx_infer.distributed.runtime import Session, load_sharded
from mlx_infer.distributed.tensor import _keep_columns, _keep_rows, _shard_mlp
from mlx_infer.distributed.traffic import Traffic
from mlx_infer.engine.engine import EngineConfig
from mlx_infer.errors import DistributedError, InvalidRequest
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.models.native_block import NativeBlock

PY = sys.executable
TESTS = Path(__file__).parent
# faulthandler: a worker killed by a signal prints its Python stack (what it was doing) to stderr.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONFAULTHANDLER": "1"}
# The default path (int16 activations in the native products) and the exact one, for worker subprocesses.
ACTIVATION_ENVS = {kind: {**ENV, cpu_kernels.ACTIVATIONS_ENV_VAR: kind} for kind in ("int16", "float32")}
# A tiny Llama whose heads (and KV heads, and MLP columns) divide by 2 and by 3.
TINY_TP = dict(
    hidden_size=96, num_attention_heads=6, num_key_value_heads=6, intermediate_size=192, num_hidden_layers=3
)
TINY_PROMPT = "w1 w2 w3 w4 w5"
FRANCE = "What is the capital of France?"


class FakeGroup:
    """What the shard transforms read of a group (they communicate only when the model runs)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def free_port(count: int = 4) -> int:
    """A port p such that p .. p + count - 1 look free (ranks listen on consecutive ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + count < 65000 and all(_free(port + k) for k in range(count)):
            return port
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_launch(*args: str, timeout: float = 150, env: dict = ENV) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "mlx_infer.distributed.launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=TESTS.parent,
    )


def results(out: str) -> dict[int, dict]:
    """Each rank's ``RESULT`` line, by rank."""
    found = {}
    for line in out.splitlines():
        if "RESULT {" in line:
            data = json.loads(line.split("RESULT ", 1)[1])
            found[data["rank"]] = data
    return found


def worker_args(model: Path, prompt: str, max_tokens: int, raw: bool, *extra: str) -> list[str]:
    args = [
        "python",
        "-m",
        "mlx_infer.distributed.worker",
        "-m",
        str(model),
        "-p",
        prompt,
        "--max-tokens",
        str(max_tokens),
    ]
    return args + (["--no-chat-template", "--ignore-eos"] if raw else []) + list(extra)


def launched(
    hosts: str, strategy: str, model: Path, prompt: str, max_tokens: int, raw: bool, *extra: str,
    env: dict = ENV, worker: tuple[str, ...] = (),
) -> dict[int, dict]:
    """Each rank's ``RESULT`` of a launched worker run (rank 0's holds the tokens); ``extra``: launch's
    arguments, ``worker``: the worker's."""
    done = run_launch(
        "--hosts",
        hosts,
        "--port",
        str(free_port()),
        "--strategy",
        strategy,
        *extra,
        "--",
        *worker_args(model, prompt, max_tokens, raw, *worker),
        env=env,
    )
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-3000:]
    by_rank = results(done.stdout)
    assert sorted(by_rank) == list(range(len(hosts.split(",")))), done.stdout[-2000:]
    for line in done.stdout.splitlines():  # every line of output names its rank
        assert line.startswith("[rank "), line
    return by_rank


def launched_tokens(*args, **kwargs) -> list[int]:
    return launched(*args, **kwargs)[0]["tokens"]


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tiny_tp(tmp_path_factory) -> tuple[Path, list[int]]:
    """A tiny Llama folder and its greedy continuation of TINY_PROMPT by an uncached full forward."""
    folder = tmp_path_factory.mktemp("dist") / "tiny-tp"
    model = make_tiny_llama(3, **TINY_TP)
    write_hf_folder(folder, dict(tree_flatten(model.parameters())), {**TINY_LLAMA_CONFIG, **TINY_TP})
    from mlx_infer.loading import load

    prompt_ids = load(str(folder)).tokenizer.encode(TINY_PROMPT)
    return folder, greedy_reference(model, prompt_ids, 24, eos=None)


@pytest.fixture(scope="module")
def smol_reference(smollm2_path: Path) -> Callable[[str], dict]:
    """Single-process greedy run of SmolLM2 for FRANCE, through the same worker without a group, by
    activations (the ``RESULT``: tokens and their log-probabilities)."""

    @functools.cache
    def run(activations: str) -> dict:
        done = subprocess.run(
            [
                PY,
                "-m",
                "mlx_infer.distributed.worker",
                "-m",
                str(smollm2_path),
                "-p",
                FRANCE,
                "--max-tokens",
                "12",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=ACTIVATION_ENVS[activations],
        )
        assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-3000:]
        result = results(done.stdout)[0]
        assert result["native_blocks"] == result["layers"] == 30, result
        return result

    return run


@pytest.fixture(scope="module")
def netns(tmp_path_factory):
    """Two network namespaces on a bridge (10.77.0.1, 10.77.0.2) and an ssh stand-in that enters them."""
    tag = f"{os.getpid() % 100000}"
    bridge, spaces = f"mlxd{tag}br", [f"mlxd{tag}n{i}" for i in range(2)]
    addresses = [f"10.77.0.{i + 1}" for i in range(2)]
    created: list[str] = []

    def ip(*args: str, ns: str | None = None) -> None:
        cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    try:
        try:
            ip("link", "add", bridge, "type", "bridge")
            created.append("bridge")
            ip("link", "set", bridge, "up")
            for i, (ns, addr) in enumerate(zip(spaces, addresses)):
                ip("netns", "add", ns)
                created.append(ns)
                host_end, ns_end = f"mlxd{tag}h{i}", f"mlxd{tag}p{i}"
                ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
                ip("link", "set", ns_end, "netns", ns)
                ip("link", "set", host_end, "master", bridge)
                ip("link", "set", host_end, "up")
                ip("addr", "add", f"{addr}/24", "dev", ns_end, ns=ns)
                ip("link", "set", ns_end, "up", ns=ns)
                ip("link", "set", "lo", "up", ns=ns)
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            pytest.skip(f"cannot create network namespaces here: {getattr(e, 'stderr', e)}")
        stand_in = tmp_path_factory.mktemp("ssh") / "ssh-netns"
        cases = "\n".join(f"  {addr}) ns={ns};;" for ns, addr in zip(spaces, addresses))
        stand_in.write_text(
            textwrap.dedent("""\
            #!/bin/bash
            # ssh stand-in: "ssh-netns HOST SCRIPT" runs SCRIPT inside HOST's network namespace.
            case "$1" in
            {cases}
              *) echo "ssh-netns: unknown host $1" >&2; exit 255;;
            esac
            shift
            exec ip netns exec "$ns" bash -c "$*"
            """).format(cases=cases)
        )
        stand_in.chmod(0o755)
        yield {"hosts": ",".join(addresses), "ssh": str(stand_in)}
    finally:
        for ns in spaces:
            if ns in created:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if "bridge" in created:
            subprocess.run(["ip", "link", "del", bridge], capture_output=True)


# ------------------------------------------------------------------------------- units (one process)
def test_layer_ranges_follow_the_weights_and_give_every_rank_a_layer():
    assert layer_ranges(30, [1, 1]) == [(0, 15), (15, 30)]
    assert layer_ranges(30, [64, 128, 64]) == [(0, 8), (8, 22), (22, 30)]
    assert layer_ranges(3, [100, 1, 1]) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(DistributedError, match="at least 3 layers"):
        layer_ranges(2, [1, 1, 1])


def test_tensor_parallel_refuses_heads_that_do_not_divide():
    model = make_tiny_llama(0, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(DistributedError, match=r"attention heads \(4\) and KV heads \(2\) to divide by 3"):
        shard_tensor(model, FakeGroup(0, 3))


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_row_and_column_shards_match_the_dequantized_slices(bits: int):
    mx.random.seed(0)
    full = nn.Linear(128, 96, bias=True)
    q = nn.QuantizedLinear.from_linear(full, group_size=32, bits=bits)
    dense = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=bits)
    x = mx.random.normal((3, 128))
    rows = nn.QuantizedLinear.from_linear(full, group_size=32, bits=bits)
    _keep_rows(rows, [(0, 16), (48, 80)])
    expected = x @ mx.concatenate([dense[0:16], dense[48:80]]).T + mx.concatenate(
        [q.bias[0:16], q.bias[48:80]]
    )
    assert np.allclose(rows(x), expected, atol=1e-4)
    cols = nn.QuantizedLinear.from_linear(full, group_size=32, bits=bits)
    _keep_columns(cols, (64, 128), rank=1)  # not rank 0: the bias is left to rank 0
    assert np.allclose(cols(x[:, 64:]), x[:, 64:] @ dense[:, 64:].T, atol=1e-4)
    with pytest.raises(DistributedError, match="quantization group"):
        _keep_columns(nn.QuantizedLinear.from_linear(full, group_size=32, bits=bits), (0, 48), rank=0)


def test_moe_with_a_shared_expert_shards_into_partial_sums():
    """GLM-4.5's MoE layer: routed and shared experts split so that the ranks' outputs add up."""
    from mlx_infer.loading import load

    def moe_layer() -> nn.Module:
        return load(str(TESTS / "oracle" / "tiny" / "glm4_moe")).model.layers[1].mlp

    x = mx.random.normal((5, 64), key=mx.random.key(0))
    full = moe_layer()(x)
    parts = []
    for rank in range(2):
        mlp = moe_layer()
        _shard_mlp(mlp, rank, 2)
        assert mlp.shared_experts.gate_proj.weight.shape[0] == 16
        parts.append(mlp(x))
    np.testing.assert_allclose(parts[0] + parts[1], full, atol=1e-5)


def test_step_broadcast_rebuilds_identical_metadata():
    # State slots as a hybrid model's slot pool hands them out (not the batch order).
    slices = [SequenceSlice([7, 3, 9], 20, 5, state_slot=2), SequenceSlice([2], 0, 1, state_slot=0),
              SequenceSlice([4, 8], 14, 3, state_slot=5)]  # fmt: skip
    tokens = np.arange(9, dtype=np.int32) + 5
    for all_logits in (False, True):
        slices[0].want_all_logits = all_logits
        meta = build_metadata(slices, 16)
        got_tokens, got = decode_step(encode_step(tokens, meta))
        assert got_tokens.tolist() == tokens.tolist()
        for name in (
            "positions",
            "slot_mapping",
            "block_tables",
            "context_lens",
            "key_slots",
            "q_pad_index",
            "q_unpad_index",
            "q_positions",
            "logits_index",
            "state_slots",
        ):
            assert np.array_equal(np.array(getattr(got, name)), np.array(getattr(meta, name))), name
        assert got.query_lens == meta.query_lens and got.block_size == meta.block_size


@pytest.mark.slow
def test_a_pipeline_rank_materializes_only_its_share(smollm2_path: Path):
    from mlx_infer.loading import load

    def measure(loader):
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        loaded = loader()
        return loaded, mx.get_active_memory() - base, mx.get_peak_memory() - base

    # Dequantized to float32, so that the layers (not the file's packed tensors) dominate memory.
    full, full_kept, full_peak = measure(lambda: load(str(smollm2_path), keep_quantized=False))
    del full
    (loaded, shard), kept, peak = measure(
        lambda: load_sharded(str(smollm2_path), lambda m: shard_pipeline(m, FakeGroup(1, 2)), False)
    )
    assert (shard.start, shard.stop) == (15, 30) and len(loaded.model.layers) == 15
    assert "embed_tokens" not in loaded.model.model  # rank 0 embeds and applies the (tied) head
    # Half the layers and no embedding stay resident. The peak also holds the GGUF file's quantized
    # tensors, which mx.load reads whole (it is lazy for safetensors only), hence the looser bound.
    assert kept < 0.45 * full_kept, (kept, full_kept)
    assert peak < 0.6 * full_peak, (peak, full_peak)


@pytest.mark.slow
def test_a_follower_sets_its_shard_up_as_the_runner_does(smollm2_path: Path):
    """Rank 1 of a pipeline computes its layers with native block ops, as rank 0's runner (and one
    process) does: the same kernels for the same layers."""
    loaded, shard = load_sharded(str(smollm2_path), lambda m: shard_pipeline(m, FakeGroup(1, 2)))

    class Stopped:  # rank 0 closed the session before any step
        def receive(self) -> None:
            return None

    session = Session(loaded, FakeGroup(1, 2), shard, Stopped(), EngineConfig(num_blocks=4))
    session.follow()
    assert len(loaded.model.layers) == 15
    assert all(isinstance(block, NativeBlock) for block in loaded.model.layers)


def test_dry_run_prints_the_host_file_and_one_command_per_rank(capsys, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(cpu_kernels.ACTIVATIONS_ENV_VAR, "float32")  # ssh would not carry it to the hosts
    assert (
        launch.main(
            [
                "--hosts",
                "127.0.0.1,127.0.0.1,127.0.0.1",
                "--port",
                "40100",
                "--strategy",
                "tensor",
                "--dry-run",
                "--",
                "generate",
                "-m",
                "M",
                "-p",
                "hi there",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    table = json.loads(out[: out.index("# rank 0")])
    assert table["backend"] == "ring" and [h["ips"] for h in table["hosts"]] == [["127.0.0.1"]] * 3
    commands = [line for line in out.splitlines() if line.startswith("bash -c")]
    assert len(commands) == 3
    for rank, line in enumerate(commands):
        assert f"export MLX_RANK={rank};" in line and "MLX_INFER_STRATEGY=tensor" in line
        assert "export MLX_INFER_CPU_ACTIVATIONS=float32;" in line
        assert "127.0.0.1:40100" in line and "127.0.0.1:40102" in line
        assert f"{PY} -m mlx_infer.cli generate -m M -p" in line
    # One host is a plain process: no ring (mlx.launch 0.32.4 crashes on a one-rank ring).
    assert launch.main(["--hosts", "127.0.0.1", "--dry-run", "--", "generate", "-m", "M"]) == 0
    assert "MLX_RANK" not in capsys.readouterr().out


def test_jaccl_host_file_matches_the_mlx_format(tmp_path: Path, capsys):
    from mlx._distributed_utils.common import Hostfile  # mlx.launch's own reader: the format oracle

    hosts = [
        {
            "ssh": f"mac{i}",
            "ips": [f"192.0.2.{i + 1}"],
            "rdma": [None if j == i else f"rdma_en{j + 2}" for j in range(3)],
        }
        for i in range(3)
    ]
    source = tmp_path / "in.json"
    source.write_text(json.dumps({"backend": "jaccl", "envs": [], "hosts": hosts}))
    saved = tmp_path / "out.json"
    assert (
        launch.main(
            [
                "--hostfile",
                str(source),
                "--port",
                "5000",
                "--ssh",
                "fake-ssh",
                "--dry-run",
                "--save-hostfile",
                str(saved),
                "--",
                "serve",
                "-m",
                "M",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    parsed = Hostfile.from_file(saved)
    assert parsed.backend == "jaccl" and "MLX_JACCL_COORDINATOR=192.0.2.1:5000" in parsed.envs
    assert [h.rdma for h in parsed.hosts] == [h["rdma"] for h in hosts]
    assert all(h.rdma[i] is None for i, h in enumerate(parsed.hosts))
    commands = [line for line in out.splitlines() if line.startswith("fake-ssh ")]
    assert [c.split()[1] for c in commands] == ["mac0", "mac1", "mac2"]
    matrix = json.dumps([h["rdma"] for h in hosts])
    for c in commands:
        assert "MLX_IBV_DEVICES" in c and matrix in c.replace("'\"'\"'", "'")
        assert "MLX_JACCL_COORDINATOR=192.0.2.1:5000" in c and "MLX_INFER_BACKEND=jaccl" in c
    # A device towards itself, or none towards a peer, is refused before anything starts.
    hosts[1]["rdma"][1] = "rdma_en9"
    source.write_text(json.dumps({"backend": "jaccl", "hosts": hosts}))
    with pytest.raises(DistributedError, match="mac1 must have null"):
        launch.run(_launch_args(["--hostfile", str(source), "--dry-run", "--", "serve"]))
    with pytest.raises(DistributedError, match="RDMA devices"):
        launch.run(
            _launch_args(["--hosts", "127.0.0.1,127.0.0.1", "--backend", "jaccl", "--dry-run", "--", "serve"])
        )
    with pytest.raises(InvalidRequest, match="no command") as usage:  # a usage error (2), not a host's (6)
        launch.run(_launch_args(["--hosts", "127.0.0.1,127.0.0.1", "--dry-run"]))
    assert usage.value.exit_code == 2


def _launch_args(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    return parser.parse_args(argv)


def test_host_list_resolves_names_and_ring_ports_count_up():
    table = hostfile.from_list("127.0.0.1,localhost")
    assert [h.ips for h in table.hosts] == [["127.0.0.1"], ["127.0.0.1"]]
    assert hostfile.ring_addresses(table.hosts, 100) == [["127.0.0.1:100"], ["127.0.0.1:101"]]
    with pytest.raises(DistributedError, match="ports 65535 to 65536, past 65535"):
        hostfile.ring_addresses(table.hosts, 65535)


def test_a_host_file_of_another_shape_is_refused_saying_the_expected_one(tmp_path: Path):
    runtime = tmp_path / "runtime.json"  # MLX's own runtime format (MLX_HOSTFILE), not a launch host file
    runtime.write_text('[["127.0.0.1:18250"], ["127.0.0.1:18251"]]')
    with pytest.raises(DistributedError, match='expected a list of {"ssh": HOST, "ips"') as e:
        hostfile.read(runtime)
    assert "indices" not in str(e.value)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(DistributedError, match="bad.json: not JSON"):
        hostfile.read(tmp_path / "bad.json")


def test_a_rank_whose_peer_never_joins_stops_saying_so(tmp_path: Path):
    # MLX's join would wait forever for a peer that never starts (an ssh that connected and hung).
    port = free_port(2)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    env = {**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hosts), "MLX_INFER_JOIN_TIMEOUT": "2"}
    code = "from mlx_infer.distributed.runtime import init_group; init_group()"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "rank 0: the ring group did not form within 2 s (a peer never joined" in result.stderr


def test_generate_prompt_from_stdin_is_read_by_launch(monkeypatch: pytest.MonkeyPatch):
    """No rank has launch's stdin (rank 0 may be another host): ``-p -`` is replaced by what it holds."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2+2?\n"))
    command = ["generate", "-m", "M", "-p", "-", "--max-tokens", "4"]
    expected = ["generate", "-m", "M", "-p", "What is 2+2?", "--max-tokens", "4"]  # echo's newline gone
    assert launch.prompt_from_stdin(command) == expected
    assert launch.prompt_from_stdin(["generate", "-p", "hi"]) == ["generate", "-p", "hi"]


# --------------------------------------------------------------------------------- ring groups
ZOO_RANK = """
import sys
sys.path.insert(0, {tests!r})
import mlx_infer  # noqa: F401  (BLAS binding first)
import mlx.core as mx
import numpy as np
from test_models import BLOCK, CONFIGS, NUM_BLOCKS, build, hf_weights
from mlx_infer.distributed import shard_pipeline, shard_tensor
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import new_cache

from mlx_infer.distributed.runtime import init_group
group = init_group()
rank, size = group.rank(), group.size()
tokens = [list(range(3, 12)), list(range(20, 25))]
tables = [[5, 2, 7], [1, 9]]
# (sequence, first token, count) per step: a prefill chunk, a ragged chunk+prefill, a two-sequence decode.
steps = [[(0, 0, 6)], [(0, 6, 2), (1, 0, 4)], [(0, 8, 1), (1, 4, 1)]]

def run(model, cache, drive):
    out = []
    for step in steps:
        slices = [SequenceSlice(tables[s], a, n) for s, a, n in step]
        ids = mx.array([t for s, a, n in step for t in tokens[s][a : a + n]])
        out.append(drive(model, ids, cache, build_metadata(slices, BLOCK)))
    return out

def with_kv_heads(cfg, n):
    inner = cfg.get("text_config", cfg)
    if inner["num_key_value_heads"] % n == 0:
        return cfg
    fixed = dict(inner, num_key_value_heads=n)
    return dict(cfg, text_config=fixed) if "text_config" in cfg else fixed

worst = 0.0
for name in sorted(CONFIGS):
    cfg = with_kv_heads(CONFIGS[name], size)
    weights = hf_weights(cfg, seed=1)
    ref = build(cfg, weights)
    ref_cache = new_cache(ref, NUM_BLOCKS, BLOCK, mx.float32)
    expected = [np.array(x) for x in run(ref, ref_cache, lambda m, t, c, meta: m(t, c, meta))]
    for strategy in ("pipeline", "tensor"):
        model = build(cfg, weights)
        shard = (shard_pipeline if strategy == "pipeline" else shard_tensor)(model, group)
        cache = new_cache(model, NUM_BLOCKS, BLOCK, mx.float32)
        if rank == 0:
            got = [np.array(x) for x in run(model, cache, shard.leader)]
            diff = max(float(np.abs(g - e).max()) for g, e in zip(got, expected))
            worst = max(worst, diff)
            print(f"ZOO {{name}} {{strategy}} {{diff:.2e}}", flush=True)
        else:
            run(model, cache, lambda *a: mx.eval(shard.follower(*a)))
sys.exit(0 if worst < 1e-4 else 1)
"""


def test_every_architecture_shards_to_the_same_logits(tmp_path: Path):
    script = tmp_path / "zoo_rank.py"
    script.write_text(ZOO_RANK.format(tests=str(TESTS)))
    done = run_launch("--hosts", "127.0.0.1,127.0.0.1", "--port", str(free_port()), "--", str(script))
    lines = [line for line in done.stdout.splitlines() if "ZOO" in line]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    from test_models import CONFIGS

    assert len(lines) == 2 * len(CONFIGS), lines


# Each rank loads its tensor-parallel shard of tiny checkpoints the way a session does; rank 0 drives a
# ShardedModel (the step broadcast) and compares every step's logits with the unsharded model's, the others
# follow as Session.follow does. Steps: a prompt chunk, the prompt's rest beside a second prompt (ragged),
# then greedy decodes of both, fed the sharded model's own argmax.
TP_RANK = """
import json, sys
sys.path.insert(0, {tests!r})
import mlx_infer  # noqa: F401  (BLAS binding first)
import mlx.core as mx
import numpy as np
from mlx_infer.distributed import shard_tensor
from mlx_infer.distributed.channel import StepChannel
from mlx_infer.distributed.runtime import Session, ShardedModel, init_group, load_sharded
from mlx_infer.engine.engine import EngineConfig, hybrid_state
from mlx_infer.engine.runner import kv_bytes_per_token
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.kv.pages import allocate_pools, owned, states
from mlx_infer.loading import load
from mlx_infer.plan.planner import layout_state_bytes

BLOCK, NUM_BLOCKS = 4, 16
group = init_group()
rank = group.rank()
prompts = [list(range(3, 17)), list(range(40, 45))]
tables = [[5, 2, 7, 11, 0], [1, 9, 3]]
state_slots = [3, 1]  # hybrids: rank 0's slot pool's choice, which the broadcast carries
for name in {names!r}:
    spec = {tiny!r} + "/" + name
    loaded, shard = load_sharded(spec, lambda m: shard_tensor(m, group))
    model = loaded.model
    # Rank 0 drives the steps by hand, with one block table for every layer (no sliding-window pool).
    config = EngineConfig(
        num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_cache_dtype="float32", window_pool=False
    )
    session = Session(loaded, group, shard, StepChannel(group, shard.traffic), config)
    # What the planner counts a token (kv_layout) is what this rank's pools hold.
    slots = max(1, hybrid_state(model, config)[0])
    cache = allocate_pools(model, NUM_BLOCKS, BLOCK, mx.float32, slots)
    pools = sum(a.nbytes for kv in owned(cache) for a in kv.state())
    per_token = kv_bytes_per_token(model, mx.float32)
    assert pools == per_token * NUM_BLOCKS * BLOCK, (name, pools, per_token)
    state = layout_state_bytes(model.kv_layout())
    assert sum(a.nbytes for s in states(cache) for a in s.state()) == state * slots, (name, state)
    print("KV", json.dumps(dict(name=name, rank=rank, per_token=per_token, state=state)), flush=True)
    if rank:
        session.follow()
        continue
    ref = load(spec).model
    # One process's bytes a token, and a tensor rank's: the whole latent row (MLA), else half the KV
    # heads, or one where a layer has a single KV head.
    full_per_token = kv_bytes_per_token(ref, mx.float32)
    full_state = layout_state_bytes(ref.kv_layout())
    rows = [spec.head_dim if spec.values_in_keys else 2 * max(1, spec.n_kv_heads // 2) * spec.head_dim
            for spec in ref.kv_layout() if spec.owns_pool]
    rank_per_token = 4 * sum(rows)
    sharded = ShardedModel(model, shard, session.channel)
    ref_cache = allocate_pools(ref, NUM_BLOCKS, BLOCK, mx.float32, slots)
    seqs = [list(p) for p in prompts]
    steps = [[(0, 0, 8)], [(0, 8, 6), (1, 0, 5)]] + [[(0, None, 1), (1, None, 1)]] * 6
    done = [0, 0]
    worst, same = 0.0, True
    for step in steps:
        ids, slices = [], []
        for s, start, n in step:
            start = done[s] if start is None else start
            ids += seqs[s][start : start + n]
            slices.append(SequenceSlice(tables[s], start, n, state_slot=state_slots[s]))
            done[s] = start + n
        meta = build_metadata(slices, BLOCK)
        got = np.array(sharded(mx.array(ids), cache, meta))
        want = np.array(ref(mx.array(ids), ref_cache, meta))
        worst = max(worst, float(np.abs(got - want).max()))
        same &= bool((got.argmax(-1) == want.argmax(-1)).all())
        if all(done[s] == len(seqs[s]) for s in (0, 1)):
            for s in (0, 1):
                seqs[s].append(int(got[s].argmax()))
    session.close()
    print("TP", json.dumps(dict(name=name, diff=worst, greedy_equal=same, tokens=seqs, full_state=full_state,
                               full_per_token=full_per_token, rank_per_token=rank_per_token)), flush=True)
"""
TP_TINY = ("deepseek_v3", "deepseek_v2", "kimi_k25", "glm4_moe_lite", "gemma4_text", "gemma4", "qwen3_next",
           "qwen3_5_text", "qwen3_5_moe_text")  # fmt: skip


def test_tensor_parallel_runs_latent_attention_gemma4_and_hybrids_as_one_process(tmp_path: Path):
    """MLA (DeepSeek V3 / V2, Kimi K2.5, GLM-4.7-Flash), Gemma 4 (KV shared across layers, per-layer
    inputs; routed experts) and the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5 dense and MoE): two ranks
    give one process's float32 logits through a chunked, ragged prefill and greedy decodes. An MLA rank's
    pool holds every latent row (one process's size), the others' half the KV heads (a single KV head on
    both ranks), a hybrid rank's state slots half of each state; each rank allocates what its kv_layout
    says a token and a sequence's state cost."""
    script = tmp_path / "tp_rank.py"
    script.write_text(TP_RANK.format(tests=str(TESTS), tiny=str(TESTS / "oracle" / "tiny"), names=TP_TINY))
    done = run_launch("--hosts", "127.0.0.1,127.0.0.1", "--port", str(free_port()), "--", str(script))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = {r["name"]: r for r in _tagged(done.stdout, "TP")}
    kv = _tagged(done.stdout, "KV")
    assert sorted(runs) == sorted(TP_TINY), done.stdout[-3000:]
    for name, run in runs.items():
        assert run["diff"] < 1e-4 and run["greedy_equal"], run
        per_rank = {r["rank"]: r["per_token"] for r in kv if r["name"] == name}
        assert per_rank[0] == per_rank[1], per_rank
        mla = name.startswith(("deepseek", "kimi", "glm"))
        assert per_rank[0] == run["rank_per_token"], (name, per_rank, run)
        assert (per_rank[0] == run["full_per_token"]) == mla, (name, per_rank, run)
        state = {r["rank"]: r["state"] for r in kv if r["name"] == name}
        assert state[0] == state[1] == run["full_state"] // 2, (name, state, run)


@pytest.mark.parametrize(
    ("name", "strategy"),
    [("deepseek_v3", "tensor"), ("gemma4_text", "tensor"), ("qwen3_next", "tensor"),
     ("qwen3_5_text", "pipeline")],  # fmt: skip
)
def test_sharded_engine_answers_mla_gemma4_and_hybrids_as_one_process(name: str, strategy: str):
    """The whole path (launch, rank 0's engine over the step broadcast, followers' sessions; hybrids'
    state slots on every rank): the same greedy tokens as one process."""
    folder = TESTS / "oracle" / "tiny" / name
    one = subprocess.run(
        [PY, *worker_args(folder, TINY_PROMPT, 10, True)[1:]], capture_output=True, text=True, timeout=150,
        env=ENV, cwd=TESTS.parent,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-2000:]
    expected = results(one.stdout)[0]["tokens"]
    assert launched_tokens("127.0.0.1,127.0.0.1", strategy, folder, TINY_PROMPT, 10, True) == expected


@pytest.mark.parametrize(
    "name,strategy", [("gemma3_text", "tensor"), ("gpt_oss", "tensor"), ("gemma3_text", "pipeline")]
)
def test_sliding_window_pools_on_every_rank(name: str, strategy: str):
    """Sliding-window layers keep their own pool on every rank, paged by rank 0's windowed block tables
    in the step broadcast: a prompt crossing the window several times, and the greedy tokens (with their
    log-probabilities) of one process."""
    folder = TESTS / "oracle" / "tiny" / name
    prompt = " ".join(f"w{i % 7}" for i in range(40))  # far past the window of 8
    one = subprocess.run(
        [PY, *worker_args(folder, prompt, 12, True, "--num-blocks", "64")[1:]], capture_output=True,
        text=True, timeout=150, env=ENV, cwd=TESTS.parent,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-2000:]
    alone = results(one.stdout)[0]
    by_rank = launched(
        "127.0.0.1,127.0.0.1", strategy, folder, prompt, 12, True, worker=("--num-blocks", "64")
    )
    assert by_rank[0]["tokens"] == alone["tokens"]
    np.testing.assert_allclose(by_rank[0]["logprobs"], alone["logprobs"], atol=1e-4)
    assert by_rank[0]["window_blocks"] == by_rank[1]["window_blocks"] == alone["window_blocks"] > 0


def _tagged(out: str, tag: str) -> list[dict]:
    return [json.loads(line.split(f"{tag} ", 1)[1]) for line in out.splitlines() if f"] {tag} {{" in line]


@pytest.mark.parametrize("hosts", ["127.0.0.1,127.0.0.1", "127.0.0.1,localhost,127.0.0.1"])
def test_tensor_parallel_greedy_equals_one_process(tiny_tp, hosts: str):
    folder, expected = tiny_tp
    assert launched_tokens(hosts, "tensor", folder, TINY_PROMPT, len(expected), True) == expected


def test_pipeline_with_int8_kv_equals_one_process(tiny_tp):
    """--kv-cache-dtype reaches every rank (each parses the worker's flags): rank 0's engine and the
    followers' pools are int8, and the greedy tokens are one process's with int8 KV."""
    folder, _ = tiny_tp
    kv = ("--kv-cache-dtype", "int8")
    one = subprocess.run(
        [PY, *worker_args(folder, TINY_PROMPT, 12, True, *kv)[1:]], capture_output=True, text=True,
        timeout=150, env=ENV, cwd=TESTS.parent,
    )
    assert one.returncode == 0 and "KV cache: int8, " in one.stderr, one.stderr[-2000:]
    done = run_launch("--hosts", "127.0.0.1,127.0.0.1", "--port", str(free_port()), "--strategy", "pipeline",
                      "--", *worker_args(folder, TINY_PROMPT, 12, True, *kv))
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-3000:]
    assert "KV cache: int8, " in done.stdout + done.stderr
    assert results(done.stdout)[0]["tokens"] == results(one.stdout)[0]["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "activations"), [(2, "int16"), (3, "int16"), (2, "float32")])
def test_pipeline_on_smollm2_computes_what_one_process_computes(
    smollm2_path: Path, smol_reference, ranks: int, activations: str
):
    """Same kernels, same per-layer arithmetic: the same greedy tokens and log-probabilities, bit for bit,
    with every rank's layers as native block ops."""
    hosts = ",".join(["127.0.0.1"] * ranks)
    env = ACTIVATION_ENVS[activations]
    by_rank = launched(hosts, "pipeline", smollm2_path, FRANCE, 12, False, env=env)
    expected = smol_reference(activations)
    assert by_rank[0]["tokens"] == expected["tokens"]
    assert by_rank[0]["logprobs"] == expected["logprobs"]
    assert sum(r["layers"] for r in by_rank.values()) == 30
    assert all(r["native_blocks"] == r["layers"] for r in by_rank.values()), by_rank


@pytest.mark.slow
def test_killing_a_rank_mid_generation_fails_the_launch_quickly(smollm2_path: Path):
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "mlx_infer.distributed.launch",
            "--hosts",
            "127.0.0.1,127.0.0.1",
            "--port",
            str(free_port()),
            "--",
            *worker_args(smollm2_path, "Tell me a long story about a cat.", 400, False),
            "--ignore-eos",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
        cwd=TESTS.parent,
    )
    out, err = bytearray(), bytearray()

    def drain(stream, buf):
        while chunk := os.read(stream.fileno(), 4096):
            buf.extend(chunk)

    threads = [
        threading.Thread(target=drain, args=(s, b), daemon=True)
        for s, b in ((proc.stdout, out), (proc.stderr, err))
    ]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while b"[rank 0] " not in out and time.monotonic() < deadline:  # rank 0 is streaming tokens
            assert proc.poll() is None, err.decode()[-2000:]
            time.sleep(0.1)
        assert b"[rank 0] " in out, err.decode()[-2000:]
        pids = {int(line.split()[-1]) for line in err.decode().splitlines() if "rank 1 on" in line}
        assert len(pids) == 1, err.decode()
        os.kill(pids.pop(), signal.SIGKILL)
        killed_at = time.monotonic()
        code = proc.wait(timeout=30)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    for t in threads:
        t.join(timeout=5)
    assert code != 0 and elapsed < 30
    assert "rank 1 (127.0.0.1) was killed by signal 9 (SIGKILL)" in err.decode(), err.decode()[-2000:]
    rank0 = [int(line.split()[-1]) for line in err.decode().splitlines() if "rank 0 on" in line][0]
    assert not Path(f"/proc/{rank0}").exists()  # stopped and reaped: no orphan


# ------------------------------------------------------------------------------- network namespaces
def _launched_server(model: Path, *serve_args: str) -> tuple[subprocess.Popen, int]:
    """``launch`` of two local ranks serving ``model``, once it answers /health; returns it and its port."""
    http = free_port(1)
    proc = subprocess.Popen(
        [PY, "-m", "mlx_infer.distributed.launch", "--hosts", "127.0.0.1,127.0.0.1", "--port",
         str(free_port()), "--", "serve", "-m", str(model), "--port", str(http), *serve_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=TESTS.parent,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read()[-3000:])
        try:
            if httpx.get(f"http://127.0.0.1:{http}/health", timeout=2).status_code == 200:
                return proc, http
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("the launched server never answered /health")


def _no_rank_left(out: str) -> bool:
    pids = [int(line.split()[-1]) for line in out.splitlines() if re.search(r"rank \d on \S+: pid", line)]
    return len(pids) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_sigterm_stops_a_launched_server_cleanly(tiny_tp):
    """SIGTERM to launch: rank 0's server shuts down as one process does (exit 0) and tells the others to
    stop (no lost-peer errors), and no rank is left."""
    folder, _ = tiny_tp
    proc, _ = _launched_server(folder)
    try:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "internal error" not in out and "connection to a peer was lost" not in out, out[-3000:]
    assert _no_rank_left(out), out[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL])
def test_a_launch_hung_up_on_or_killed_leaves_no_rank_running(tiny_tp, sig):
    """A closed terminal (SIGHUP) stops the job as SIGTERM does; a launch killed outright (its ranks run in
    sessions of their own) is noticed by its local ranks, which stop too."""
    folder, _ = tiny_tp
    proc, _ = _launched_server(folder)
    try:
        proc.send_signal(sig)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == (0 if sig == signal.SIGHUP else -signal.SIGKILL), out[-3000:]  # serve's stop: 0
    deadline = time.monotonic() + 30
    while not _no_rank_left(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _no_rank_left(out), out[-3000:]


def _stream_signalled(proc: subprocess.Popen, http: int, max_tokens: int, *signals: int) -> list[dict]:
    """A long greedy stream from a launched server: once it streams, ``signals`` go to launch a second
    apart; returns the chunks that came after."""
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"http://127.0.0.1:{http}/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        for i, sig in enumerate(signals):
            time.sleep(1.0 if i else 0.0)
            proc.send_signal(sig)
        return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


@pytest.mark.slow
def test_sigterm_lets_a_launched_servers_requests_finish(smollm2_path: Path):
    """As ``serve`` alone: a stream running when launch gets SIGTERM finishes within --shutdown-timeout
    (the ranks were stopped 3 s after the signal, cutting it with a connection reset)."""
    proc, http = _launched_server(smollm2_path, "--shutdown-timeout", "60")
    try:
        chunks = _stream_signalled(proc, http, 240, signal.SIGTERM)
        out = proc.communicate(timeout=90)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    finish = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert finish == ["length"], out[-3000:]
    assert proc.returncode == 0 and _no_rank_left(out), out[-3000:]


@pytest.mark.slow
def test_a_second_ctrl_c_reaches_a_launched_server_as_its_second_ctrl_c(smollm2_path: Path):
    """As ``serve`` alone: the second Ctrl-C ends the running stream with its final error and the exit
    status is 130 (the ranks were killed, the stream cut by a reset)."""
    proc, http = _launched_server(smollm2_path)
    try:
        chunks = _stream_signalled(proc, http, 4000, signal.SIGINT, signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    errors = [chunk["error"]["message"] for chunk in chunks if "error" in chunk]
    assert errors == ["the server shut down before this request finished"], out[-3000:]
    assert proc.returncode == 130 and _no_rank_left(out), out[-3000:]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_is_refused_across_processes(tiny_tp, method):
    # The other ranks follow plain steps only: a speculative step would leave them waiting for good.
    folder, _ = tiny_tp
    draft = ["--draft-model", str(folder)] if method == "draft" else []
    done = subprocess.run(
        [PY, "-m", "mlx_infer.distributed.launch", "--hosts", "127.0.0.1,127.0.0.1", "--port",
         str(free_port()), "--", "generate", "-m", str(folder), "-p", "w1", "--max-tokens", "4",
         "--speculative", method, *draft],
        capture_output=True, text=True, timeout=120, env=ENV, cwd=TESTS.parent,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"--speculative {method} is not supported across several processes" in done.stderr


def test_a_follower_that_lost_rank_0_says_so(monkeypatch: pytest.MonkeyPatch):
    # Once rank 0's connection is gone the ring's all_sum hands back zeros: a clear error, not a
    # ValueError from decoding an empty step.
    channel = StepChannel(None, Traffic())
    monkeypatch.setattr(channel, "_all_sum", lambda values: mx.array(np.zeros_like(values)))
    with pytest.raises(DistributedError, match="lost rank 0"):
        channel.receive()


def test_stop_grace_is_serves_shutdown_timeout():
    assert launch.stop_grace_s(["generate", "-m", "x"]) == launch.STOP_GRACE_S
    margin = launch.SERVE_STOP_MARGIN_S
    assert launch.stop_grace_s(["serve", "-m", "x"]) == 30 + margin
    assert launch.stop_grace_s(["serve", "--shutdown-timeout", "5"]) == 5 + margin
    assert launch.stop_grace_s(["serve", "--shutdown-timeout=0"]) == margin


def test_ranks_stopped_before_the_ring_leave_no_host_file(tiny_tp, tmp_path):
    """Rank 0 refuses a serve port in use before it joins the ring, and launch stops rank 1 as it waits
    there: neither removed its host file itself, launch does."""
    folder, _ = tiny_tp
    busy = socket.create_server(("127.0.0.1", 0))
    try:
        done = subprocess.run(
            [PY, "-m", "mlx_infer.distributed.launch", "--hosts", "127.0.0.1,127.0.0.1", "--port",
             str(free_port()), "--", "serve", "-m", str(folder), "--port", str(busy.getsockname()[1])],
            capture_output=True, text=True, timeout=120, cwd=TESTS.parent,
            env={**ENV, "TMPDIR": str(tmp_path)},
        )  # fmt: skip
    finally:
        busy.close()
    assert done.returncode == 2 and "Address already in use" in done.stderr + done.stdout, done.stderr
    assert not list(tmp_path.glob("mlx-infer-hosts.*"))


def test_hosts_check_flags_a_ring_port_already_in_use():
    """Before launch nothing of its own listens on the ring's ports: one that answers is taken, and the
    ring would fail to bind it."""
    first = free_port()
    taken = socket.create_server(("127.0.0.1", first + 1))
    try:
        done = subprocess.run(
            [PY, "-m", "mlx_infer.distributed.hosts", "check", "--hosts", "127.0.0.1,127.0.0.1",
             "--python", PY, "--port", str(first)],
            capture_output=True, text=True, timeout=60, env=ENV,
        )  # fmt: skip
    finally:
        taken.close()
    assert done.returncode == 6, done.stdout + done.stderr
    assert f"-> rank 1 127.0.0.1:{first + 1}: IN USE" in done.stdout, done.stdout
    assert f"-> rank 0 127.0.0.1:{first}: reachable" in done.stdout, done.stdout


def test_hosts_check_across_namespaces(netns):
    done = subprocess.run(
        [
            PY,
            "-m",
            "mlx_infer.distributed.hosts",
            "check",
            "--hosts",
            netns["hosts"],
            "--ssh",
            netns["ssh"],
            "--python",
            PY,
            "--port",
            "41000",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0 -> " not in done.stdout  # no Thunderbolt warning off macOS
    assert "-> rank 1 10.77.0.2:41001: reachable" in done.stdout and "from 10.77.0.1" in done.stdout
    assert "-> rank 0 10.77.0.1:41000: reachable" in done.stdout and "from 10.77.0.2" in done.stdout


def test_tensor_parallel_across_namespaces(netns, tiny_tp):
    folder, expected = tiny_tp
    tokens = launched_tokens(
        netns["hosts"], "tensor", folder, TINY_PROMPT, len(expected), True, "--ssh", netns["ssh"]
    )
    assert tokens == expected


@pytest.mark.slow
def test_pipeline_across_namespaces(netns, smollm2_path: Path, smol_reference):
    tokens = launched_tokens(
        netns["hosts"], "pipeline", smollm2_path, FRANCE, 12, False, "--ssh", netns["ssh"],
        env=ACTIVATION_ENVS["int16"],
    )
    assert tokens == smol_reference("int16")["tokens"]


@pytest.mark.slow
def test_distributed_serve_answers_concurrent_requests_like_one_process(smollm2_path: Path, monkeypatch):
    """`launch --hosts 127.0.0.1,127.0.0.1 -- serve`: rank 0 serves and schedules, rank 1 runs its layers;
    concurrent greedy chats equal the same conversations decoded by one process's engine.

    On the default int16 activations (on both sides), whose rows do not depend on the batch: the served
    requests arrive at their own times and are batched differently from the local engine's, and the
    float32 path the rest of the suite pins changes kernels with the row count (a near tie then flips)."""
    import asyncio

    import openai
    from server_helpers import LiveServer

    from mlx_infer import cpu_kernels
    from mlx_infer.engine.engine import Engine
    from mlx_infer.loading import load
    from mlx_infer.sampling import SamplingParams

    monkeypatch.setenv(cpu_kernels.ACTIVATIONS_ENV_VAR, "int16")  # the servers' ranks inherit it

    questions = ["What is the capital of France?", "Name a color.", "What is 2+2?", "Say hello."]
    server = LiveServer(smollm2_path, "--kv-memory", "0.3", launch_hosts="127.0.0.1,127.0.0.1")
    try:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused")

        async def ask(question: str) -> list[int]:
            reply = await client.chat.completions.create(
                model=server.name,
                messages=[{"role": "user", "content": question}],
                temperature=0,
                max_tokens=12,
                logprobs=True,
            )
            return reply.choices[0].message.content

        async def ask_all() -> list[str]:
            return await asyncio.gather(*[ask(q) for q in questions])

        served = asyncio.run(ask_all())
    finally:
        server.stop()

    loaded = load(str(smollm2_path))
    engine = Engine(loaded.model, loaded.tokenizer, loaded.max_context, EngineConfig(kv_memory=0.1))
    ids = [
        engine.add_request(
            loaded.tokenizer.encode_chat([{"role": "user", "content": q}]), SamplingParams(max_tokens=12)
        )
        for q in questions
    ]
    text = {i: "" for i in ids}
    cpu_kernels.set_activations("int16")
    try:
        while engine.has_unfinished():
            for out in engine.step():
                text[out.request_id] += out.text
    finally:
        cpu_kernels.set_activations("float32")
    assert served == [text[i] for i in ids]
