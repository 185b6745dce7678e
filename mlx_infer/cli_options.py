"""Options shared by the commands that run a model (generate, serve): model, engine, sampling."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from mlx_infer import cpu_kernels
from mlx_infer.engine.engine import Engine, EngineConfig
from mlx_infer.engine.scheduler import SchedulerConfig
from mlx_infer.engine.speculative import METHODS, SpeculativeConfig
from mlx_infer.errors import DistributedError, InvalidRequest
from mlx_infer.loading import LoadedModel
from mlx_infer.plan.planner import KV_CACHE_DTYPES, check_kv_dtype
from mlx_infer.sampling import SamplingParams

# The choices users are offered of cpu_kernels.ACTIVATIONS (int8-avx2 is a test/benchmark setting).
CPU_ACTIVATIONS = ("int8", "int16", "float32")


def tcp_port(text: str, lowest: int = 0) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535, caught at parsing rather than after a
    model has loaded."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not lowest <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is {lowest} to 65535, not {port}")
    return port


def stdin_prompt() -> str:
    """``-p -``: the prompt piped in, without the line end(s) that close it (`echo` adds one, and a
    trailing newline is part of what the model reads: it changed SmolLM2's answer)."""
    return sys.stdin.read().rstrip("\r\n")


# serve's stop (SIGTERM/SIGINT): running requests may finish for --shutdown-timeout seconds (this default);
# once they are ended (that wait over, or a second Ctrl-C) their clients get this long to receive the final
# error. `launch` waits as long for a serving rank 0.
SHUTDOWN_TIMEOUT_S = 30.0
FINAL_ERROR_S = 2.0


def stderr_console():
    """rich's console on stderr for progress and notes; when stderr is a file or a pipe (a log), lines
    are not cut or wrapped at 80 columns, as rich does where it cannot ask a terminal its width."""
    from rich.console import Console

    return Console(stderr=True, width=None if sys.stderr.isatty() else 1_000_000)


def ring_port(text: str) -> int:
    """The first of the ring's consecutive ports (launch, hosts): 1 to 65535."""
    return tcp_port(text, lowest=1)


def add_model_arguments(parser: argparse.ArgumentParser, repeatable: bool = False) -> None:
    """``repeatable``: ``-m`` may be given several times (``serve``'s several models; a list then)."""
    g = parser.add_argument_group("model")
    what = "a model folder, a Hugging Face repo id or a .gguf file"
    if repeatable:
        g.add_argument("--model", "-m", action="append", default=[], help=what + " (repeatable)")
    else:
        g.add_argument("--model", "-m", required=True, help=what)
    weights = g.add_mutually_exclusive_group()
    weights.add_argument(
        "--keep-quantized",
        action="store_const",
        const=True,
        default=None,
        help="keep quantized weights quantized even where no fast kernel computes them (default: per "
        "backend: quantized on Metal and with the native CPU kernels, float32 on a CPU without them)",
    )
    weights.add_argument(
        "--dequantize",
        action="store_const",
        const=False,
        dest="keep_quantized",
        help="dequantize quantized weights at load (float32 on the CPU backend)",
    )


def add_engine_arguments(parser: argparse.ArgumentParser, max_num_seqs: int) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--kv-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="most memory the KV pool may grow to, in GiB (default: 25%% of free device memory, at "
        "most 8 GiB and at most max-num-seqs full contexts)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        metavar="|".join(KV_CACHE_DTYPES),
        help="what the KV cache stores: int8 holds 3.8x the tokens of float32 at head_dim 64 (one "
        "scale per token and head), float16 2x (default: auto, float16 on the CPU backend, the "
        "model's dtype on Metal)",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=max_num_seqs,
        help=f"most sequences decoded together (default: {max_num_seqs})",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="token budget of one step; longer prompts are prefilled in chunks (default: 512)",
    )
    g.add_argument(
        "--max-context", type=int, default=None, help="cap on context length (default: the model's)"
    )
    g.add_argument(
        "--no-prefix-caching", action="store_true", help="do not reuse KV blocks of earlier prompts"
    )
    g.add_argument(
        "--cpu-activations",
        choices=CPU_ACTIVATIONS,
        default=None,
        help="what the native CPU kernels quantize activations to: int16 answers as float32 does, int8 "
        "is faster for batches and prompts at a small loss (mean KL 0.003 on SmolLM2), float32 is exact "
        f"and slowest (default: ${cpu_kernels.ACTIVATIONS_ENV_VAR}, else {cpu_kernels.DEFAULT_ACTIVATIONS})",
    )

    spec = SpeculativeConfig()
    g.add_argument(
        "--speculative",
        choices=METHODS,
        default=None,
        help="speculative decoding: ngram proposes what followed the latest match of the text's last "
        "tokens in the prompt and output (prompt lookup), draft what --draft-model predicts; the model "
        "verifies them in the same batched step, so the output is its own (default: off)",
    )
    g.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH",
        help="the draft model for --speculative draft (implies it): a small model with the same "
        "tokenizer, as for --model",
    )
    g.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        metavar="K",
        help="most tokens proposed per sequence and step; each sequence adapts its own from its "
        f"acceptance (default: {spec.num_draft_tokens})",
    )
    g.add_argument(
        "--speculative-max-batch",
        type=int,
        default=None,
        metavar="N",
        help="speculate only while at most N sequences are running: verifying costs compute that "
        f"larger batches already use (default: {spec.max_batch})",
    )


