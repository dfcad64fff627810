"""LoRARequest (vLLM's name and fields) and the key that ties a request's KV to one adapter's content."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with: a PEFT directory (adapter_config.json and
    adapter_model.safetensors) under a name. As vLLM's: `LoRARequest(lora_name, lora_int_id, lora_path)`."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string (got {self.lora_name!r})")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer of at least 1 (got {self.lora_int_id!r}); "
                             f"vLLM reserves 0 for the base model")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be the adapter's directory (got {self.lora_path!r})")

    # vLLM's older accessors
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


def adapter_key(name: str, digest: str) -> str:
    """A request's `lora_id`: the adapter's name and the SHA-256 of its weights and scaling. It
    roots every block hash of the request (kv/hashing.py), so a name reloaded with other weights
    never meets the blocks the old weights computed, and equal adapters under one name share them."""
    return f"{name}@{digest}"
