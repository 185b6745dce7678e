"""``convert``: open a checkpoint, choose each layer's output form, write the folder, measure the cost."""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from mlx_infer.cli_options import stderr_console
from mlx_infer.errors import InvalidRequest
from mlx_infer.loading import Checkpoint, open_checkpoint, resolve
from mlx_infer.loading.build import build_model
from mlx_infer.terminal import StdoutConsole

from . import choice, evaluate, mlx_lm_layout, output
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
    pure: bool = False
    force: bool = False
    eval_file: Path | None = None
    eval_tokens: int = 1024
    no_eval: bool = False

    @property
    def quantize(self) -> bool:
        given = (self.q_bits, self.q_group_size, self.q_mode, self.recipe)
        return self.pure or any(v is not None for v in given)

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
        switches = (("--dequantize", self.dequantize), ("--pure", self.pure), ("--force", self.force),
                    ("--no-eval", self.no_eval))
        words += [flag for flag, on in switches if on]
        return shlex.join(words)


def convert(opts: Options, console: Console | None = None) -> dict[str, Any]:
    """Write ``opts.out``; return the report (also saved in the folder and printed)."""
    console = console or stderr_console()
    requested = _validate(opts)
    output.check_target(opts.out, opts.force)
    # A wrong path or --out is one line, before any progress is drawn.
    output.check_not_source(opts.out, resolve(opts.model))
    with _progress(console) as progress:
        task = progress.add_task("loading", total=None, detail=opts.model)
        ckpt = open_checkpoint(opts.model)
        # The evaluation text is read and tokenized now: a bad one fails before the work, not after it.
        text = opts.eval_file or evaluate.DEFAULT_EVAL_FILE
        windows = None if opts.no_eval else evaluate.eval_windows(ckpt.tokenizer, text, opts.eval_tokens)
        model = build_model(ckpt.config, ckpt.weights, ckpt.path.name)
        ckpt.weights = {}
        progress.update(task, total=1, completed=1)

        layers = quantizable_layers(model)
        plan = _plan(opts, requested, layers, len(model.layers))
        choices = choice.choose(layers, plan, opts.dequantize, opts.pure)
        dtype_name = opts.dtype or _default_dtype(ckpt.config, model)
        source_bytes, source_params_count = _tensor_stats(model)
        params = source_params(model)
        warnings = choice.warnings(layers, choices, explicit_group=opts.q_group_size is not None)
        warnings += _rounded_scales(params, choices, dtype_name)
        for line in warnings:  # before the work starts, so a lossy run can be stopped
            console.print(f"[yellow]warning:[/yellow] {escape(line)}")
        for line in choice.notes(layers, choices):
            console.print(f"note: {escape(line)}")
        groups = output_groups(params, layers, choices.targets, DTYPES[dtype_name])
        mlx_lm_layout.rename_groups(groups, ckpt.config)
        source_config, quantization = mlx_lm_layout.mlx_lm_config(
            ckpt.config, _quantization_config(choices.targets), model
        )
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
            config = output.output_config(source_config, quantization, dtype_name)
            output.write_json(tmp / "config.json", config)
            max_length = int(ckpt.config.get("max_position_embeddings") or 4096)
            tokenizer_files = output.write_tokenizer(tmp, ckpt.path, ckpt.tokenizer, max_length)
            quality = None if windows is None else _evaluate(opts, windows, tmp, progress)
            report = build_report(
                command=opts.command_line(), source=ckpt.path, out=opts.out, plan=plan, dtype=dtype_name,
                dequantize=opts.dequantize, source_bytes=source_bytes, source_params=source_params_count,
                source_disk=_disk_size(ckpt.path), index=index, out_disk=_disk_size(tmp),
                choices=choices, warnings=warnings, tokenizer_files=tokenizer_files, quality=quality,
            )
            output.write_json(tmp / REPORT_FILE, report)
    print_report(report, StdoutConsole())
    return report


