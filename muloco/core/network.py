"""Addresses as a worker's peers on other hosts see them: whether a host name is loopback (only this
host reaches it), and where gloo opens its sockets."""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback one (a name that does not resolve is not)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    addresses = {info[4][0].split("%", 1)[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def gloo_on_loopback(environ: Mapping[str, str]) -> str | None:
    """Why gloo's sockets (and the addresses it tells its peers) would be loopback ones, or None. Without
    GLOO_SOCKET_IFNAME, gloo takes the address this host's name resolves to, and many hosts' /etc/hosts
    map their name to 127.0.x.1."""
    if environ.get(GLOO_INTERFACE_ENV, "").strip():
        return None
    name = socket.gethostname()
    return f"host name {name!r} resolves to loopback" if is_loopback(name) else None


def host_port(address: str) -> tuple[str, int]:
    """("host", port) of "http://host:port", "host:port" or "[v6]:port"."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)
