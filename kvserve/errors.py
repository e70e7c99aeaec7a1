"""The error a user must act on (a configuration to change), shared by every layer: the CLI prints its
message as one line, the server answers it with HTTP 400."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration the user must change; the message says what to change."""