def apply_cpu_activations(args: argparse.Namespace) -> None:
    """``--cpu-activations`` for the products this process computes from now on (it overrides
    $MLX_INFER_CPU_ACTIVATIONS); nothing where the native CPU kernels do not run."""
    if args.cpu_activations is not None and cpu_kernels.applies():
        cpu_kernels.set_activations(args.cpu_activations)


def speculative_method(args: argparse.Namespace) -> str | None:
    """``--speculative``, with ``--draft-model`` implying ``draft`` (as in mlx-lm)."""
    method = args.speculative
    if args.draft_model is not None:
        if method not in (None, "draft"):
            raise InvalidRequest(f"--draft-model goes with --speculative draft, not {method}")
        return "draft"
    if method == "draft":
        raise InvalidRequest("--speculative draft needs --draft-model")
    return method


def engine_config(args: argparse.Namespace) -> EngineConfig:
    positive = {
        "--block-size": args.block_size,
        "--max-num-seqs": args.max_num_seqs,
        "--max-num-batched-tokens": args.max_num_batched_tokens,
        "--kv-memory": 1 if args.kv_memory is None else args.kv_memory,
        "--max-context": 1 if args.max_context is None else args.max_context,
    }
    for flag, value in positive.items():
        if not value > 0:  # NaN too
            raise InvalidRequest(f"{flag} must be positive, not {value}")
    check_kv_dtype(args.kv_cache_dtype)
    method = speculative_method(args)
    draft_tokens, max_batch = args.num_draft_tokens, args.speculative_max_batch
    for flag, value in (("--num-draft-tokens", draft_tokens), ("--speculative-max-batch", max_batch)):
        if value is not None and method is None:  # silently ignored, one would think speculation on
            raise InvalidRequest(f"{flag} goes with --speculative ngram or --draft-model; speculation is off")
    defaults = SpeculativeConfig()
    speculative = SpeculativeConfig(
        method=method,
        num_draft_tokens=defaults.num_draft_tokens if draft_tokens is None else draft_tokens,
        max_batch=defaults.max_batch if max_batch is None else max_batch,
    )
    speculative.validate()
    return EngineConfig(
        block_size=args.block_size,
        kv_memory=args.kv_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=not args.no_prefix_caching,
        # serve's flag; one-shot commands never idle with a request pending
        kv_idle_release=getattr(args, "kv_idle_release", EngineConfig.kv_idle_release),
        max_context=args.max_context,
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
        speculative=speculative,
    )


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    g = parser.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=d.max_tokens,
        help=f"most tokens to generate (default: {d.max_tokens})",
    )
    g.add_argument("--temp", type=float, default=d.temperature, help="temperature; 0 is greedy (default: 0)")
    g.add_argument(
        "--top-k", type=int, default=d.top_k, help="sample among the k likeliest tokens (default: 0, off)"
    )
    for flag, default, meaning in (
        ("--top-p", d.top_p, "sample among the likeliest tokens whose probabilities add up to p (default: "
         "1.0, off)"),
        ("--min-p", d.min_p, "drop tokens less likely than min-p times the likeliest one (default: 0.0, "
         "off)"),
        ("--repetition-penalty", d.repetition_penalty, "penalize tokens of the prompt and output, as HF and "
         "vLLM do; above 1 repeats less (default: 1.0, off)"),
        ("--presence-penalty", d.presence_penalty, "subtracted from the logit of every token already in the "
         "output, -2 to 2 (default: 0.0)"),
        ("--frequency-penalty", d.frequency_penalty, "subtracted from a token's logit once per time it is in "
         "the output, -2 to 2 (default: 0.0)"),
    ):  # fmt: skip
        g.add_argument(flag, type=float, default=default, help=meaning)
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past end-of-sequence (benchmarks)"
    )


