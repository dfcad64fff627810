"""kvserve: an LLM inference engine built around KV-cache management."""
from kvserve.config import EngineArgs
from kvserve.core.lora import LoRARequest
from kvserve.core.sampling_params import SamplingParams
from kvserve.version import __version__


def __getattr__(name):  # keep `import kvserve` light: torch loads only when the engine is used
    if name == "LLM":
        from kvserve.engine.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineArgs", "LoRARequest", "__version__"]
