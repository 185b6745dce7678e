"""Convert a tiny random checkpoint of tests/oracle/tiny/ to GGUF with llama.cpp's own converter.

llama.cpp's ``convert_hf_to_gguf.py`` is the independent oracle of the GGUF layout (tensor names, the
split and transposed MLA ``attn_k_b`` / ``attn_v_b``, stacked experts, metadata keys). Only the
vocabulary is written here: the converter identifies real BPE tokenizers by a hash, and the tiny
folders' word-level tokenizer is none of them, so the same ``w<i>`` words go in as a plain token list.

Run it with the oracle venv and a llama.cpp source tree (the one vendored in the llama-cpp-python sdist):

    /tmp/oracle-venv/bin/python tests/oracle/make_tiny_gguf.py LLAMA_CPP_DIR NAME [OUTTYPE [ARGS...]]

It writes ``tests/oracle/tiny/<NAME>/model.<OUTTYPE>.gguf`` (default f32); transformers' logits in the
folder's ``reference.npz`` are then the GGUF's reference too. ARGS go to the converter as they
are: the Qwen3-Next / Qwen3.5 converters want ``--no-mtp`` for a checkpoint without the
multi-token-prediction layer (they insist on one otherwise).
"""

from __future__ import annotations

import sys
from pathlib import Path

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
    sys.argv = ["convert_hf_to_gguf.py", str(folder), "--outtype", outtype,
                "--outfile", str(folder / f"model.{outtype}.gguf"), *converter_args]  # fmt: skip
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
