"""A tiny random Qwen3 embedding checkpoint (a decoder with last-token
pooling, shaped as Qwen3-Embedding), saved by transformers with the
sentence-transformers files that make it an embedding model
(``modules.json``, ``1_Pooling/config.json``), and the reference
embeddings transformers gives for it, for the pooling tests and servers."""
import json
import pathlib
from typing import List, Sequence

import torch

from loadtest.tiny_families import build_tiny_family

# sentence-transformers' flag of each pooler.
ST_MODES = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}


def build_tiny_embedder(path, pooling_type: str = "LAST", normalize: bool = True,
                        sentence_transformers: bool = True) -> pathlib.Path:
    """Qwen3 (2 layers, hidden 64, full attention) in ``path``; with
    ``sentence_transformers``, the files that name its pooler and whether
    it normalises (a ``Normalize`` module)."""
    path = build_tiny_family(path, "qwen3", use_sliding_window=False, sliding_window=None)
    if sentence_transformers:
        write_sentence_transformers_files(path, pooling_type, normalize)
    return path


def write_sentence_transformers_files(path: pathlib.Path, pooling_type: str, normalize: bool) -> None:
    """``modules.json`` (Transformer, Pooling, and Normalize when asked) and
    ``1_Pooling/config.json`` naming ``pooling_type``, as sentence-transformers saves them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    pooling = {"word_embedding_dimension": hidden, **{flag: kind == pooling_type for kind, flag in ST_MODES.items()}}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))


def hf_embeddings(path, prompts: Sequence[Sequence[int]], pooling_type: str = "LAST", normalize: bool = True,
                  dimensions=None) -> List[torch.Tensor]:
    """transformers' embeddings of token id lists: ``AutoModel``'s last
    hidden state (after the final norm), pooled, cut to ``dimensions``,
    L2-normalised when asked. One prompt at a time (no padding)."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([list(ids)])).last_hidden_state[0]
            vector = {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(dim=0)}[pooling_type]
            if dimensions is not None:
                vector = vector[:dimensions]
            out.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return out


def cosine_distance(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(1.0 - torch.dot(a, b) / (a.norm() * b.norm()))
