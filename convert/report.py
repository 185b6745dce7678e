"""The quality report: ``quantization_report.json`` and the table printed after a convert."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .choice import Choices
from .evaluate import Quality
from .quant import RECIPES, Plan


def build_report(
    *,
    command: str,
    source: Path,
    out: Path,
    plan: Plan | None,
    dtype: str,
    dequantize: bool,
    source_bytes: int,
    source_params: int,
    source_disk: int,
    index: dict[str, Any],
    out_disk: int,
    choices: Choices,
    warnings: list[str],
    tokenizer_files: list[str],
    quality: Quality | None,
) -> dict[str, Any]:
    out_bytes = index["metadata"]["total_size"]
    out_params = index["metadata"]["total_parameters"]
    if plan is not None:
        q = plan.default
        # A recipe's bits are its own (mlx-lm's config.json names the low ones), not the default's.
        low, high = RECIPES[plan.recipe] if plan.recipe else (q.bits, None)
        quantization: dict[str, Any] = {"mode": q.mode, "bits": low, "group_size": q.group_size,
                                        "recipe": plan.recipe, "recipe_high_bits": high}
    else:
        quantization = {"mode": "dequantized" if dequantize else "unchanged"}
    return {
        "command": command,
        "source": str(source),
        "output": str(out),
        "quantization": quantization,
        "dtype": dtype,
        "parameters": out_params,
        "bits_per_weight": {"source": _bpw(source_bytes, source_params),
                            "output": _bpw(out_bytes, out_params)},
        "tensor_bytes": {"source": source_bytes, "output": out_bytes},
        "disk_bytes": {"source": source_disk, "output": out_disk},
        "shards": len(set(index["weight_map"].values())),
        "layers": choices.counts(),
        "kept_layers": choices.kept,
        "unquantized_layers": choices.unquantized,
        "warnings": warnings,
        "tokenizer_files": tokenizer_files,
        "evaluation": None if quality is None else quality.as_dict(),
    }


def print_report(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"convert -> {report['output']}", show_header=True)
    table.add_column("")
    table.add_column("source", justify="right")
    table.add_column("output", justify="right")
    bpw, disk = report["bits_per_weight"], report["disk_bytes"]
    table.add_row("bits per weight", f"{bpw['source']:.3f}", f"{bpw['output']:.3f}")
    table.add_row("size on disk", _mb(disk["source"]), _mb(disk["output"]))
    quality = report["evaluation"]
    if quality is not None:
        table.add_row("perplexity", f"{quality['ppl_source']:.4f}", f"{quality['ppl_output']:.4f}")
        table.add_row("KL divergence mean / p99", "", f"{quality['kl_mean']:.6f} / {quality['kl_p99']:.6f}")
        table.add_row("top-1 agreement", "", f"{quality['top1_agreement']:.2%}")
        table.add_row("evaluated tokens", "", f"{quality['tokens']} of {quality['text']}")
    q = report["quantization"]
    what = q["mode"] if "bits" not in q else f"{q['mode']} {q['bits']}-bit g{q['group_size']}"
    if q.get("recipe"):
        what += f" ({q['recipe']}: {q['recipe_high_bits']}-bit where errors hurt most)"
    table.add_row("requested", "", what)  # layers kept as stored (see "layers") keep their own
    table.add_row("layers", "", ", ".join(f"{n} {kind}" for kind, n in report["layers"].items()))
    unquantized = report["unquantized_layers"]
    if unquantized:
        names = ", ".join(u["layer"] for u in unquantized[:4]) + (" ..." if len(unquantized) > 4 else "")
        table.add_row("left unquantized", "", f"{len(unquantized)}: {names}")
    console.print(table)


def _bpw(nbytes: int, params: int) -> float:
    return 8 * nbytes / params if params else 0.0


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
