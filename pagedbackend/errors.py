"""The error a request gets when the engine refuses it."""


class InvalidRequestError(ValueError):
    """A request the engine refuses (bad parameters, a prompt that can never fit)."""
