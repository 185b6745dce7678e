"""``convert``: open a checkpoint, choose each layer's output form, write the folder, measure the cost."""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from mlx_infer.errors import InvalidRequest
from mlx_infer.loading import Checkpoint, open_checkpoint
from mlx_infer.loading.build import build_model

from . import evaluate, output
from .quant import Plan, QuantParams, make_plan, quant_params
from .report import build_report, print_report
from .weights import Layer, output_groups, quantizable_layers, source_params

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
REPORT_FILE = "quantization_report.json"


@dataclass
class Options:
    model: str
    out: Path
    q_bits: int | None = None
    q_group_size: int | None = None
    q_mode: str | None = None
    recipe: str | None = None
    dtype: str | None = None
    dequantize: bool = False
    force: bool = False
    eval_file: Path | None = None
    eval_tokens: int = 1024
    no_eval: bool = False

    @property
    def quantize(self) -> bool:
        return any(v is not None for v in (self.q_bits, self.q_group_size, self.q_mode, self.recipe))

    def command_line(self) -> str:
        """The command that reproduces this conversion (recorded in the report)."""
        words = ["mlx-infer", "convert", "--model", self.model, "--out", str(self.out)]
        for flag, value in (("--q-bits", self.q_bits), ("--q-group-size", self.q_group_size),
                            ("--q-mode", self.q_mode), ("--recipe", self.recipe), ("--dtype", self.dtype),
                            ("--eval-file", self.eval_file)):
            if value is not None:
                words += [flag, str(value)]
        if self.eval_tokens != 1024:
            words += ["--eval-tokens", str(self.eval_tokens)]
        switches = (("--dequantize", self.dequantize), ("--force", self.force), ("--no-eval", self.no_eval))
        words += [flag for flag, on in switches if on]
        return shlex.join(words)


def convert(opts: Options, console: Console | None = None) -> dict[str, Any]:
    """Write ``opts.out``; return the report (also saved in the folder and printed)."""
    console = console or Console(stderr=True)
    params = _validate(opts)
    output.check_target(opts.out, opts.force)
    with _progress(console) as progress:
        task = progress.add_task("loading", total=None, detail=opts.model)
        ckpt = open_checkpoint(opts.model)
        output.check_not_source(opts.out, ckpt.path)
        model = build_model(ckpt.config, ckpt.weights, ckpt.path.name)
        ckpt.weights = {}
        progress.update(task, total=1, completed=1)

        layers = quantizable_layers(model)
        plan = make_plan(params, opts.recipe, len(model.layers)) if params else None
        targets, unquantized = _targets(layers, plan, opts.dequantize)
        dtype_name = opts.dtype or _default_dtype(ckpt.config, model)
        source_bytes, source_params_count = _tensor_stats(model)
        groups = output_groups(source_params(model), layers, targets, DTYPES[dtype_name])
        del model  # the groups' lazy graphs now hold the only references to the source tensors

        shards = output.plan_shards(groups)
        total = sum(g.nbytes for g in groups)
        del groups
        detail = f"{total / 1e6:.0f} MB"
        quantizing = progress.add_task("quantizing" if plan else "converting", total=total, detail=detail)
        writing = progress.add_task("writing", total=total, detail=f"{len(shards)} shard(s)")
        with output.atomic_folder(opts.out, opts.force) as tmp:
            index = output.write_weights(
                tmp, shards,
                on_group=lambda g: progress.advance(quantizing, g.nbytes),
                on_shard=lambda n: progress.advance(writing, n),
            )
            quantization = _quantization_config(targets)
            config = output.output_config(ckpt.config, quantization, dtype_name)
            output.write_json(tmp / "config.json", config)
            max_length = int(ckpt.config.get("max_position_embeddings") or 4096)
            tokenizer_files = output.write_tokenizer(tmp, ckpt.path, ckpt.tokenizer, max_length)
            quality = None if opts.no_eval else _evaluate(opts, ckpt, tmp, progress)
            report = build_report(
                command=opts.command_line(), source=ckpt.path, out=opts.out, plan=plan, dtype=dtype_name,
                dequantize=opts.dequantize, source_bytes=source_bytes, source_params=source_params_count,
                source_disk=_disk_size(ckpt.path), index=index, out_disk=_disk_size(tmp),
                unquantized=unquantized, tokenizer_files=tokenizer_files, quality=quality,
            )
            output.write_json(tmp / REPORT_FILE, report)
    print_report(report, Console())
    return report


