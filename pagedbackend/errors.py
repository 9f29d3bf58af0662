"""The error a request gets when the engine refuses it."""
from typing import Optional


class InvalidRequestError(ValueError):
    """A request the engine refuses (bad parameters, a prompt that can never fit);
    ``param`` names the request's field at fault, when one is."""

    def __init__(self, message: str = "", param: Optional[str] = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):   # pickled across processes with its field
        return type(self), (str(self), self.param)