def _validate(opts: Options) -> QuantParams | None:
    if opts.quantize and opts.dequantize:
        raise InvalidRequest(
            "--dequantize writes floating-point weights: it excludes --q-*, --recipe and --pure")
    if opts.recipe is not None and opts.q_bits is not None:
        raise InvalidRequest(f"--recipe {opts.recipe} sets the bits of every layer: it excludes --q-bits")
    if opts.pure and opts.recipe is not None:
        raise InvalidRequest(
            f"--pure gives every layer the same quantization: it excludes --recipe {opts.recipe}")
    if opts.dtype is not None and opts.dtype not in DTYPES:
        raise InvalidRequest(f"unknown --dtype {opts.dtype!r}; choose one of {', '.join(DTYPES)}")
    if opts.eval_tokens < 2:
        raise InvalidRequest(f"--eval-tokens must be at least 2, got {opts.eval_tokens}")
    if opts.eval_file is not None and not opts.eval_file.is_file():
        missing = "is not a file" if opts.eval_file.exists() else "does not exist"
        raise InvalidRequest(f"evaluation text {opts.eval_file} {missing}")
    if not opts.quantize:
        return None
    params = quant_params(opts.q_mode, opts.q_bits, opts.q_group_size)
    make_plan(params, opts.recipe, 0)  # a bad recipe fails now, before anything is loaded
    return params


def _plan(
    opts: Options, requested: QuantParams | None, layers: dict[str, Layer], num_layers: int
) -> Plan | None:
    """The requested quantization, its group size by default the source's (so that the source's quantized
    layers stay exact); None when nothing is to be quantized."""
    if requested is None:
        return None
    if opts.q_group_size is None:
        group = choice.source_group_size(layers, requested.mode)
        requested = replace(requested, group_size=group or requested.group_size)
    plan = make_plan(requested, opts.recipe, num_layers)
    # A layer the source has quantized is always written quantized (copied, kept or re-quantized).
    if layers and all(layer.source is None and layer.in_features % requested.group_size
                      for layer in layers.values()):
        sizes = ", ".join(str(s) for s in sorted({layer.in_features for layer in layers.values()}))
        raise InvalidRequest(
            f"group size {requested.group_size} divides no layer's input size ({sizes}): none quantizable"
        )
    return plan


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


def _rounded_scales(params: dict[str, mx.array], choices: choice.Choices, dtype_name: str) -> list[str]:
    """A warning when writing the exactly kept layers' scales and biases in ``dtype_name`` rounds them
    (float32 holds every narrower float; any other change of type rounds)."""
    dtype = DTYPES[dtype_name]
    rounded: Counter[str] = Counter()
    for path in choices.paths("copied", "widened", "kept"):
        stored = params[f"{path}.scales"].dtype
        if mx.issubdtype(stored, mx.floating) and stored != dtype and dtype != mx.float32:
            rounded[str(stored).rsplit(".", 1)[-1]] += 1
    return [f"writing the {name} scales and biases of {n} exactly kept layers as {dtype_name} rounds them "
            f"(lossy); --dtype {name}{'' if name == 'float32' else ' or float32'} keeps them exact"
            for name, n in rounded.items()]


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


def _evaluate(opts: Options, windows: list[list[int]], folder: Path, progress: Progress) -> evaluate.Quality:
    detail = f"{sum(len(w) - 1 for w in windows)} tokens"  # the tokens predicted, as the report counts
    task = progress.add_task("evaluating", total=len(windows), detail=detail)
    source = float32_model(open_checkpoint(opts.model))
    converted = float32_model(open_checkpoint(str(folder)))
    quality = evaluate.compare(source, converted, windows, lambda: progress.advance(task))
    shipped = "the shipped prose (eval_text.txt)"
    return replace(quality, text=str(opts.eval_file) if opts.eval_file else shipped)


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
