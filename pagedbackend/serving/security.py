"""Who may talk to a server: API keys, the check of a presented key, and the
refusal to serve a non-loopback address without one (docs/security.md).

Keys come from ``--api-key`` (repeatable) and ``$PAGEDBACKEND_API_KEY``
(comma-separated), as vLLM's ``--api-key`` / ``VLLM_API_KEY``. The OpenAI API
takes any of them as ``Authorization: Bearer KEY``; tritonserver's own ports
take the first in the ``pagedbackend-api-key`` header (its restricted-API
options hold one value per API).
"""
import hmac
import ipaddress
import os
import re
import socket
from typing import Iterable, List, Mapping, Optional, Sequence

API_KEY_ENV = "PAGEDBACKEND_API_KEY"
# tritonserver's HTTP ports read this header; gRPC clients send it with the
# restricted protocol's prefix (``GRPC_API_KEY_HEADER``).
API_KEY_HEADER = "pagedbackend-api-key"
GRPC_API_KEY_HEADER = "triton-grpc-protocol-" + API_KEY_HEADER
PUBLIC_BIND_FLAG = "--allow-public-without-api-key"


def api_keys(given: Optional[Iterable[str]] = None, env: Optional[Mapping[str, str]] = None) -> List[str]:
    """The keys of ``--api-key`` options, else of ``$PAGEDBACKEND_API_KEY``
    (comma-separated); empty entries dropped, order kept."""
    env = os.environ if env is None else env
    keys = [k for k in given or [] if k]
    if not keys:
        keys = [k.strip() for k in env.get(API_KEY_ENV, "").split(",") if k.strip()]
    for key in keys:
        if any(ord(c) < 0x21 or ord(c) > 0x7e or c == "," for c in key):
            raise ValueError("an API key must be printable ASCII without spaces or commas "
                             "(it travels in an HTTP header)")
    return list(dict.fromkeys(keys))


def key_matches(presented: Optional[str], keys: Sequence[str]) -> bool:
    """Whether ``presented`` is one of ``keys``, in time that does not depend
    on where a wrong key first differs (every key is compared)."""
    if presented is None:
        return False
    given = presented.encode("utf-8", "surrogateescape")
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode())
    return found


def bearer(authorization: Optional[str]) -> Optional[str]:
    """The token of an ``Authorization: Bearer TOKEN`` header value."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) reaches this machine only:
    127.0.0.0/8, ::1, or a name that resolves to those alone."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def refuse_public_bind(host: str, keys: Sequence[str], allowed: bool, what: str) -> Optional[str]:
    """The message refusing to serve ``what`` on ``host`` without a key, or None."""
    if keys or allowed or is_loopback(host):
        return None
    return (f"refusing to serve {what} on {host}, which is not a loopback address, without an API key: "
            f"anyone who can reach it could use it. Set one with --api-key KEY or ${API_KEY_ENV} "
            f"(make serve API_KEY=KEY), or pass {PUBLIC_BIND_FLAG} to serve it open deliberately "
            "(docs/security.md)")


# Internal names that an error message must not carry to a client: the Python
# backend's shared-memory regions (a leaked name could be registered through
# the shared-memory API: Triton CVE-2025-23319/23320/23334), files under
# /dev/shm, and the server's own installation paths.
_INTERNAL = [
    (re.compile(r"triton_python_backend_shm_region_[\w.-]*"), "<shared-memory region>"),
    (re.compile(r"/dev/shm/[^\s'\",;)]*"), "<shared-memory file>"),
    (re.compile(r"(?:/[^\s'\",;:()]+)*/(?:site|dist)-packages/[^\s'\",;:()]*"), "<server file>"),
]


def redact(message: str) -> str:
    """``message`` with internal names (``_INTERNAL``) replaced by what they are."""
    for pattern, name in _INTERNAL:
        message = pattern.sub(name, message)
    return message
