"""The error every configuration check raises (kvserve.config re-exports it, as its users import it)."""


class ConfigError(ValueError):
    """An engine setting is invalid; the message names the flag and what to change."""
