"""Random PEFT LoRA adapters for the tests, built with peft on transformers' model of a checkpoint,
and transformers + PEFT as the reference that runs them."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(hf_model, directory: str | Path, *, r: int = 8, alpha: float = 16, targets=ALL_TARGETS,
                 seed: int = 0, rslora: bool = False, magnitude: float = 1.0) -> str:
    """Save a LoRA adapter of `hf_model` (left unchanged) with random lora_A and lora_B (PEFT
    initialises B to zero, which would change nothing) under `directory`."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        init_lora_weights=False, use_rslora=rslora)
    gen = torch.Generator().manual_seed(seed)
    peft_model = get_peft_model(hf_model, config)
    try:
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * magnitude / p.shape[1] ** 0.5)
        peft_model.save_pretrained(str(directory))
    finally:
        peft_model.unload()  # the base model's own modules back in place
    return str(directory)


@contextlib.contextmanager
def peft_reference(hf_model, adapters: dict[str, str]):
    """transformers + PEFT over `hf_model` with each adapter under its name; yields a function
    name -> a model running that adapter (None: the base model). The base model is restored after."""
    from peft import PeftModel
    names = list(adapters)
    model = PeftModel.from_pretrained(hf_model, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()

    class _Base:
        def __call__(self, **kw):
            with model.disable_adapter():
                return model(**kw)

    def select(name):
        if name is None:
            return _Base()
        model.set_adapter(name)
        return model
    try:
        yield select
    finally:
        model.unload()
