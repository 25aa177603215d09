"""Whether `moedesk serve` can listen where asked, checked before the model's slow load rather than after it."""
from __future__ import annotations

import socket

from moedesk.engine.errors import MoedeskError


def check_port(host: str, port: int) -> None:
    """Raise MoedeskError (one line) when (host, port) cannot be bound now: in use, or not an address here.

    Binds as uvicorn will (SO_REUSEADDR, so a port in TIME_WAIT still counts as free) and lets go at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise MoedeskError(f"--host {host}: not an address this machine can listen on ({e})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            why = "already in use" if e.errno in (98, 48, 10048) else (e.strerror or str(e))
            raise MoedeskError(f"--port {port}: cannot listen on {host}:{port} ({why}); "
                               f"choose another with --port") from None
