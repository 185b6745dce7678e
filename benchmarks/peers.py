"""The peers, run on the same weights: mlx-lm (bfloat16, as its users run it) and llama.cpp (the GGUF).

mlx-lm runs in a subprocess that never imports mlx_infer, so it gets MLX exactly as installed (the
reference BLAS on Linux) rather than the BLAS mlx_infer binds. Its checkpoint is written from the
weights mlx_infer loaded (HF names and config), cast to bfloat16: mlx-lm cannot read GGUF itself.
llama.cpp runs through ``llama-bench``, its decode at the prompt's depth (``-d``) as ours decodes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from measure import Result

CACHE = Path(os.environ.get("MLX_INFER_CACHE", Path.home() / ".cache" / "mlx-infer")) / "bench"


# ---- mlx-lm ----------------------------------------------------------------------------------
def mlx_lm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("mlx_lm") is not None


def export_mlx_checkpoint(lm, source: str) -> Path:
    """Write (once) an MLX/HF folder of ``lm``'s weights in bfloat16; returns the folder."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    src = Path(source)
    stat = src.stat()
    dest = CACHE / f"{src.stem}-{stat.st_size}-{int(stat.st_mtime)}-bf16"
    if (dest / "model.safetensors").exists():
        return dest
    if any(a.dtype == mx.uint32 for _, a in tree_flatten(lm.model.parameters())):
        # Kept quantized (the native CPU kernels): mlx-lm gets the same values dequantized.
        from mlx_infer.loading import load

        lm = load(source, keep_quantized=False)
    dest.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in lm.config.items() if k not in ("quantization", "quantization_config")}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    weights = {name: a.astype(mx.bfloat16) for name, a in tree_flatten(lm.model.parameters())}
    tmp = dest / "model.tmp.safetensors"
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    tmp.rename(dest / "model.safetensors")
    return dest


def run_mlx_lm(folder: Path, prompt_len: int, gen_len: int, repeats: int, kv_bytes_per_token: int) -> Result:
    """Batch 1 through ``mlx_lm.generate.generate_step`` (the loop ``mlx_lm.generate`` uses)."""
    env = {k: v for k, v in os.environ.items() if k != "MLX_INFER_BLAS"}
    cmd = [sys.executable, __file__, "mlx-lm", str(folder), str(prompt_len), str(gen_len), str(repeats)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"mlx-lm failed: {proc.stderr.strip().splitlines()[-1:]}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return Result(
        "mlx-lm", "bfloat16", 1, data["prefill"], data["decode"], weight_bytes=data["weight_bytes"],
        kv_bytes_per_token=kv_bytes_per_token,
        decode_context=prompt_len + gen_len / 2, note=f"mlx-lm {data['version']}", kv="bfloat16",
    )


def _mlx_lm_child(folder: str, prompt_len: int, gen_len: int, repeats: int) -> None:
    import mlx.core as mx
    import mlx_lm
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, config = load_model(Path(folder))
    params = tree_flatten(model.parameters())
    tied = not any(name.startswith("lm_head.") for name, _ in params)
    weight_bytes = sum(a.nbytes for name, a in params if tied or "embed_tokens" not in name)
    rng = np.random.default_rng(0)

    def once(p: int, n: int) -> tuple[float, float]:
        prompt = mx.array(rng.integers(0, config["vocab_size"], p).astype(np.int32))
        start = time.perf_counter()
        steps = generate_step(prompt, model, max_tokens=n)
        next(steps)
        first = time.perf_counter()
        for _ in steps:
            pass
        return first - start, time.perf_counter() - first

    once(min(prompt_len, 32), min(gen_len, 4))  # warm-up
    prefill, decode = [], []
    for _ in range(repeats):
        t_prefill, t_decode = once(prompt_len, gen_len)
        prefill.append(prompt_len / t_prefill)
        decode.append((gen_len - 1) / t_decode)
    print(json.dumps({"prefill": prefill, "decode": decode, "weight_bytes": weight_bytes,
                      "version": mlx_lm.__version__}))


