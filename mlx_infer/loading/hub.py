"""Hugging Face Hub repo ids, resolved to a local snapshot folder (works offline from the cache)."""

from __future__ import annotations

import re
from pathlib import Path

from mlx_infer.errors import ModelNotFound

# What a model needs: config and tokenizer JSON, weights, and a separate chat template if there is one.
ALLOW_PATTERNS = [
    "*.json", "*.safetensors", "tokenizer.model", "tiktoken.model", "*.tiktoken", "*.txt", "*.jinja"
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(spec: str) -> bool:
    return bool(_REPO_ID.match(spec)) and not spec.endswith(".gguf")


def snapshot(repo_id: str) -> Path:
    """The local folder of ``repo_id``: downloaded if needed, or found in the cache under HF_HUB_OFFLINE=1."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS))
    except RepositoryNotFoundError:
        raise ModelNotFound(f"{repo_id}: no such model on the Hugging Face Hub (or it is private)") from None
    except LocalEntryNotFoundError:
        raise ModelNotFound(
            f"{repo_id}: not a local path, and not in the Hugging Face cache (offline or Hub unreachable)"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        reason = " ".join(str(e).split())
        raise ModelNotFound(f"{repo_id}: could not fetch from the Hugging Face Hub ({reason})") from None
