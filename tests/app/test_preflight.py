"""Commands refuse what cannot work before the slow part: a port in use before the model loads, a model that does
not fit the memory before it is built or read (issue 46, items 5 and 6)."""
import socket

from moedesk.app.cli import main
from moedesk.app.ports import check_port
from moedesk.engine.runtime import Engine


def test_serve_checks_the_port_before_loading(monkeypatch, capsys):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(Engine, "load", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--model", "demo", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"moedesk: --port {port}: cannot listen on 127.0.0.1:{port} (already in use); choose another " \
                  f"with --port"


def test_a_free_port_and_a_bad_host():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_port("127.0.0.1", port)  # free again: no error
    try:
        check_port("no.such.host.invalid", port)
    except Exception as e:  # noqa: BLE001
        assert str(e).startswith("--host no.such.host.invalid: not an address")
    else:
        raise AssertionError("a host that does not resolve was accepted")