# ---- llama.cpp -------------------------------------------------------------------------------
def find_llama_bench(explicit: str | None) -> str | None:
    if explicit:
        return explicit if Path(explicit).is_file() else None
    return shutil.which("llama-bench")


# mlx-infer's --kv-cache-dtype -> llama.cpp's cache type (-ctk/-ctv) and its bytes per value; "auto" is
# float16 on the CPU backend, as llama.cpp's default. llama-bench takes no f32 cache.
LLAMA_KV_TYPES = {"auto": ("f16", 2.0), "float16": ("f16", 2.0), "bfloat16": ("bf16", 2.0),
                  "int8": ("q8_0", 34 / 32)}


def run_llama_bench(
    binary: str, gguf: str, prompt_len: int, gen_len: int, repeats: int, threads: int, kv_dtype: str = "auto"
) -> Result:
    """Prefill of ``prompt_len`` tokens from an empty context, and decode of ``gen_len`` tokens after a
    ``prompt_len``-token context (``-d``, llama-bench's depth), as mlx-infer's decode runs: llama-bench's
    plain ``tg`` test decodes from an empty context, which attends over fewer keys. The KV cache is
    ``kv_dtype``'s equivalent (LLAMA_KV_TYPES); a quantized one needs flash attention (``-fa 1``)."""
    weight_bytes, kv_f16_per_token, qtype = _gguf_sizes(gguf)
    cache, value_bytes = LLAMA_KV_TYPES[kv_dtype]
    kv_per_token = int(kv_f16_per_token / 2 * value_bytes)
    result = Result(
        "llama.cpp", qtype, 1, weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token,
        decode_context=prompt_len + gen_len / 2, note="", kv=cache,
    )
    common = ["-m", gguf, "-r", str(repeats), "-t", str(threads), "-o", "json", "-ctk", cache, "-ctv", cache]
    if cache == "q8_0":
        common += ["-fa", "1"]
    prefill = _llama_bench_test(binary, [*common, "-p", str(prompt_len), "-n", "0"])
    decode = _llama_bench_test(binary, [*common, "-p", "0", "-n", str(gen_len), "-d", str(prompt_len)])
    result.prefill, result.decode = prefill["samples"], decode["samples"]
    result.note = f"llama-bench {decode['build_commit']}, {threads} threads, decode at depth {prompt_len}"
    return result


def _llama_bench_test(binary: str, args: list[str]) -> dict:
    """The one test of a llama-bench run: its tokens/s samples and build commit."""
    proc = subprocess.run([binary, *args], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise RuntimeError(f"llama-bench failed: {last[0]}")
    (test,) = json.loads(proc.stdout)
    return {"samples": [float(x) for x in test.get("samples_ts") or [test["avg_ts"]]],
            "build_commit": test.get("build_commit", "")}


def _gguf_sizes(path: str) -> tuple[int, int, str]:
    """Bytes one decode step reads (all tensors, less an untied token table), f16 KV bytes per token,
    and the dominant quantization type."""
    from collections import Counter

    from gguf import GGUFReader

    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    untied = "output.weight" in names
    weight_bytes = sum(
        int(t.n_bytes) for t in reader.tensors if not (untied and t.name == "token_embd.weight")
    )
    types: Counter = Counter()
    for t in reader.tensors:
        types[t.tensor_type.name] += int(t.n_bytes)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def field(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].parts[-1][0])

    n_kv_heads = field("attention.head_count_kv")
    head_dim = field("embedding_length") // field("attention.head_count")
    kv_per_token = 2 * field("block_count") * n_kv_heads * head_dim * 2  # K and V, float16
    return weight_bytes, kv_per_token, types.most_common(1)[0][0]


# ---- llama.cpp's quality: llama-perplexity --kl-divergence ------------------------------------
@dataclass
class LlamaQuality:
    """``llama-perplexity --kl-divergence`` of a GGUF against an F32 GGUF of the same weights."""

    tokens: int  # scored positions: the second half of each chunk
    chunks: int
    ctx: int
    kl_mean: float
    kl_p99: float
    kl_max: float
    same_top: float  # "Same top p", as a fraction
    ppl_base: float  # the F32 GGUF's perplexity
    ppl: float