def _validate(opts: Options) -> QuantParams | None:
    if opts.quantize and opts.dequantize:
        raise InvalidRequest("--dequantize writes floating-point weights: it excludes --q-* and --recipe")
    if opts.dtype is not None and opts.dtype not in DTYPES:
        raise InvalidRequest(f"unknown --dtype {opts.dtype!r}; choose one of {', '.join(DTYPES)}")
    if opts.eval_tokens < 2:
        raise InvalidRequest(f"--eval-tokens must be at least 2, got {opts.eval_tokens}")
    if opts.eval_file is not None and not opts.eval_file.is_file():
        raise InvalidRequest(f"evaluation text {opts.eval_file} does not exist")
    if not opts.quantize:
        return None
    params = quant_params(opts.q_mode, opts.q_bits, opts.q_group_size)
    make_plan(params, opts.recipe, 0)  # a bad recipe fails now, before anything is loaded
    return params


def _targets(
    layers: dict[str, Layer], plan: Plan | None, dequantize: bool
) -> tuple[dict[str, QuantParams | None], list[dict[str, Any]]]:
    """Each layer's output quantization, and the layers a plan leaves unquantized (and why)."""
    if plan is None:
        return {p: None if dequantize else layer.source for p, layer in layers.items()}, []
    targets: dict[str, QuantParams | None] = {}
    unquantized = []
    for path, layer in layers.items():
        q = plan.params_for(path)
        if layer.in_features % q.group_size == 0:
            targets[path] = q
        else:
            targets[path] = None
            unquantized.append({"layer": path, "input_size": layer.in_features, "group_size": q.group_size})
    if layers and not any(targets.values()):
        sizes = ", ".join(str(s) for s in sorted({layer.in_features for layer in layers.values()}))
        raise InvalidRequest(
            f"group size {plan.default.group_size} divides no layer's input size ({sizes}): none quantizable"
        )
    return targets, unquantized


def _quantization_config(targets: dict[str, QuantParams | None]) -> dict[str, Any] | None:
    """mlx-lm's ``quantization`` key: the most common parameters as defaults, and a per-layer entry for
    every quantized layer that differs from them (loaders infer nothing for layers not listed)."""
    used = Counter(q for q in targets.values() if q is not None)
    if not used:
        return None
    default = used.most_common(1)[0][0]
    config: dict[str, Any] = default.as_config()
    for path, q in targets.items():
        if q is not None and q != default:
            config[path] = q.as_config()
    return config


def _default_dtype(config: dict[str, Any], model: nn.Module) -> str:
    """The config's ``torch_dtype`` (or ``dtype``), else the source's most common floating dtype."""
    for key in ("torch_dtype", "dtype"):
        if config.get(key) in DTYPES:
            return config[key]
    counts: Counter[str] = Counter()
    for _, p in _flat(model):
        if mx.issubdtype(p.dtype, mx.floating):
            counts[str(p.dtype).rsplit(".", 1)[-1]] += p.size
    name = counts.most_common(1)[0][0] if counts else "float16"
    return name if name in DTYPES else "float16"


def _tensor_stats(model: nn.Module) -> tuple[int, int]:
    """Bytes of the source tensors and the number of weights they stand for (packed values unpacked)."""
    layers = quantizable_layers(model)
    nbytes = count = 0
    for name, p in _flat(model):
        nbytes += p.nbytes
        path, _, leaf = name.rpartition(".")
        layer = layers.get(path)
        if layer is not None and leaf in ("scales", "biases") and layer.source is not None:
            continue
        if layer is not None and leaf == "weight":
            count += p.size // p.shape[-1] * layer.in_features
        else:
            count += p.size
    return nbytes, count


def _flat(model: nn.Module) -> list[tuple[str, mx.array]]:
    return tree_flatten(model.parameters())


def _evaluate(opts: Options, ckpt: Checkpoint, folder: Path, progress: Progress) -> evaluate.Quality:
    text = opts.eval_file or evaluate.DEFAULT_EVAL_FILE
    windows = evaluate.eval_windows(ckpt.tokenizer, text, opts.eval_tokens)
    detail = f"{sum(len(w) for w in windows)} tokens"
    task = progress.add_task("evaluating", total=len(windows), detail=detail)
    source = float32_model(open_checkpoint(opts.model))
    converted = float32_model(open_checkpoint(str(folder)))
    return evaluate.compare(source, converted, windows, lambda: progress.advance(task))


def float32_model(ckpt: Checkpoint) -> nn.Module:
    """The checkpoint's model with every layer dequantized and every weight in float32."""
    model = build_model(ckpt.config, ckpt.weights, ckpt.path.name)
    ckpt.weights = {}
    layers = quantizable_layers(model)
    groups = output_groups(source_params(model), layers, dict.fromkeys(layers), mx.float32)
    weights = {k: v for g in groups for k, v in g.tensors.items()}
    config = {k: v for k, v in ckpt.config.items() if k not in ("quantization", "quantization_config")}
    model = build_model(config, weights, ckpt.path.name)
    mx.eval(model.parameters())
    return model


def _disk_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description:<10}"), BarColumn(bar_width=24), TaskProgressColumn(),
        TimeElapsedColumn(), TextColumn("{task.fields[detail]}"), console=console, transient=False,
    )
