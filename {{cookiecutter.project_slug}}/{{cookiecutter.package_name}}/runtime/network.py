"""Which network interface the ranks talk over.

gloo and NCCL advertise to their peers the address their host name resolves to, often a loopback
address (Debian and Ubuntu: 127.0.1.1) no other machine can reach: a multi-node job then fails at
its first collective. `socket_interface_env` picks the interface the kernel uses to reach
MASTER_ADDR (`ip route get ADDR`) unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME is set.

`python -m <package>.runtime.network HOST` prints `INTERFACE ADDRESS IS_LOCAL` for the multi-node
script. No torch import here: the script calls it before torchrun starts."""

from __future__ import annotations

import ipaddress
import socket
import struct
import sys
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

VARIABLES = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


@dataclass(frozen=True)
class Route:
    interface: str  # "" when unknown (not Linux)
    address: str  # this machine's address on the way to the host
    loopback: bool  # the host is this machine, reached over loopback


def _addresses(interface: str) -> set[str]:
    """The IPv4 and IPv6 addresses of one interface (Linux)."""
    found = set()
    with suppress(OSError, ImportError):  # no IPv4 address (0x8915: SIOCGIFADDR), or not Linux
        import fcntl
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            request = struct.pack("256s", interface[:15].encode())
            found.add(socket.inet_ntoa(fcntl.ioctl(probe.fileno(), 0x8915, request)[20:24]))
    with suppress(OSError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            if (fields := line.split())[-1] == interface:
                found.add(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return found


def route_to(host: str) -> Route | None:
    """How this machine reaches `host`; None when `host` does not resolve or has no route."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)  # UDP: only asks the kernel for a route; nothing is sent
            local = probe.getsockname()[0]
    except OSError:
        return None
    local = local.split("%", 1)[0]
    loopback, interface = ipaddress.ip_address(local).is_loopback, ""
    with suppress(OSError):
        interface = next((n for _, n in socket.if_nameindex() if local in _addresses(n)), "")
    return Route(interface, local, loopback)


def is_local(address: str) -> bool:
    """Whether `address` belongs to this machine (a socket can be bound to it)."""
    try:
        with socket.socket(socket.getaddrinfo(address, 0)[0][0], socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


def socket_interface_env(backend: str, route: Route | None, master_addr: str,
                         env: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """The variables to set (none if set already, on one machine, or without a route), a note."""
    if (name := VARIABLES.get(backend)) is None or route is None:
        return {}, ""
    if env.get(name):
        return {}, f"{env[name]} ({name}, set by you)"
    if route.loopback or not route.interface:
        return {}, ""
    return {name: route.interface}, f"{route.interface} ({route.address}, routes to {master_addr})"


def advertised_address(backend: str, env: Mapping[str, str]) -> str:
    """The address this process offers its peers when no variable chooses one: its host name's."""
    name = VARIABLES.get(backend, "")
    if env.get(name):
        addresses = _addresses(env[name])
        return f"{', '.join(sorted(addresses)) or '?'} (interface {env[name]}, from {name})"
    try:
        hostname = socket.gethostname()
        return f"{socket.gethostbyname(hostname)} (the address host name {hostname} resolves to)"
    except OSError:
        return "unknown (the host name does not resolve)"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m <package>.runtime.network HOST", file=sys.stderr)
        return 2
    if (route := route_to(argv[0])) is None:
        print(f"error: no route to {argv[0]}: check the host name and the network", file=sys.stderr)
        return 1
    print(route.interface or "-", route.address, "true" if is_local(argv[0]) else "false")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
