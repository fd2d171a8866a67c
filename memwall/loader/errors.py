"""Errors raised while loading a model: one line a user can act on."""


class ModelLoadError(ValueError):
    """A model path, file or format we cannot load; the message names it and what is supported."""
