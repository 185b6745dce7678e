"""A Gemma 4 style vocabulary as llama.cpp writes it (``tokenizer.ggml.model = gemma4``), and llama.cpp's
own token ids for a few texts, in tests/oracle/gemma4_tokenizer/.

The tiny checkpoints' word-level tokenizer is no Gemma tokenizer, so this trains a small one of Gemma 4's
kind (BPE over ``▁``-for-space text with byte fallback, Gemma 4's special tokens, newline runs as added
tokens), gives it to llama.cpp's convert_hf_to_gguf.py with a tiny Gemma4ForCausalLM of its vocabulary
size (the converter's own Gemma4Model.set_vocab writes the vocabulary: token types, merges, BOS/EOS ids),
then asks llama.cpp's server to tokenize each text. Run with the oracle venv:

    /tmp/oracle-venv/bin/python tests/oracle/make_gemma4_tokenizer.py LLAMA_CPP_DIR LLAMA_BUILD_DIR

It writes ``vocab.gguf`` (the vocabulary only) and ``llama_cpp_ids.json`` ([text, ids] pairs, BOS added
as llama.cpp adds it). The trainer breaks ties differently from run to run, so the two files are written
(and committed) together.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE / "gemma4_tokenizer"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|channel>", "<channel|>",
            "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>']  # fmt: skip
TEXTS = [
    "Hello world! Café déjà vu — 123 😊",
    "The model loads from folders: per-layer inputs, wider global attention heads.",
    "  two leading spaces and   three inside  ",
    "line one\nline two\n\nparagraph\n\n\n\nfour newlines\n\n\n\n\n\n\nseven",
    "def rope_pairs(head_dim: int, params: dict[str, Any]) -> tuple[int, mx.array | None]:\n"
    "    return head_dim // 2",
    "<|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n<|channel>thinking<channel|>4<turn|>",
    "Привет, как дела? 日本語のテキスト ÿ€ \t tab",
    "\n\nleading newlines and trailing\n",
    '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
    "emoji 😊😊 and 🦙 unknown bytes ✓",
]


def write_checkpoint(folder: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    root = HERE.parent.parent
    corpus = [line for name in ("README.md", "mlx_infer/models/gemma4.py")
              for line in (root / name).read_text().splitlines()]  # fmt: skip
    corpus += ["Café déjà vu — naïve façade", "Привет, как дела?", "日本語のテキスト", "emoji 😊 test"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    newline_runs = ["\n" * k for k in range(1, 6)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIALS) + len(byte_tokens) + 500,
        special_tokens=SPECIALS + byte_tokens + newline_runs,
        initial_alphabet=list("abcdefghijklmnopqrstuvwxyz"), limit_alphabet=120, show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:  # byte tokens and newline runs are no special tokens
        added["special"], added["normalized"] = added["content"] in SPECIALS, False
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
        "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>", "add_bos_token": False,
        "extra_special_tokens": SPECIALS[5:],
    }))  # fmt: skip
    config = json.loads((HERE / "tiny" / "gemma4_text" / "config.json").read_text())
    for key in ("architectures", "transformers_version", "dtype"):
        config.pop(key)
    n = tok.get_vocab_size(with_added_tokens=True)
    config.update(vocab_size=n, vocab_size_per_layer_input=n)
    torch.manual_seed(0)
    Gemma4ForCausalLM(Gemma4TextConfig(**config)).save_pretrained(folder)


def llama_cpp_ids(model: Path, build: Path, port: int = 18931) -> list[list[int]]:
    server = subprocess.Popen([str(build / "bin" / "llama-server"), "-m", str(model), "--port", str(port),
                               "-t", "1", "-c", "256"], env={"LD_LIBRARY_PATH": str(build / "bin")},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        for _ in range(60):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                time.sleep(0.5)
        ids = []
        for text in TEXTS:
            body = json.dumps({"content": text, "add_special": True, "parse_special": True}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize", data=body,
                                             headers={"Content-Type": "application/json"})  # fmt: skip
            ids.append(json.loads(urllib.request.urlopen(request).read())["tokens"])
        return ids
    finally:
        server.terminate()
        server.wait()


def main(llama_cpp: Path, build: Path) -> None:
    OUT.mkdir(exist_ok=True)
    converter = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_checkpoint(folder)
        subprocess.run([*converter, tmp, "--vocab-only", "--outfile", str(OUT / "vocab.gguf")], check=True)
        subprocess.run([*converter, tmp, "--outtype", "f32", "--outfile", f"{tmp}/m.gguf"], check=True)
        ids = llama_cpp_ids(folder / "m.gguf", build)
    pairs = [[t, i] for t, i in zip(TEXTS, ids)]
    (OUT / "llama_cpp_ids.json").write_text(json.dumps(pairs, ensure_ascii=False))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
