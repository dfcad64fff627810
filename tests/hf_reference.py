"""The correctness reference: HuggingFace transformers on the same weights (float32)."""
from __future__ import annotations

import torch


def load_hf(path):
    """A transformers model for a checkpoint directory, or (path None) for the embedded GGUF
    model, built from the weights kvserve's loader reads (the loader tests show those equal
    transformers' own GGUF loading)."""
    import transformers
    if path is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
        return model.eval()
    from kvserve.model.loader import hf_config_dict, load_model
    loaded = load_model(None, dtype=torch.float32)
    cfg = transformers.LlamaConfig(**hf_config_dict(loaded.config))
    model = transformers.LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(loaded.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.to(torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with transformers' own KV cache, never stopping at EOS."""
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    tokens = []
    for _ in range(max_new_tokens):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return tokens
