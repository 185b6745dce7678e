"""Convert a tiny random checkpoint of tests/oracle/tiny/ to GGUF with llama.cpp's own converter.

llama.cpp's ``convert_hf_to_gguf.py`` is the independent oracle of the GGUF layout (tensor names, the
split and transposed MLA ``attn_k_b`` / ``attn_v_b``, stacked experts, metadata keys; Gemma 4's per-layer
arrays, ``rope_freqs`` and fused ``ffn_gate_up_exps``). Only the vocabulary is written here: the converter
identifies real BPE tokenizers by a hash, and the tiny folders' word-level tokenizer is none of them, so
the same ``w<i>`` words go in as a plain token list (make_gemma4_tokenizer.py tests a real vocabulary).

Run it with the oracle venv and a llama.cpp source tree (the one vendored in the llama-cpp-python sdist):

    /tmp/oracle-venv/bin/python tests/oracle/make_tiny_gguf.py LLAMA_CPP_DIR NAME [OUTTYPE [ARGS...]]

It writes ``tests/oracle/tiny/<NAME>/model.<OUTTYPE>.gguf`` (default f32); transformers' logits in the
folder's ``reference.npz`` are then the GGUF's reference too. ARGS go to the converter as they
are, except ``--add-mtp-layer``: the Qwen3-Next / Qwen3.5 converters insist on the multi-token-prediction
layer their published checkpoints carry (``--no-mtp`` leaves it out), which the tiny checkpoints lack;
this converts a copy of the folder with a random one added (``mtp.*``, shaped as the last layer), which
the GGUF then carries after the model's layers, as real conversions do.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

TINY = Path(__file__).parent / "tiny"


def main(llama_cpp: Path, name: str, outtype: str = "f32", *converter_args: str) -> None:
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(1, str(llama_cpp / "gguf-py"))
    import convert_hf_to_gguf
    import gguf

    def set_vocab(self) -> None:
        n = self.hparams["vocab_size"]
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_token_list([f"w{i}" for i in range(n)])
        self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
        self.gguf_writer.add_token_merges([])
        self.gguf_writer.add_bos_token_id(1)
        self.gguf_writer.add_eos_token_id(2)

    # The architecture's converter class, once the converter has picked (and imported) it.
    pick = convert_hf_to_gguf.get_model_class

    def get_model_class(*args, **kwargs):
        cls = pick(*args, **kwargs)
        cls.set_vocab = set_vocab
        return cls

    convert_hf_to_gguf.get_model_class = get_model_class
    folder = TINY / name
    outfile = folder / f"model.{outtype}.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        source = folder
        if "--add-mtp-layer" in converter_args:
            converter_args = tuple(a for a in converter_args if a != "--add-mtp-layer")
            source = with_mtp_layer(folder, Path(tmp))
        sys.argv = ["convert_hf_to_gguf.py", str(source), "--outtype", outtype, "--outfile", str(outfile),
                    *converter_args]  # fmt: skip
        convert_hf_to_gguf.main()


def with_mtp_layer(folder: Path, tmp: Path) -> Path:
    """A copy of ``folder`` whose checkpoint also holds a Qwen3-Next / Qwen3.5 multi-token-prediction
    block under the published names: ``mtp.layers.0.*`` (a decoder layer shaped as the last one),
    ``mtp.fc`` ([D, 2D]) and its three norms; random values, so that a loader using any of it fails."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(folder, tmp / folder.name)
    out = tmp / folder.name
    weights = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    last = f"layers.{text['num_hidden_layers'] - 1}."
    rng = np.random.default_rng(1)
    hidden = text["hidden_size"]
    mtp = {"mtp.fc.weight": rng.standard_normal((hidden, 2 * hidden), np.float32) / np.sqrt(2 * hidden)}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = 0.1 * rng.standard_normal(hidden, np.float32)
    for key, value in weights.items():
        if last in key:
            noise = rng.standard_normal(value.shape, np.float32) * value.std()
            mtp["mtp.layers.0." + key.partition(last)[2]] = (value + noise).astype(np.float32)
    save_file({**weights, **mtp}, out / "model.safetensors", metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
