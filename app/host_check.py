"""Which Host headers a server without an API key answers: a guard against DNS rebinding, where a web page's own
name is pointed at 127.0.0.1 and its scripts then reach a server on this machine as if they were the page's."""
from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def allowed_hosts(bound: str, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The host names a keyless server bound to `bound` answers to; None: any (bound to every interface, where the
    names it is reached by cannot be known; `serve` warns that such a server needs a key)."""
    if bound in ("0.0.0.0", "::", ""):
        return None if not extra else frozenset({*LOOPBACK_NAMES, *map(str.lower, extra)})
    return frozenset({*LOOPBACK_NAMES, bound.lower(), *map(str.lower, extra)})


def host_name(header: str) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1", "Example.com:80" -> "example.com"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    name, _, port = header.rpartition(":")
    if name and port.isdigit():
        try:
            ipaddress.IPv6Address(header)  # a bare IPv6 address: its colons are not a port
            return header
        except ValueError:
            return name
    return header
