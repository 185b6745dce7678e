"""``mlx-infer convert``: every mode on a tiny model, the real SmolLM2 through mlx-infer and mlx-lm."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import TINY_LLAMA_CONFIG, TINY_WORDS, make_tiny_llama, write_hf_folder
from mlx.utils import tree_flatten, tree_unflatten

from mlx_infer.convert import cli, mlx_lm_layout, output
from mlx_infer.errors import InvalidRequest, ModelNotFound
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import new_cache
from mlx_infer.loading import load, open_checkpoint
from mlx_infer.loading.build import build_model

TINY = Path(__file__).parent / "oracle" / "tiny"


def convert(model: str | Path, out: Path, *flags: str) -> dict:
    """Run the subcommand as the CLI would; return the saved report."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--model", str(model), "--out", str(out), *flags])) == 0
    return json.loads((out / "quantization_report.json").read_text())


@pytest.fixture
def eval_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path / "eval.txt"
    path.write_text(" ".join(TINY_WORDS[i] for i in rng.integers(3, len(TINY_WORDS), 200)))
    return path


def float_weights(folder: Path) -> dict[str, np.ndarray]:
    """The weights mlx-infer's loader gives for ``folder``, dequantized to float32."""
    model = load(str(folder), keep_quantized=False).model
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


# Relative error (Frobenius) that rounding a Gaussian-like weight to each grid stays below, with margin.
RELATIVE_ERROR = {("affine", 2): 0.6, ("affine", 3): 0.3, ("affine", 4): 0.15, ("affine", 5): 0.07,
                  ("affine", 6): 0.035, ("affine", 8): 0.01, ("mxfp4", 4): 0.25, ("nvfp4", 4): 0.2,
                  ("mxfp8", 8): 0.06}


