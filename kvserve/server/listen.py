"""The server's listening socket, bound before the model loads: a port in use (or a host this machine
does not have) is one line at once, not a traceback after minutes of loading. vLLM binds early too."""

from __future__ import annotations

import errno
import socket

from kvserve.errors import ConfigError


def bind_server_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening (uvicorn listens once the app is built,
    so a client that comes early is refused rather than left hanging on a loading server)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise ConfigError(f"--host {host}: {err.strerror}") from None
    sock = socket.socket(family, kind, proto)
    # SO_REUSEADDR (as uvicorn sets it) lets a restart bind past TIME_WAIT; never SO_REUSEPORT, which
    # would let a second server share the port silently
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is in use (another server?); stop it or choose "
                              f"another --port") from None
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock.set_inheritable(True)
    return sock
