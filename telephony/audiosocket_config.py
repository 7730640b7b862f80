"""What `serve --audiosocket` and `--audiosocket-allow` say: listeners, each with its agent, and the networks
allowed to connect (AudioSocket carries no credentials). Light: the service's config imports it."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK_NETWORKS = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
# Loopback, RFC 1918, carrier-grade NAT, link-local and IPv6 unique-local: where a PBX and this node meet.
PRIVATE_NETWORKS = ("127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                    "169.254.0.0/16", "::1/128", "fc00::/7", "fe80::/10")  # fmt: skip


@dataclass(frozen=True, slots=True)
class AudioSocketListen:
    """One `--audiosocket HOST:PORT[=AGENT]`."""

    host: str
    port: int
    agent: str | None = None

    def __str__(self) -> str:
        return f"{self.host}:{self.port}" + (f"={self.agent}" if self.agent else "")


def parse_listeners(text: str) -> tuple[AudioSocketListen, ...]:
    """`HOST:PORT[=AGENT]`, comma-separated (IPv6 hosts in brackets); ValueError says what is wrong."""
    out: list[AudioSocketListen] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        address, _, agent = item.partition("=")
        host, sep, port_text = address.rpartition(":")
        if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
            raise ValueError(f"an AudioSocket listener is HOST:PORT[=AGENT], got {item!r}")
        out.append(AudioSocketListen(host.strip("[]"), int(port_text), agent.strip() or None))
    return tuple(out)


def parse_networks(text: str) -> tuple[Network, ...]:
    """CIDRs, comma-separated; `private` stands for PRIVATE_NETWORKS, `any` for every address; nothing:
    () (the listeners' default, loopback only)."""
    if not text.strip():
        return ()
    nets: list[Network] = []
    for item in (part.strip() for part in text.split(",")):
        if item == "private":
            nets.extend(ipaddress.ip_network(n) for n in PRIVATE_NETWORKS)
        elif item == "any":
            nets.extend(ipaddress.ip_network(n) for n in ("0.0.0.0/0", "::/0"))
        elif item:
            try:
                nets.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ValueError(f"not a network (CIDR, 'private' or 'any'): {item!r}") from None
    return tuple(nets)


def allowed(peer: str, networks: tuple[Network, ...]) -> bool:
    """Whether `peer` may connect: in `networks`, or on loopback when none are given."""
    networks = networks or LOOPBACK_NETWORKS
    try:
        address = ipaddress.ip_address(peer.split("%")[0])  # an IPv6 zone id is not part of the address
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack socket shows an IPv4 peer as ::ffff:a.b.c.d
    return any(address in net for net in networks)
