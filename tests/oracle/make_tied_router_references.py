"""Write transformers' logits for tiny MoE checkpoints whose routers score every expert the same.

With the router weights (and biases, score corrections) zeroed, every expert ties with every other, so
which experts a token goes to is decided by the top-k's tie rule alone. ``torch.topk`` on CUDA fills the
places left among equal scores by index (the lowest indices win); on CPU it runs libstdc++'s
``nth_element`` / ``partial_sort`` on the values alone and keeps whichever tied experts the algorithm's
pivots leave in front. The checkpoints' home is CUDA (and vLLM's routing kernels keep the lowest index
too), so the reference runs transformers' own model code with ``torch.topk`` keeping the lowest indices
among ties; the stock CPU logits are saved beside it to show that the choice matters here.

    HF_HUB_OFFLINE=1 /tmp/oracle-venv/bin/python tests/oracle/make_tied_router_references.py

Writes ``tests/oracle/tiny/<name>/tied_router.npz``: ``tokens`` (int32 ``[n]``), ``logits`` (float32
``[n, vocab]``, lowest-index ties), ``cpu_logits`` (the same with CPU ``torch.topk``) and ``versions``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import transformers

TINY = Path(__file__).parent / "tiny"
# One checkpoint per router implementation: softmax (Qwen3-MoE), sigmoid with groups (GLM-4.5),
# softmax with groups (DeepSeek V2), softmax over the chosen logits (gpt-oss), Gemma 4's.
NAMES = ("qwen3_moe", "glm4_moe", "deepseek_v2", "gpt_oss", "gemma4")
ROUTER = re.compile(
    r"\.(mlp\.gate\.(weight|e_score_correction_bias)|mlp\.router\.(weight|bias)|router\.proj\.weight)$"
)
PROMPT_LENGTH = 40

_stock_topk = torch.topk


def lowest_index_topk(x, k, dim=-1, largest=True, sorted=True, *, out=None):
    """``torch.topk`` with CUDA's rule among equal values: a stable sort keeps them in index order."""
    assert out is None
    order = torch.sort(x, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((torch.gather(x, dim, order), order))


def logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].float().numpy()


def make(name: str) -> None:
    folder = TINY / name
    config = json.loads((folder / "config.json").read_text())
    composite = "text_config" in config
    auto = transformers.AutoModelForImageTextToText if composite else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    zeroed = 0
    with torch.no_grad():
        for n, p in [*model.named_parameters(), *model.named_buffers()]:
            if ROUTER.search(n):
                p.zero_()
                zeroed += 1
    assert zeroed, name
    tokens = np.random.default_rng(11).integers(3, 128, PROMPT_LENGTH).astype(np.int32)  # the tiny vocab
    cpu = logits(model, tokens)
    with mock.patch.object(torch, "topk", lowest_index_topk):
        ref = logits(model, tokens)
    gap = float(np.abs(ref - cpu).max())
    versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    np.savez_compressed(folder / "tied_router.npz", tokens=tokens, logits=ref, cpu_logits=cpu,
                        versions=np.array(json.dumps(versions)))
    print(f"{name}: {zeroed} router tensors zeroed; lowest-index and CPU topk logits differ by {gap:.2f}")


if __name__ == "__main__":
    for n in NAMES:
        make(n)