@pytest.mark.parametrize(
    "mode,bits,group",
    [("affine", b, 32) for b in (2, 3, 4, 5, 6, 8)]
    + [("affine", 4, 64), ("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)],
)
def test_every_mode_and_bit_width(tiny_llama_folder: Path, tmp_path: Path, eval_file: Path,
                                  mode: str, bits: int, group: int):
    out = tmp_path / "out"
    report = convert(tiny_llama_folder, out, "--q-mode", mode, "--q-bits", str(bits), "--q-group-size",
                     str(group), "--eval-file", str(eval_file))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": group, "bits": bits, "mode": mode}
    assert config["quantization_config"] == config["quantization"]
    saved = mx.load(str(out / "model.safetensors"))
    assert saved["model.layers.0.mlp.up_proj.weight"].dtype == mx.uint32
    assert ("model.layers.0.mlp.up_proj.biases" in saved) == (mode == "affine")

    # Oracle: each source weight through MLX's own quantize/dequantize with the requested parameters:
    # the converted (saved, reloaded, dequantized) weight must be exactly that, and close to the source.
    source, converted = float_weights(tiny_llama_folder), float_weights(out)
    assert source.keys() == converted.keys()
    for name, w in source.items():
        if w.ndim == 1:
            assert np.array_equal(converted[name], w), name  # norms are not quantized (and stay float32)
            continue
        packed = mx.quantize(mx.array(w), group, bits, mode=mode)
        expected = mx.dequantize(*packed, group_size=group, bits=bits, mode=mode)
        assert np.array_equal(converted[name], np.array(expected.astype(mx.float32))), name
        assert np.linalg.norm(converted[name] - w) / np.linalg.norm(w) < RELATIVE_ERROR[mode, bits], name

    q = report["evaluation"]
    assert 0 <= q["kl_mean"] <= q["kl_max"] and 0 <= q["top1_agreement"] <= 1
    assert q["ppl_source"] > 1 and q["ppl_output"] > 1
    assert report["bits_per_weight"]["output"] < 32


def test_more_bits_less_divergence(tiny_llama_folder: Path, tmp_path: Path, eval_file: Path):
    kl = {b: convert(tiny_llama_folder, tmp_path / f"q{b}", "--q-bits", str(b), "--q-group-size", "32",
                     "--eval-file", str(eval_file))["evaluation"]["kl_mean"] for b in (2, 4, 8)}
    assert kl[8] < kl[4] < kl[2]


def test_self_conversion_is_exact(tiny_llama_folder: Path, tmp_path: Path, eval_file: Path):
    out = tmp_path / "copy"
    report = convert(tiny_llama_folder, out, "--eval-file", str(eval_file))
    assert report["evaluation"]["kl_mean"] == 0 and report["evaluation"]["kl_max"] == 0
    assert report["evaluation"]["top1_agreement"] == 1
    assert report["evaluation"]["ppl_source"] == report["evaluation"]["ppl_output"]
    assert "quantization" not in json.loads((out / "config.json").read_text())
    src, dst = mx.load(str(tiny_llama_folder / "model.safetensors")), mx.load(str(out / "model.safetensors"))
    assert src.keys() == dst.keys() and all(mx.array_equal(src[k], dst[k]) for k in src)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # copied from the HF folder as they are
        assert (out / name).read_bytes() == (tiny_llama_folder / name).read_bytes()


def test_recipe_and_dequantize(tmp_path: Path, eval_file: Path):
    config = {**TINY_LLAMA_CONFIG, "num_hidden_layers": 8}
    src = write_hf_folder(tmp_path / "src", dict(tree_flatten(make_tiny_llama(1, num_hidden_layers=8)
                                                              .parameters())), config)
    mixed = tmp_path / "mixed"
    report = convert(src, mixed, "--recipe", "mixed_3_6", "--q-group-size", "32",
                     "--eval-file", str(eval_file))
    quant = json.loads((mixed / "config.json").read_text())["quantization"]
    defaults = {k: quant[k] for k in ("group_size", "bits", "mode")}
    assert defaults == {"group_size": 32, "bits": 3, "mode": "affine"}
    # Q4_K_M's choice for 8 layers: v_proj/down_proj of layers 0, 3, 6, 7 (first/last eighth, every third).
    high = {f"model.layers.{i}.{m}" for i in (0, 3, 6, 7) for m in ("self_attn.v_proj", "mlp.down_proj")}
    high |= {"model.embed_tokens", "lm_head"}
    overrides = {k for k in quant if k.startswith(("model.", "lm_head"))}
    assert overrides == high and all(quant[k]["bits"] == 6 for k in high)
    saved = mx.load(str(mixed / "model.safetensors"))
    assert saved["lm_head.weight"].shape == (64, 64 * 6 // 32)
    assert saved["model.layers.1.mlp.down_proj.weight"].shape == (64, 128 * 3 // 32)
    assert 3 < report["bits_per_weight"]["output"] < 6
    # The report says the recipe's bits, as config.json does, and what text it was evaluated on.
    assert (report["quantization"]["bits"], report["quantization"]["recipe_high_bits"]) == (3, 6)
    assert report["evaluation"]["text"] == str(eval_file)
    load(str(mixed))  # the overrides rebuild the right shapes

    plain = tmp_path / "plain"
    convert(mixed, plain, "--dequantize", "--dtype", "float32", "--no-eval")
    assert "quantization" not in json.loads((plain / "config.json").read_text())
    dequantized = mx.load(str(plain / "model.safetensors"))
    assert not any(k.endswith(".scales") for k in dequantized)
    assert np.array_equal(float_weights(plain)["lm_head.weight"], float_weights(mixed)["lm_head.weight"])


@pytest.fixture
def mixed_source(tmp_path: Path, tiny_llama_folder: Path) -> Path:
    """An mlx-community style folder: affine 4-bit g32, with the embedding, head and layer 1's v_proj and
    down_proj at 6 bits (mixed_4_6 on two layers)."""
    convert(tiny_llama_folder, tmp_path / "mixed", "--recipe", "mixed_4_6", "--q-group-size", "32",
            "--no-eval")
    return tmp_path / "mixed"


def test_quantized_source_is_copied_exactly(mixed_source: Path, tmp_path: Path, eval_file: Path, capsys):
    """--q-bits 4 on a 4-bit g32 source: the group follows the source, its 4-bit layers are copied bit for
    bit and its 6-bit layers keep their bits (as llama-quantize keeps output.weight)."""
    capsys.readouterr()
    out = tmp_path / "out"
    report = convert(mixed_source, out, "--q-bits", "4", "--eval-file", str(eval_file))
    src, dst = mx.load(str(mixed_source / "model.safetensors")), mx.load(str(out / "model.safetensors"))
    assert src.keys() == dst.keys()
    for k in src:
        assert src[k].dtype == dst[k].dtype and mx.array_equal(src[k], dst[k]), k
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant == json.loads((mixed_source / "config.json").read_text())["quantization"]
    assert quant["model.embed_tokens"]["bits"] == quant["lm_head"]["bits"] == 6 and quant["group_size"] == 32
    assert report["evaluation"]["kl_max"] == 0 and report["evaluation"]["top1_agreement"] == 1
    assert report["layers"] == {"copied": 12, "kept": 4} and report["warnings"] == []
    assert {k["layer"] for k in report["kept_layers"]} == {
        "model.embed_tokens", "lm_head", "model.layers.1.self_attn.v_proj", "model.layers.1.mlp.down_proj"}
    assert "keeping 4 layers" in capsys.readouterr().err
    load(str(out))


@pytest.mark.parametrize("src_bits,src_group,bits,group", [(4, 64, 8, 32), (3, 32, 4, 32), (2, 64, 6, 32)])
def test_wider_grid_holds_the_source_exactly(tiny_llama_folder: Path, tmp_path: Path, eval_file: Path,
                                              src_bits: int, src_group: int, bits: int, group: int):
    """More bits, or groups that split the source's, hold every source value: codes repacked, each
    group's scale and bias repeated, nothing rounded."""
    source = tmp_path / "source"
    convert(tiny_llama_folder, source, "--q-bits", str(src_bits), "--q-group-size", str(src_group),
            "--no-eval")
    out = tmp_path / "out"
    report = convert(source, out, "--q-bits", str(bits), "--q-group-size", str(group), "--eval-file",
                     str(eval_file))
    assert json.loads((out / "config.json").read_text())["quantization"] == {
        "group_size": group, "bits": bits, "mode": "affine"}
    before, after = float_weights(source), float_weights(out)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert report["evaluation"]["kl_max"] == 0 and report["warnings"] == []
    assert report["layers"] == {"widened": 16}


def test_lossy_requantization_warns_first(mixed_source: Path, tmp_path: Path, capsys, monkeypatch):
    """An explicit group the source's does not split, or --pure over its 6-bit layers, re-quantizes with
    loss: a warning names the layers' forms and the reason before the work starts."""
    capsys.readouterr()
    printed_before_writing = []
    real_write = output.write_weights

    def write_weights(*args, **kwargs):
        printed_before_writing.append(capsys.readouterr().err)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(output, "write_weights", write_weights)
    report = convert(mixed_source, tmp_path / "g64", "--q-bits", "4", "--q-group-size", "64", "--no-eval")
    assert report["layers"] == {"requantized": 12, "kept": 4}
    [warning] = report["warnings"]
    assert "12 layers the source stores as affine 4-bit g32 to affine 4-bit g64" in warning
    assert "groups of 64 do not split the source's groups of 32" in warning
    assert "without --q-group-size" in warning
    assert "warning:" in printed_before_writing[0] and "groups of 64" in printed_before_writing[0]

    report = convert(mixed_source, tmp_path / "pure", "--q-bits", "4", "--pure", "--no-eval")
    assert report["layers"] == {"copied": 12, "requantized": 4}
    assert "--pure takes them below the 6 bits" in report["warnings"][0]
    assert json.loads((tmp_path / "pure" / "config.json").read_text())["quantization"] == {
        "group_size": 32, "bits": 4, "mode": "affine"}

    report = convert(mixed_source, tmp_path / "f16", "--q-bits", "4", "--dtype", "float16", "--no-eval")
    assert report["warnings"] == ["writing the float32 scales and biases of 16 exactly kept layers as "
                                  "float16 rounds them (lossy); --dtype float32 keeps them exact"]


def test_layers_the_group_does_not_divide_stay_unquantized(tiny_llama_folder: Path, tmp_path: Path):
    report = convert(tiny_llama_folder, tmp_path / "g128", "--q-group-size", "128", "--no-eval")
    left = {u["layer"] for u in report["unquantized_layers"]}
    # Only down_proj has 128 inputs; everything with 64 inputs stays in floating point.
    assert "model.layers.0.mlp.down_proj" not in left and "model.layers.0.self_attn.q_proj" in left
    assert "lm_head" in left and "model.embed_tokens" in left
    saved = mx.load(str(tmp_path / "g128" / "model.safetensors"))
    assert saved["model.layers.0.mlp.down_proj.weight"].dtype == mx.uint32
    assert saved["model.layers.0.self_attn.q_proj.weight"].dtype == mx.float32
    load(str(tmp_path / "g128"))


def test_shards_index_and_force(tiny_llama_folder: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(output, "MAX_SHARD_BYTES", 40_000)
    out = tmp_path / "sharded"
    report = convert(tiny_llama_folder, out, "--q-bits", "8", "--no-eval")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == report["shards"] > 1
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for shard in shards:
        assert (out / shard).stat().st_size <= 40_000 + 4096  # tensor bytes within the limit, plus header
        assert set(mx.load(str(out / shard))) == {k for k, v in index["weight_map"].items() if v == shard}
    saved = [v for shard in shards for v in mx.load(str(out / shard)).values()]
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in saved)
    with pytest.raises(InvalidRequest, match="already exists"):
        convert(tiny_llama_folder, out, "--no-eval")
    monkeypatch.undo()
    convert(tiny_llama_folder, out, "--no-eval", "--force")
    assert (out / "model.safetensors").exists() and not (out / shards[0]).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sharded", "tiny-llama"]
    assert out.stat().st_mode & 0o777 == 0o777 & ~_umask()  # not mkdtemp's private 0700
    # --force replaces a model folder, never a folder of other things; nor is work done for nowhere.
    other = tmp_path / "documents"
    (other / "sub").mkdir(parents=True)
    (other / "sub" / "data.txt").write_text("keep me")
    with pytest.raises(InvalidRequest, match="not a model folder"):
        convert(tiny_llama_folder, other, "--no-eval", "--force")
    assert (other / "sub" / "data.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidRequest, match="cannot write to"):
        convert(tiny_llama_folder, tmp_path / "file" / "out", "--no-eval")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_interrupted_write_leaves_nothing(tiny_llama_folder: Path, tmp_path: Path, monkeypatch, capsys):
    real_save = mx.save_safetensors

    def save_then_fail(path, arrays, metadata=None):
        real_save(path, arrays, metadata=metadata)
        raise KeyboardInterrupt  # as Ctrl-C between two shards

    monkeypatch.setattr(output, "MAX_SHARD_BYTES", 40_000)
    monkeypatch.setattr(output.mx, "save_safetensors", save_then_fail)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_llama_folder, tmp_path / "out", "--q-bits", "4", "--no-eval")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama"]
    assert f"interrupted: nothing was written to {tmp_path / 'out'}" in capsys.readouterr().err

    # With --force over an existing folder, a failure keeps the old folder as it was.
    monkeypatch.setattr(output.mx, "save_safetensors", real_save)
    convert(tiny_llama_folder, tmp_path / "out", "--no-eval")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    monkeypatch.setattr(output.mx, "save_safetensors", save_then_fail)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_llama_folder, tmp_path / "out", "--q-bits", "4", "--no-eval", "--force")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny-llama"]


def test_a_bad_evaluation_text_fails_before_the_work(tiny_llama_folder: Path, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(output, "write_weights", lambda *a, **k: pytest.fail("converted before reading it"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(InvalidRequest, match="has fewer than 2 tokens"):
        convert(tiny_llama_folder, tmp_path / "out", "--eval-file", str(empty))
    with pytest.raises(InvalidRequest, match="is not a file"):
        convert(tiny_llama_folder, tmp_path / "out", "--eval-file", str(tmp_path))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags,error,message",
    [
        (["--q-mode", "int4"], InvalidRequest, "unknown quantization mode 'int4'"),
        (["--q-bits", "7"], InvalidRequest, "--q-bits 7 is not supported by mode affine"),
        (["--q-mode", "mxfp4", "--q-bits", "8"], InvalidRequest, "not supported by mode mxfp4"),
        (["--q-group-size", "48"], InvalidRequest, "--q-group-size 48 is not supported"),
        (["--recipe", "mixed_4_6", "--q-mode", "mxfp8"], InvalidRequest, "recipe mixed_4_6"),
        (["--q-bits", "4", "--dequantize"], InvalidRequest, "--dequantize"),
        (["--pure", "--dequantize"], InvalidRequest, "--dequantize"),
        (["--pure", "--recipe", "mixed_3_6"], InvalidRequest, "--pure gives every layer the same"),
        (["--recipe", "mixed_3_6", "--q-bits", "8"], InvalidRequest, "it excludes --q-bits"),
        (["--dtype", "float64"], InvalidRequest, "unknown --dtype"),
    ],
)
def test_bad_options_fail_before_loading(tmp_path: Path, flags, error, message):
    with pytest.raises(error) as info:  # the model does not exist: options are checked first
        convert(tmp_path / "no-such-model", tmp_path / "out", *flags)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_bad_sources_and_targets(tiny_llama_folder: Path, tmp_path: Path, monkeypatch, capsys):
    with pytest.raises(ModelNotFound, match="no such file or folder"):
        convert(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(InvalidRequest, match="inside the source model's folder"):
        convert(tiny_llama_folder, tiny_llama_folder / "q4", "--no-eval")
    assert capsys.readouterr().err == ""  # refused before the progress bars start: the error is all
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(InvalidRequest, match="cannot write to"):
        convert(tiny_llama_folder, blocker / "out", "--no-eval")
    with pytest.raises(InvalidRequest, match="overwrite the source"):
        convert(tiny_llama_folder, tiny_llama_folder, "--force", "--no-eval")
    with pytest.raises(InvalidRequest, match="inside the source model's folder"):
        convert(tiny_llama_folder, tiny_llama_folder / "q4", "--no-eval")
    with monkeypatch.context() as m:
        m.chdir(tmp_path)
        for here in (Path("."), Path("")):  # the folder it works in: never replaced, even with --force
            with pytest.raises(InvalidRequest, match="is the folder you are in"):
                convert(tiny_llama_folder, here, "--force", "--no-eval")
    # Input sizes 48 and 96 (hidden, intermediate): a group of 64 divides neither.
    config = {**TINY_LLAMA_CONFIG, "hidden_size": 48, "intermediate_size": 96}
    odd = write_hf_folder(tmp_path / "odd", dict(tree_flatten(
        make_tiny_llama(0, hidden_size=48, intermediate_size=96).parameters())), config)
    with pytest.raises(InvalidRequest, match="group size 64 divides no layer's input size"):
        convert(odd, tmp_path / "out", "--q-bits", "4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "odd", "tiny-llama"]


def test_a_killed_converts_partial_folder_is_removed_by_the_next(tiny_llama_folder: Path, tmp_path: Path):
    stale, live = tmp_path / ".out.abc123.partial", tmp_path / ".out.def456.partial"
    for partial in (stale, live):
        partial.mkdir()
        (partial / "model.safetensors").write_bytes(b"half")
    old = time.time() - output.STALE_PARTIAL_S - 60
    for path in (stale / "model.safetensors", stale):
        os.utime(path, (old, old))
    convert(tiny_llama_folder, tmp_path / "out", "--no-eval")
    # The stale one goes; one still being written (by another convert, say) stays.
    assert not stale.exists() and live.exists() and (tmp_path / "out" / "config.json").is_file()


@pytest.mark.slow
def test_sigterm_mid_convert_leaves_nothing(smollm2_path: Path, tmp_path: Path):
    """SIGTERM (a supervisor, `kill`) cleans up as Ctrl-C does: no hidden partial folder is left."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_infer.cli", "convert", "-m", str(smollm2_path), "--out",
         str(tmp_path / "out"), "--q-bits", "4", "--q-group-size", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    deadline = time.monotonic() + 120
    # Once the output is being written (its hidden partial folder exists).
    while not any(p.suffix == ".partial" for p in tmp_path.iterdir()) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert list(tmp_path.iterdir()) == [] and "Traceback" not in err


def test_cli_exits_with_one_line(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_infer.cli", "convert", "--model", str(tmp_path),
         "--out", str(tmp_path / "o"), "--q-bits", "7"], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == InvalidRequest.exit_code != 0
    assert proc.stderr.strip().splitlines() == [
        "mlx-infer convert: error: --q-bits 7 is not supported by mode affine (allowed: 2, 3, 4, 5, 6, 8)"
    ]


def test_progress_written_to_a_log_is_not_cut_at_80_columns(tiny_llama_folder: Path, tmp_path: Path):
    out = tmp_path / ("a-long-folder-name-" * 4) / "q4"
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_infer.cli", "convert", "-m", str(tiny_llama_folder), "--out", str(out),
         "--q-bits", "4", "--no-eval"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "quantizing" in proc.stderr and "…" not in proc.stderr, proc.stderr  # rich cut "quantizi…"


# --------------------------------------------------------------------------------- the real model
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2_converted(smollm2_path: Path, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """The Q4_1 GGUF (4-bit g32, its tied embedding/head Q8_0) converted two ways: ``--q-bits 4``, which
    its grid holds (copied exactly), and ``--q-bits 8 --q-group-size 64``, which re-quantizes every layer."""
    root = tmp_path_factory.mktemp("smollm2")
    flags = {"exact": ["--q-bits", "4"], "lossy": ["--q-bits", "8", "--q-group-size", "64"]}
    return {name: (root / name, convert(smollm2_path, root / name, *f, "--eval-tokens", "64"))
            for name, f in flags.items()}


def greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens through the engine-free path: one prefill, then one token per step, paged KV."""
    bs, blocks = 16, -(-(len(prompt) + n) // 16)
    cache = new_cache(model, blocks, bs, mx.float32)
    tokens, done, out = prompt, 0, []
    for _ in range(n):
        logits = model(mx.array(tokens), cache, build_metadata([SequenceSlice(list(range(blocks)), done,
                                                                              len(tokens))], bs))
        out.append(int(mx.argmax(logits[-1]).item()))
        done, tokens = done + len(tokens), out[-1:]
    return out


def mlx_lm_greedy(folder: Path, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
    """Greedy tokens of mlx-lm's float32 load of ``folder`` (:func:`mlx_lm_float32`: its quantized matmuls
    run in float16 on the CPU and take minutes for 16 tokens here), and its encoding of the prompt."""
    from mlx_lm.generate import generate_step

    model, tokenizer = mlx_lm_float32(folder)
    steps = zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n))
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    return [int(t) for (t, _), _ in steps], list(ids)


def mlx_lm_float32(folder: Path) -> tuple[nn.Module, object]:
    """mlx-lm's load of ``folder`` (its model code, config reading and tokenizer), quantized layers
    dequantized to float32 as mlx-infer's CPU policy does."""
    from mlx_lm import load as lm_load

    model, tokenizer = lm_load(str(folder))
    floats = [(path, f) for path, m in model.named_modules() if (f := _float_twin(m)) is not None]
    model.update_modules(tree_unflatten(floats))
    model.update(tree_unflatten([(k, v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())]))
    return model, tokenizer


def _float_twin(m: nn.Module) -> nn.Module | None:
    """The floating-point layer an mlx-lm quantized layer (linear, embedding, stacked experts, MLA's
    per-head projections) stands for, with its bias; None for any other module."""
    from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear,
                          QuantizedMultiLinear)):
        return None
    scales, biases = m.scales, m.get("biases")
    if m.mode == "affine":  # float32 scales give float32 weights; the other modes' scales are exponents
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    w = mx.dequantize(m.weight, scales, biases, group_size=m.group_size, bits=m.bits, mode=m.mode)
    if isinstance(m, nn.QuantizedEmbedding):
        f = nn.Embedding(*w.shape)
    elif isinstance(m, QuantizedMultiLinear):  # MLA's per-head projections, [heads, out, in]
        f = MultiLinear(w.shape[2], w.shape[1], w.shape[0])
    elif isinstance(m, QuantizedSwitchLinear):
        f = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias="bias" in m)
    else:
        f = nn.Linear(*w.shape[::-1], bias="bias" in m)
    f.weight = w
    if "bias" in m:
        f.bias = m.bias
    return f


QUANTIZATION = {
    "exact": {"group_size": 32, "bits": 4, "mode": "affine",
              "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"}},
    "lossy": {"group_size": 64, "bits": 8, "mode": "affine"},
}


@pytest.mark.slow
def test_smollm2_round_trip_through_mlx_infer_and_mlx_lm(smollm2_converted):
    """The exact conversion (4-bit default, the 8-bit embedding as a per-layer entry) read by mlx-lm."""
    pytest.importorskip("mlx_lm")
    folder, report = smollm2_converted["exact"]
    assert json.loads((folder / "config.json").read_text())["quantization"] == QUANTIZATION["exact"]
    assert report["unquantized_layers"] == []
    ours = load(str(folder))
    prompt = ours.tokenizer.encode_chat(PROMPT)
    tokens = greedy(ours.model, prompt, 16)
    theirs, their_prompt = mlx_lm_greedy(folder, prompt, 16)
    assert their_prompt == prompt  # the tokenizer built from GGUF metadata reads the same in transformers
    assert tokens == theirs
    assert "Paris" in ours.tokenizer.decode(tokens)


@pytest.mark.slow
def test_smollm2_q4_keeps_the_gguf_weights_bit_for_bit(smollm2_path: Path, smollm2_converted):
    folder, report = smollm2_converted["exact"]
    ckpt = open_checkpoint(str(smollm2_path))
    source = dict(tree_flatten(build_model(ckpt.config, ckpt.weights, ckpt.path.name).parameters()))
    saved = mx.load(str(folder / "model.safetensors"))
    assert source.keys() == saved.keys()
    for k, v in source.items():  # quantized layers as stored; the float32 norms written (exactly) in float16
        assert (v.dtype == saved[k].dtype or k.endswith("norm.weight")) and mx.array_equal(v, saved[k]), k
    e = report["evaluation"]
    assert e["kl_mean"] == e["kl_max"] == 0 and e["top1_agreement"] == 1
    assert e["ppl_source"] == e["ppl_output"]
    assert report["layers"] == {"copied": 210, "kept": 1} and report["warnings"] == []
    assert report["kept_layers"] == [{"layer": "model.embed_tokens", "as": "affine 8-bit g32",
                                      "reason": "more bits than 4"}]
    assert report["bits_per_weight"]["output"] == pytest.approx(report["bits_per_weight"]["source"], abs=0.01)


@pytest.mark.slow
def test_smollm2_lossy_requantization_is_reported(smollm2_converted):
    (_, exact), (folder, lossy) = smollm2_converted["exact"], smollm2_converted["lossy"]
    e = lossy["evaluation"]
    assert e["tokens"] == exact["evaluation"]["tokens"] == 63
    assert 0 < e["kl_mean"] < 0.01 and e["top1_agreement"] > 0.9
    assert e["ppl_source"] == pytest.approx(exact["evaluation"]["ppl_source"], rel=1e-5)  # same source
    assert lossy["layers"] == {"requantized": 211} and lossy["unquantized_layers"] == []
    assert json.loads((folder / "config.json").read_text())["quantization"] == QUANTIZATION["lossy"]
    load(str(folder))  # the uniform 8-bit g64 config rebuilds the right shapes
    assert sorted(w.split(" to ")[0] for w in lossy["warnings"]) == [
        "re-quantizing 1 layer the source stores as affine 8-bit g32",
        "re-quantizing 210 layers the source stores as affine 4-bit g32"]
    assert 8.4 < lossy["bits_per_weight"]["output"] < 8.6


def test_mistral3_composite_output_loads_in_mlx_lm(tmp_path: Path, eval_file: Path):
    """Mistral 3's image-text checkpoint (text model under ``language_model.``, the head tied by the
    composite's flag while ``text_config`` says untied): mlx-lm reads the output (names, the per-layer
    entries of a mixed recipe, the tie) and gives mlx-infer's logits; mlx-infer reads it back too."""
    pytest.importorskip("mlx_lm")
    out = tmp_path / "out"
    convert(TINY / "mistral3", out, "--recipe", "mixed_3_6", "--q-group-size", "32",
            "--eval-file", str(eval_file))
    config = json.loads((out / "config.json").read_text())
    per_layer = [k for k, v in config["quantization"].items() if isinstance(v, dict)]
    assert per_layer and all(k.startswith("language_model.model.") for k in per_layer)
    # Within the checkpoint's sliding window (24): mlx-lm's ministral3 slides only layers that layer_types
    # names and cannot slide all of them, as transformers and mlx-infer do with this config.
    window = config["text_config"]["sliding_window"]
    assert_mlx_lm_logits_match(out, np.load(TINY / "mistral3" / "reference.npz")["tokens_1"][:window])


def assert_mlx_lm_logits_match(folder: Path, tokens: np.ndarray) -> None:
    """mlx-lm's float32 logits for ``tokens`` (every position) are mlx-infer's for its load of ``folder``."""
    tokens = tokens.tolist()
    theirs = np.array(mlx_lm_float32(folder)[0](mx.array([tokens]))[0])
    ours = load(str(folder)).model
    blocks = -(-len(tokens) // 16)
    cache = new_cache(ours, blocks, 16, mx.float32)
    meta = build_metadata([SequenceSlice(list(range(blocks)), 0, len(tokens), True)], 16)  # every position
    mine = np.array(ours(mx.array(tokens), cache, meta))
    assert np.abs(theirs - mine).max() <= 1e-4 * max(1.0, float(np.abs(mine).max()))
    assert float(np.std(mine)) > 0.5  # logits spread over several units: the comparison proves something


# Tiny checkpoints whose converted output mlx-lm 0.32.2 loads and runs as mlx-infer does. The composites
# (text model under model.language_model.*, towers dropped) are written under mlx-lm's language_model.
# names with a mixed recipe's per-layer entries; transformers 5 configs get the older keys mlx-lm reads
# (rope_theta / rope_scaling, full_attention_interval, global_head_dim, the composite's vocab_size);
# Qwen3-Next's stacked experts come with the rest of mlx-lm's sanitized layout.
MLX_LM_TYPES = ["qwen3_5", "qwen3_5_moe", "gemma4", "kimi_k25", "gemma4_text", "glm4_moe", "smollm3",
                "deepseek_v3", "qwen3_next"]


@pytest.mark.parametrize("name", MLX_LM_TYPES)
def test_output_loads_in_mlx_lm(tmp_path: Path, name: str):
    pytest.importorskip("mlx_lm")
    out = tmp_path / "out"
    composite = name in mlx_lm_layout.NESTED_TEXT_MODEL
    recipe = ["--recipe", "mixed_3_6"] if composite else ["--q-bits", "4"]
    convert(TINY / name, out, *recipe, "--q-group-size", "32", "--no-eval")
    if composite:
        config = json.loads((out / "config.json").read_text())
        per_layer = [k for k, v in config["quantization"].items() if isinstance(v, dict)]
        assert per_layer and all(k.startswith("language_model.") for k in per_layer)
    # 20 tokens: past the tiny sliding windows (8) and over every layer kind
    assert_mlx_lm_logits_match(out, np.load(TINY / name / "reference.npz")["tokens_1"][:20])


def test_gpt_oss_output_loads_in_mlx_lm(tmp_path: Path):
    """gpt-oss, with the two settings mlx-lm 0.32.2 does not read set to what it assumes: its SwiGLU clamps
    at 7.0 whatever ``swiglu_limit`` says (the tiny checkpoint's 1.0 exercises the clamp), and its YaRN
    always rounds the correction range, as ``truncate: true`` does (real gpt-oss says false)."""
    pytest.importorskip("mlx_lm")
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(TINY / "gpt_oss", src)
    config = json.loads((src / "config.json").read_text())
    config["swiglu_limit"] = 7.0
    config["rope_parameters"]["truncate"] = True
    (src / "config.json").write_text(json.dumps(config))
    convert(src, out, "--q-bits", "4", "--q-group-size", "32", "--no-eval")
    assert_mlx_lm_logits_match(out, np.load(TINY / "gpt_oss" / "reference.npz")["tokens_1"][:20])


def test_older_config_keys_only_where_they_say_the_same():
    """Keys mlx-lm reads are added only where they express the source's setting, never over its own."""
    older = mlx_lm_layout.with_older_keys
    full, linear = "full_attention", "linear_attention"
    assert older({"layer_types": [linear, full] * 2})["full_attention_interval"] == 2
    assert "full_attention_interval" not in older({"layer_types": [linear, full, full, linear]})
    rope = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5.0, "factor": 4.0}}
    assert older(rope) == {**rope, "rope_theta": 5.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert older({**rope, "rope_theta": 7.0})["rope_theta"] == 7.0
    sliding = "sliding_attention"
    gemma = {"head_dim": 16, "num_key_value_heads": 2, "layer_types": [sliding, full, sliding, full]}
    assert older({**gemma, "per_layer_config": {"1": {"head_dim": 32}, "3": {"head_dim": 32}}})[
        "global_head_dim"] == 32
    assert "global_head_dim" not in older({**gemma, "per_layer_config": {"1": {"head_dim": 32}}})
    assert "global_head_dim" not in older({**gemma, "per_layer_config": {"1": {"num_key_value_heads": 1},
                                                                          "3": {"num_key_value_heads": 1}}})
