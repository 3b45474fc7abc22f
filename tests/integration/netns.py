"""A client host of its own for a test: a network namespace joined to this one by a veth pair.

tests/integration/db/test_frozen_client.py runs a lock holder inside it and then cuts the link,
which is how a vanished worker host looks to the server: its keepalive probes go out and
nothing answers. On loopback the server's TCP peer (the client's kernel, or a proxy) always
answers them, so only a link of its own shows that the library's server keepalives free the
lock.

Addresses are link-local (169.254.0.0/16), on the veth pair only, with no route beyond it.
Needs root, iproute2's ``ip`` and network namespaces; :func:`missing` names what is absent.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass

#: Set to 1 (CI) to fail, rather than deselect, the tests that need a namespace.
REQUIRE_ENV = "CELERY_PGLOCK_REQUIRE_NETNS"
#: Seconds any one ``ip`` command may take.
IP_TIMEOUT = 10.0
#: 169.254.1.0 to 169.254.254.255 (RFC 3927 reserves the first and last /24) as /30 blocks.
BLOCKS = 254 * 64
#: How many blocks are tried when the first is in use (another test run on this machine).
BLOCK_ATTEMPTS = 20


@dataclass(frozen=True)
class Link:
    """A namespace, its veth pair, and the two addresses of the pair's /30."""

    namespace: str
    host_device: str
    client_device: str
    host_address: str
    client_address: str

    def exec_argv(self, *argv: str) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def cut(self) -> None:
        """Take the client's end of the pair down: what the server sends goes nowhere, and
        nothing comes back (no reset, no ICMP), as when a host loses power."""
        _ip(*self.exec_argv("ip", "link", "set", "dev", self.client_device, "down"))


def missing() -> list[str]:
    """What this machine lacks to build a :class:`Link`; empty when it has everything.

    Creates and deletes a namespace to find out, since only trying shows whether the
    kernel (or a container's seccomp profile) allows it.
    """
    if os.geteuid() != 0:
        return [f"root (running as uid {os.geteuid()})"]
    if shutil.which("ip") is None:
        return ["the ip command (Debian package iproute2)"]
    name = f"pglock-check-{os.getpid()}"
    try:
        _ip("ip", "netns", "add", name)
    except RuntimeError as error:
        return [f"network namespaces ({error})"]
    _ip_quietly("ip", "netns", "del", name)
    return []


def create(tag: str) -> Link:
    """A namespace ``pglock-<tag>-<pid>`` with a veth pair up and addressed.

    The caller must call :func:`remove` (in a ``finally``), also when this raises.
    """
    pid = os.getpid()
    namespace = f"pglock-{tag}-{pid}"
    # Interface names are at most 15 characters.
    host_device, client_device = f"pgv{pid}h", f"pgv{pid}c"
    network = _free_network(pid)
    host_address, client_address = (str(address) for address in network.hosts())
    _ip("ip", "netns", "add", namespace)
    link = Link(namespace, host_device, client_device, host_address, client_address)
    try:
        pair = ("type", "veth", "peer", "name", client_device, "netns", namespace)
        _ip("ip", "link", "add", host_device, *pair)
        _ip("ip", "addr", "add", f"{host_address}/30", "dev", host_device)
        _ip("ip", "link", "set", "dev", host_device, "up")
        inside = link.exec_argv
        _ip(*inside("ip", "addr", "add", f"{client_address}/30", "dev", client_device))
        _ip(*inside("ip", "link", "set", "dev", client_device, "up"))
        # A permanent neighbour entry: when the link is cut, the server's packets leave
        # and vanish as behind a router, instead of failing address resolution (which
        # the server would report as "No route to host" rather than a timeout).
        client_mac = _ip(*inside("ip", "-br", "link", "show", "dev", client_device))
        neighbour = (client_address, "lladdr", client_mac.split()[2])
        _ip(
            "ip", "neigh", "replace", *neighbour, "dev", host_device, "nud", "permanent"
        )
    except BaseException:
        remove(link)
        raise
    return link


def remove(link: Link) -> None:
    """Delete the namespace and the pair (deleting one end deletes both); never raises."""
    _ip_quietly("ip", "netns", "del", link.namespace)
    _ip_quietly("ip", "link", "del", link.host_device)


def _free_network(pid: int) -> ipaddress.IPv4Network:
    """A /30 of 169.254.0.0/16 that no interface of this namespace uses yet."""
    for attempt in range(BLOCK_ATTEMPTS):
        block = (pid + attempt) % BLOCKS
        network = ipaddress.IPv4Network(
            f"169.254.{1 + block // 64}.{block % 64 * 4}/30"
        )
        if not _ip("ip", "-4", "-o", "addr", "show", "to", str(network)).strip():
            return network
    raise RuntimeError(
        f"No free /30 in 169.254.0.0/16 after {BLOCK_ATTEMPTS} tries "
        "(ip -4 addr show lists them all)."
    )


def _ip(*argv: str) -> str:
    try:
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=IP_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(f"{' '.join(argv)}: {error}") from None
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed with exit code {result.returncode}: "
            f"{result.stderr.strip()}"
        )
    return result.stdout


def _ip_quietly(*argv: str) -> None:
    with contextlib.suppress(RuntimeError):
        _ip(*argv)
