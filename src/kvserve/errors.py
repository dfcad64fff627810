"""The errors kvserve raises by name: ConfigError, which every configuration check raises
(kvserve.config re-exports it, as its users import it), and TensorParallelError."""


class ConfigError(ValueError):
    """An engine setting is invalid; the message names the flag and what to change."""


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group failed or is gone: the group cannot run another step."""