def find_llama_tool(name: str, directory: str | None) -> str | None:
    """``name`` (e.g. ``llama-perplexity``) in ``directory``, or on PATH without one."""
    if directory:
        path = Path(directory) / name
        return str(path) if path.is_file() else None
    return shutil.which(name)


def f32_gguf(quantize: str, gguf: str) -> Path:
    """An F32 GGUF of ``gguf``'s weights, made once with ``llama-quantize --allow-requantize`` and cached:
    llama.cpp's exact path, which computes F32 weights with F32 activations."""
    src = Path(gguf)
    stat = src.stat()
    dest = CACHE / f"{src.stem}-{stat.st_size}-{int(stat.st_mtime)}-F32.gguf"
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    _run_tool([quantize, "--allow-requantize", gguf, str(tmp), "F32"], "llama-quantize")
    tmp.rename(dest)
    return dest


LLAMA_Q8_KV = ("-ctk", "q8_0", "-ctv", "q8_0")  # llama.cpp's 8-bit KV cache (a scale per 32 values)


def run_llama_kld(
    perplexity: str, quantize: str, gguf: str, text: Path, ctx: int, chunks: int, threads: int, workdir: Path
) -> tuple[LlamaQuality, LlamaQuality]:
    """Base logits from the F32 GGUF over ``chunks`` chunks of ``ctx`` tokens of ``text``, then scored
    against them (``--kl-divergence-base`` then ``--kl-divergence``): ``gguf`` (its 8-bit activations),
    and the F32 GGUF itself with a q8_0 KV cache (the KV cache's loss alone)."""
    base = workdir / "kld-base.bin"
    f32 = str(f32_gguf(quantize, gguf))
    common = ["-c", str(ctx), "--chunks", str(chunks), "-t", str(threads), "--kl-divergence-base", str(base)]
    _run_tool([perplexity, "-m", f32, "-f", str(text), *common], "llama-perplexity")
    activations = _run_tool([perplexity, "-m", gguf, "--kl-divergence", *common], "llama-perplexity")
    kv = _run_tool([perplexity, "-m", f32, "--kl-divergence", *LLAMA_Q8_KV, *common], "llama-perplexity")
    return parse_kld(activations, ctx), parse_kld(kv, ctx)


def parse_kld(output: str, ctx: int) -> LlamaQuality:
    """The statistics ``llama-perplexity --kl-divergence`` prints at its end (it prints none for fewer
    than 100 scored tokens: a RuntimeError then)."""
    text = re.sub(r"[ \t]+", " ", output)  # labels are padded to line up; match them with single spaces

    def number(label: str) -> float:
        match = re.search(re.escape(label) + r" ?:? ?(-?[0-9.]+(?:e[-+]?\d+)?|-?nan|-?inf)", text)
        if match is None:
            raise RuntimeError(f"llama-perplexity printed no {label!r} (too few tokens scored?)")
        return float(match.group(1))

    chunks = int(number("computing over"))
    return LlamaQuality(
        tokens=chunks * (ctx - 1 - ctx // 2), chunks=chunks, ctx=ctx,
        kl_mean=number("Mean KLD"), kl_p99=number("99.0% KLD"), kl_max=number("Maximum KLD"),
        same_top=number("Same top p") / 100, ppl_base=number("Mean PPL(base)"), ppl=number("Mean PPL(Q)"),
    )


def _run_tool(cmd: list[str], name: str) -> str:
    """stdout and stderr of ``cmd`` (llama.cpp logs its results to stderr); RuntimeError if it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise RuntimeError(f"{name} failed: {last[0]}")
    return proc.stdout + proc.stderr


if __name__ == "__main__" and sys.argv[1:2] == ["mlx-lm"]:
    _mlx_lm_child(sys.argv[2], *map(int, sys.argv[3:6]))
