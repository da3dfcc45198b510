"""Hosts for the many-hosts test: Linux network namespaces joined to the test by veth pairs.

Each :class:`Host` is a network namespace with one veth pair: the root end (``gateway``, in the
test's namespace) and the host end (``address``) form a /30 of their own. The namespaces get no
default route, so a worker inside can reach only the gateway address, where the test binds its
private ``redis-server`` and a TCP proxy to PostgreSQL; nothing else on or off this machine.

A worker runs in its namespace under ``unshare --uts`` with a hostname of its own, so its owner
string (``host:pid``) names the host it runs on. :meth:`Host.cut` partitions a host (a silent
black hole, or its link down); the host stays alive and keeps running its bodies (a partition,
not a crash). :meth:`Host.restore` heals it and TCP resumes.

Every name carries a per-run tag, and :meth:`Hosts.close` removes every link and namespace,
also after a failure.
"""

from __future__ import annotations

import contextlib
import ipaddress
import random
import subprocess
import uuid
from dataclasses import dataclass, field

__all__ = ["Host", "Hosts", "netns_unavailable"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def _tc(*args: str, ns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    subprocess.run([*prefix, "tc", *args], capture_output=True, text=True, timeout=30, check=True)


def _mac(link: str, ns: str | None = None) -> str:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    return subprocess.run([*prefix, "cat", f"/sys/class/net/{link}/address"], capture_output=True,
                          text=True, timeout=30, check=True).stdout.strip()


def netns_unavailable() -> str | None:
    """Why this process cannot make namespaces and veth pairs, or None when it can."""
    tag = uuid.uuid4().hex[:6]
    ns, veth = f"idem-probe-{tag}", f"ip{tag}"
    try:
        for args in (("netns", "add", ns),
                     ("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p"),
                     ("link", "set", f"{veth}p", "netns", ns)):
            out = _ip(*args, check=False)
            if out.returncode != 0:
                return f"`ip {' '.join(args)}` failed: {out.stderr.strip()}"
        out = subprocess.run(["tc", "qdisc", "replace", "dev", veth, "root", "pfifo", "limit", "0"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            return f"`tc qdisc ... pfifo limit 0` failed: {out.stderr.strip()}"
        if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0:
            return "`unshare --uts` is not permitted"
        return None
    except FileNotFoundError as exc:
        return f"{exc.filename} is not installed"
    finally:
        _ip("link", "del", veth, check=False)
        _ip("netns", "del", ns, check=False)


@dataclass
class Host:
    """One namespace: ``address`` inside it, ``gateway`` (the test's end) outside."""

    index: int
    ns: str
    hostname: str
    root_link: str
    host_link: str
    gateway: str
    address: str
    cut_mode: str = field(default="")

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace with this host's own hostname."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostname, *argv]

    def cut(self, mode: str = "blackhole") -> None:
        """Partition the host; it keeps running.

        ``blackhole``: every packet either way is dropped silently (a zero-length queue on both
        ends of the veth; the carrier and the neighbour entries stay), like a switch that died:
        the host's TCP connections stall and retransmit, and resume after :meth:`restore`.
        ``linkdown``: the link goes down; the host sees its routes vanish and its sockets fail
        at once (``No route to host``).
        """
        if mode == "blackhole":
            _tc("qdisc", "replace", "dev", self.root_link, "root", "pfifo", "limit", "0")
            _tc("qdisc", "replace", "dev", self.host_link, "root", "pfifo", "limit", "0", ns=self.ns)
        elif mode == "linkdown":
            _ip("link", "set", self.root_link, "down")
        else:
            raise ValueError(f"mode must be 'blackhole' or 'linkdown', not {mode!r}")
        self.cut_mode = mode

    def restore(self) -> None:
        if self.cut_mode == "blackhole":
            _tc("qdisc", "del", "dev", self.root_link, "root")
            _tc("qdisc", "del", "dev", self.host_link, "root", ns=self.ns)
        elif self.cut_mode == "linkdown":
            _ip("link", "set", self.root_link, "up")
        self.cut_mode = ""

    @property
    def is_cut(self) -> bool:
        return bool(self.cut_mode)


class Hosts:
    """``count`` namespaces, each on its own /30 of one random 10.x.y.0/24 this machine lacks."""

    def __init__(self, count: int) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.hosts: list[Host] = []
        try:
            subnet = self._free_subnet()
            for i in range(count):
                self.hosts.append(self._make(i, subnet))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        used = [ipaddress.ip_interface(word).network
                for line in _ip("-o", "-4", "addr", "show").stdout.splitlines()
                for word in line.split()[3:4]]
        rng = random.Random()
        for _ in range(200):
            net = ipaddress.ip_network(f"10.{rng.randint(64, 250)}.{rng.randint(0, 255)}.0/24")
            if not any(net.overlaps(u) for u in used):
                return net
        raise RuntimeError("no free 10.x.y.0/24 for the test's hosts")

    def _make(self, i: int, subnet: ipaddress.IPv4Network) -> Host:
        base = subnet.network_address + 4 * i
        host = Host(
            index=i, ns=f"idem-{self.tag}-h{i}", hostname=f"host{i}-{self.tag}",
            root_link=f"i{self.tag}r{i}", host_link=f"i{self.tag}h{i}",
            gateway=str(base + 1), address=str(base + 2),
        )
        _ip("netns", "add", host.ns)
        self.hosts.append(host)  # from here on, close() removes it
        _ip("link", "add", host.root_link, "type", "veth", "peer", "name", host.host_link)
        _ip("link", "set", host.host_link, "netns", host.ns)
        _ip("addr", "add", f"{host.gateway}/30", "dev", host.root_link)
        _ip("link", "set", host.root_link, "up")
        _ip("-n", host.ns, "addr", "add", f"{host.address}/30", "dev", host.host_link)
        _ip("-n", host.ns, "link", "set", host.host_link, "up")
        _ip("-n", host.ns, "link", "set", "lo", "up")
        # Permanent neighbour entries: during a black hole ARP fails too, and a failed neighbour
        # makes the kernel report "No route to host" (what a linkdown cut is for).
        _ip("-n", host.ns, "neigh", "replace", host.gateway, "lladdr", _mac(host.root_link),
            "dev", host.host_link, "nud", "permanent")
        _ip("neigh", "replace", host.address, "lladdr", _mac(host.host_link, host.ns),
            "dev", host.root_link, "nud", "permanent")
        self.hosts.pop()
        return host

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.hosts)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    @property
    def gateways(self) -> list[str]:
        return [h.gateway for h in self.hosts]

    def close(self) -> None:
        """Remove every link and namespace of this run (idempotent)."""
        for host in self.hosts:
            with contextlib.suppress(Exception):
                _ip("link", "del", host.root_link, check=False)  # deletes the pair
            with contextlib.suppress(Exception):
                _ip("netns", "del", host.ns, check=False)
        self.hosts.clear()
