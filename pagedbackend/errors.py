"""The error a request gets when the engine refuses it."""
from typing import Optional

# How the refusal of a request that has already run begins: its structured
# output reached a position that no token continues. Front ends that see only
# the message (Triton's gRPC stream) answer it as the client's fault too.
GRAMMAR_DEAD_END = "structured output cannot go on"


class InvalidRequestError(ValueError):
    """A request the engine refuses (bad parameters, a prompt that can never fit);
    ``param`` names the request's field at fault, when one is."""

    def __init__(self, message: str = "", param: Optional[str] = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):   # pickled across processes with its field
        return type(self), (str(self), self.param)
