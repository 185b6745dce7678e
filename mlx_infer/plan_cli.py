"""``mlx-infer plan``: will a model fit, how many sequences at what context, and how fast can it decode.

From metadata only (mlx_infer/plan/): nothing is loaded, so it answers for a 70B checkpoint as fast as for
a small one. ``serve`` prints the same table at its start and refuses a model whose weights alone do not
fit (:func:`check_before_serve`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from mlx_infer import cli_options
from mlx_infer.errors import MlxInferError, ModelTooLarge
from mlx_infer.plan.planner import BUDGET_ENV, KV_CACHE_DTYPES, Plan, human_bytes, make_plan

log = logging.getLogger("mlx_infer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli_options.add_model_arguments(parser)
    g = parser.add_argument_group("plan")
    g.add_argument(
        "--context", type=int, default=None, metavar="N", help="tokens per sequence (default: the model's)"
    )
    g.add_argument("--max-num-seqs", type=int, default=1, metavar="S", help="sequences at once (default: 1)")
    g.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV cache element type (default: auto, float16 on the CPU backend, the model's dtype on Metal)",
    )
    g.add_argument(
        "--q-bits",
        type=int,
        default=None,
        metavar="B",
        help="plan the model as `mlx-infer convert --q-bits B` would write it (default: as it is)",
    )
    g.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.epilog = f"${BUDGET_ENV} (e.g. 16GiB) replaces the machine's memory as the budget."


def run(args: argparse.Namespace) -> int:
    plan = make_plan(
        args.model,
        context=args.context,
        max_num_seqs=args.max_num_seqs,
        kv_cache_dtype=args.kv_cache_dtype,
        q_bits=args.q_bits,
        keep_quantized=args.keep_quantized,
    )
    print(json.dumps(plan.as_json(), indent=2) if args.json else render(plan))
    return 0


def render(plan: Plan, kv_memory_gib: float | None = None) -> str:
    """The plan as a few aligned lines (what ``plan`` prints and ``serve`` logs; ``kv_memory_gib``: the
    KV pool serve was given, set against what the plan needs)."""
    seqs = f"{plan.max_num_seqs} sequence{'s' if plan.max_num_seqs > 1 else ''}"
    verdict = (
        "fits" if plan.fits else ("weights fit, KV cache does not" if plan.weights_fit else "does NOT fit")
    )
    if plan.max_context_that_fits:
        largest = (
            f"context {plan.max_context_that_fits} at {seqs} (model: {plan.model_max_context}); "
            f"{plan.max_num_seqs_that_fit} sequences at {plan.context} tokens"
        )
    else:
        largest = "no KV cache fits beside the weights"
    gbs = plan.bandwidth_bytes_s / 1e9
    decode = f"{plan.decode_tok_s_bound:.1f} tok/s at {plan.context} tokens"
    if plan.max_num_seqs > 1:
        decode += f", {plan.decode_tok_s_bound_batch:.1f} tok/s over {seqs}"
    rows = [
        ("model", f"{plan.model} ({plan.backend} backend)"),
        ("weights", f"{human_bytes(plan.weights_bytes)}  {plan.weights}"),
        (
            "KV cache",
            f"{human_bytes(plan.kv_bytes)}  {plan.kv_bytes_per_token} B a token ({plan.kv_cache_dtype}) x "
            f"{plan.context} tokens x {seqs}"
            + (
                f" + {human_bytes(plan.window_kv_bytes)} for the sliding-window layers' windows"
                if plan.window_kv_bytes
                else ""
            ),
        ),
        *(
            [("state", f"{human_bytes(plan.state_bytes)}  recurrent state (linear attention) x {seqs}")]
            if plan.state_bytes
            else []
        ),
        ("scratch", f"{human_bytes(plan.scratch_bytes)}  activations and logits of the steps in flight"),
        (
            "total",
            f"{human_bytes(plan.total_bytes)}  of {human_bytes(plan.budget_bytes)} ({plan.budget_source}): "
            f"{verdict}",
        ),
        ("largest", largest),
        *(
            [
                (
                    "note",
                    f"a context of {plan.context_requested} is past the model's {plan.model_max_context}: "
                    f"planned at {plan.model_max_context}, the most the engine runs it at",
                )
            ]
            if plan.context_requested
            else []
        ),
        ("decode bound", f"{decode}: {gbs:.1f} GB/s, {plan.bandwidth_source}"),
    ]
    pool_bytes = plan.kv_bytes + plan.state_bytes  # the engine takes both out of the --kv-memory budget
    if kv_memory_gib is not None:
        given = int(kv_memory_gib * 2**30)
        tokens = given // plan.kv_bytes_per_token if plan.kv_bytes_per_token else 0
        rows.append(
            (
                "KV pool",
                f"{human_bytes(given)} (--kv-memory): about {tokens} tokens, "
                f"{given / pool_bytes if pool_bytes else 1:.1%} of what this plan needs",
            )
        )
    elif plan.fits and pool_bytes > plan.default_kv_pool_bytes:
        gib = -(-pool_bytes * 100 // 2**30) / 100  # rounded up, so the pool holds every block
        rows.append(
            (
                "note",
                f"serve and generate give the KV pool {human_bytes(plan.default_kv_pool_bytes)} by default "
                f"(25% of the memory left, at most 8 GiB): pass --kv-memory {gib:g} for this plan",
            )
        )
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def check_before_serve(args: argparse.Namespace) -> None:
    """``serve``'s start: log the plan of each model for its flags, and raise ModelTooLarge when the weights
    of one alone exceed the budget. A model the planner cannot read (an encoder, say) is left to the
    loader, which reports its own errors; a rank under ``launch`` holds only a shard, so it is not
    checked."""
    if "MLX_RANK" in os.environ:
        return
    for model in [args.model] if isinstance(args.model, str) else args.model:
        try:
            plan = make_plan(
                model,
                context=args.max_context,
                max_num_seqs=args.max_num_seqs,
                kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                keep_quantized=args.keep_quantized,
                step_tokens=args.max_num_batched_tokens,
            )
        except MlxInferError as e:
            log.info("memory plan: not available for %s (%s)", model, e)
            continue
        log.info("memory plan:\n%s", render(plan, getattr(args, "kv_memory", None)))
        if not plan.weights_fit:
            raise ModelTooLarge(
                f"{plan.model} does not fit: its weights take {human_bytes(plan.weights_bytes)} "
                f"({plan.weights}) and this machine's budget is {human_bytes(plan.budget_bytes)} "
                f"({plan.budget_source})"
            )
        _check_draft(args, plan)


def _check_draft(args: argparse.Namespace, plan: Plan) -> None:
    """A --draft-model's weights and KV pool come on top of the model's plan: logged, and refused when
    the two models' weights together exceed the budget."""
    draft = getattr(args, "draft_model", None)
    if draft is None:
        return
    try:
        extra = make_plan(draft, context=plan.context, max_num_seqs=plan.max_num_seqs,
                          kv_cache_dtype=plan.kv_cache_dtype, keep_quantized=args.keep_quantized)  # fmt: skip
    except MlxInferError as e:
        log.info("memory plan: not available for the draft model %s (%s)", draft, e)
        return
    log.info(
        "draft model   %s: weights %s, KV pool %s (%d B a token) beside the total above",
        draft, human_bytes(extra.weights_bytes), human_bytes(extra.kv_bytes), extra.kv_bytes_per_token,
    )  # fmt: skip
    if plan.weights_bytes + extra.weights_bytes > plan.budget_bytes:
        raise ModelTooLarge(
            f"{plan.model} and its draft {draft} do not fit: their weights take "
            f"{human_bytes(plan.weights_bytes + extra.weights_bytes)} and this machine's budget is "
            f"{human_bytes(plan.budget_bytes)} ({plan.budget_source})"
        )