# The sampling flags by the field each sets, for errors that name the flag a user typed.
_SAMPLING_FLAGS = {
    "max_tokens": "--max-tokens", "temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p",
    "min_p": "--min-p", "repetition_penalty": "--repetition-penalty",
    "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
}  # fmt: skip


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as parameters, checked: a bad value is an InvalidRequest naming its flag."""
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=list(args.stop),
        ignore_eos=args.ignore_eos,
    )
    try:
        params.validate()
    except InvalidRequest as e:
        field, _, rest = str(e).partition(" ")
        raise InvalidRequest(f"{_SAMPLING_FLAGS.get(field, field)} {rest}") from None
    return params


@contextmanager
def open_engine(args: argparse.Namespace) -> Iterator[tuple[LoadedModel, Engine] | None]:
    """Load the model and build the engine for this process.

    Under ``mlx-infer launch`` (an MLX distributed group of several ranks) this rank loads only its
    shard; rank 0 gets the engine, every other rank follows rank 0's steps here and gets None.
    """
    from mlx_infer.distributed.runtime import init_group, open_session
    from mlx_infer.loading import load

    config = engine_config(args)  # bad flags fail before the model loads
    apply_cpu_activations(args)
    keep_quantized = args.keep_quantized
    group = init_group()
    if group is None:
        loaded = load(args.model, keep_quantized=keep_quantized)
        draft = None
        if config.speculative.method == "draft":
            draft = load(args.draft_model, keep_quantized=keep_quantized)
            if draft.tokenizer.vocab_size != loaded.tokenizer.vocab_size:
                raise InvalidRequest(
                    f"the draft model's vocabulary ({draft.tokenizer.vocab_size} tokens) is not the "
                    f"model's ({loaded.tokenizer.vocab_size}): they must share a tokenizer"
                )
        model = draft.model if draft is not None else None
        yield loaded, Engine(loaded.model, loaded.tokenizer, loaded.max_context, config, draft_model=model)
        return
    if config.speculative.method is not None:  # (the other ranks follow plain steps only)
        raise InvalidRequest(
            f"--speculative {config.speculative.method} is not supported across several processes"
        )
    session = open_session(args.model, group, config, keep_quantized=keep_quantized)
    if session.rank != 0:
        session.follow()
        yield None
        return
    try:
        yield session.loaded, session.engine()
    except RuntimeError as e:  # how the ring backend reports a peer that went away
        raise DistributedError(f"rank 0: {e}") from None
    finally:
        session.close()
