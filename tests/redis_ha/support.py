"""Private Redis Cluster and Redis Sentinel deployments for the tests (never the shared 6379).

* :class:`LocalCluster`: 6 ``redis-server --cluster-enabled yes`` nodes (3 masters, 3 replicas)
  joined by ``redis-cli --cluster create``; a test may SIGKILL a master, wait for its replica's
  promotion, and restart the dead node (it rejoins as a replica from its ``nodes.conf``).
* :class:`SentinelGroup`: 1 master, 1 replica and 3 sentinels watching them as ``mymaster``.

Every wait is a bounded poll (``wait_for``); nothing sleeps to synchronise.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import redis

from tests.chaos.support import ChaosRedis, Stack, reset_app
from tests.integration.harness import wait_for

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
MASTER_NAME = "mymaster"


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too, below the ephemeral range."""
    for _ in range(500):
        port = random.randint(20000, 29999)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise AssertionError("no free port pair for a cluster node")


class Node:
    """One ``redis-server`` process with its own directory; restartable on the same port."""

    def __init__(self, port: int, args: list[str], root: Path) -> None:
        self.port = port
        self.args = args
        self.dir = root / str(port)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log"), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for(self.ping, timeout=30, what=f"redis-server on {self.port}")

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1,
                           socket_timeout=5)

    def ping(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"redis-server on {self.port} exited with {self.proc.returncode}")
        try:
            with self.client() as c:
                return bool(c.ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(20)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalCluster:
    """3 masters + 3 replicas on free ports; ``node_timeout_ms`` sets how fast a failover starts."""

    def __init__(self, node_timeout_ms: int = 2000) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="celery-idem-cluster-"))
        self.nodes: dict[int, Node] = {}
        try:
            for _ in range(6):
                port = cluster_port()
                while port in self.nodes:
                    port = cluster_port()
                node = Node(port, ["--cluster-enabled", "yes", "--cluster-config-file",
                                   "nodes.conf", "--cluster-node-timeout", str(node_timeout_ms),
                                   "--appendonly", "no"], self.root)
                node.start()
                self.nodes[port] = node
            subprocess.run(
                [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.nodes),
                 "--cluster-replicas", "1", "--cluster-yes"],
                check=True, capture_output=True, timeout=120,
            )
            wait_for(self.healthy, timeout=60, interval=0.2, what="the cluster to be ok")
        except BaseException:
            self.cleanup()
            raise

    @property
    def url(self) -> str:
        seeds = ",".join(f"127.0.0.1:{p}" for p in list(self.nodes)[:3])
        return f"redis+cluster://{seeds}"

    def _info(self, node: Node) -> dict[str, str]:
        with node.client() as c:
            text = c.execute_command("CLUSTER", "INFO")
        text = text.decode() if isinstance(text, bytes) else str(text)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def table(self) -> list[tuple[str, int, str, str]]:
        """``CLUSTER NODES`` as (node id, port, flags, master id), from the first live node."""
        for node in self.nodes.values():
            if not node.alive:
                continue
            try:
                with node.client() as c:
                    raw = c.execute_command("CLUSTER", "NODES")
            except redis.RedisError:
                continue
            rows = []
            for line in _s(raw).splitlines():
                parts = line.split()
                port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
                rows.append((parts[0], port, parts[2], parts[3]))
            return rows
        return []

    def roles(self) -> dict[int, str]:
        """port -> 'master' | 'slave' | 'failed', as the live nodes see each other."""
        out: dict[int, str] = {}
        for _id, port, flags, _master in self.table():
            if "fail" in flags.split(","):
                out[port] = "failed"
            else:
                out[port] = "master" if "master" in flags else "slave"
        return out

    def masters(self) -> list[int]:
        return sorted(p for p, r in self.roles().items() if r == "master" and self.nodes[p].alive)

    def healthy(self, replicas: bool = True) -> bool:
        """Every live node says cluster_state:ok, all 16384 slots served, 3 live masters (each
        with a replica in sync, unless ``replicas`` is False)."""
        try:
            for node in self.nodes.values():
                if not node.alive:
                    continue
                info = self._info(node)
                if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != "16384":
                    return False
            masters = self.masters()
            return len(masters) == 3 and (
                not replicas or all(self.replicas_online(p) >= 1 for p in masters))
        except redis.RedisError:
            return False

    def replicas_online(self, master: int) -> int:
        with self.nodes[master].client() as c:
            info = c.info("replication")
        return sum(1 for v in info.values() if isinstance(v, dict) and v.get("state") == "online")

    def master_of(self, name: str) -> int:
        """The port of the master that serves the key ``name``."""
        for port in self.masters():
            with self.nodes[port].client() as c:
                slot = int(c.execute_command("CLUSTER", "KEYSLOT", name))
                owner = c.execute_command("CLUSTER", "SLOTS")
            for start, end, master, *_ in owner:
                if int(start) <= slot <= int(end):
                    return int(master[1])
        raise AssertionError(f"no master serves {name}")

    def replica_of(self, master: int) -> int:
        rows = self.table()
        master_id = next(i for i, port, _f, _m in rows if port == master)
        return next(port for _i, port, _f, m in rows if m == master_id)

    def wait_promoted(self, dead: int, timeout: float = 60) -> int:
        """After ``dead`` was killed: wait until its replica is master and the cluster is ok."""
        replica = self.replica_of_dead.get(dead)
        wait_for(lambda: self.healthy(replicas=False) and replica in self.masters(), timeout=timeout,
                 interval=0.1, what=f"the replica {replica} of {dead} to take over")
        assert replica is not None
        return replica

    replica_of_dead: dict[int, int]

    def kill_master(self, port: int) -> None:
        self.replica_of_dead = getattr(self, "replica_of_dead", {})
        self.replica_of_dead[port] = self.replica_of(port)
        self.nodes[port].kill()

    def restart(self, port: int, timeout: float = 120) -> None:
        """Start a killed node again; it rejoins as a replica of the master that replaced it."""
        self.nodes[port].start()
        new_master = self.replica_of_dead[port]

        def rejoined() -> bool:
            with self.nodes[new_master].client() as c:
                info = c.info("replication")
            return any(isinstance(v, dict) and v.get("port") == port and v.get("state") == "online"
                       for v in info.values())

        wait_for(lambda: self.healthy() and rejoined(), timeout=timeout, interval=0.2,
                 what=f"node {port} to rejoin as a replica of {new_master}")

    def cleanup(self) -> None:
        for node in self.nodes.values():
            node.kill()
        shutil.rmtree(self.root, ignore_errors=True)


class SentinelGroup:
    """A master, one replica and three sentinels (quorum 2) watching ``mymaster``."""

    def __init__(self, down_after_ms: int = 1000) -> None:
        self.master = ChaosRedis("--appendonly", "no")
        self.replica = ChaosRedis("--appendonly", "no", "--replicaof", "127.0.0.1",
                                  str(self.master.port))
        self.servers = {self.master.port: self.master, self.replica.port: self.replica}
        self.root = Path(tempfile.mkdtemp(prefix="celery-idem-sentinel-"))
        self.sentinels: list[Node] = []
        try:
            wait_for(lambda: self.replicas_online(self.master.port) >= 1, timeout=30,
                     what="the replica to sync")
            for _ in range(3):
                port = cluster_port()
                conf = self.root / f"sentinel-{port}.conf"
                conf.write_text(
                    f"port {port}\nbind 127.0.0.1\ndir {self.root}\n"
                    f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master.port} 2\n"
                    f"sentinel down-after-milliseconds {MASTER_NAME} {down_after_ms}\n"
                    f"sentinel failover-timeout {MASTER_NAME} 10000\n"
                    f"sentinel parallel-syncs {MASTER_NAME} 1\n"
                )
                node = Node(port, [], self.root)
                # a sentinel reads its config file first: start it as `redis-server conf --sentinel`
                node.args = ["--sentinel"]
                self.sentinels.append(node)
                self._start_sentinel(node, conf)
            wait_for(self.settled, timeout=60, interval=0.2, what="the sentinels to see each other")
        except BaseException:
            self.cleanup()
            raise

    def _start_sentinel(self, node: Node, conf: Path) -> None:
        node.proc = subprocess.Popen(
            [REDIS_SERVER, str(conf), "--sentinel", "--logfile", str(self.root / f"{node.port}.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for(node.ping, timeout=30, what=f"sentinel on {node.port}")

    def replicas_online(self, port: int) -> int:
        try:
            with self.servers[port].client() as c:
                info = c.info("replication")
        except redis.RedisError:
            return 0
        return sum(1 for v in info.values() if isinstance(v, dict) and v.get("state") == "online")

    def master_port(self) -> int | None:
        """The master the sentinels name now (from the first sentinel that answers)."""
        for node in self.sentinels:
            try:
                with node.client() as c:
                    addr = c.execute_command("SENTINEL", "get-master-addr-by-name", MASTER_NAME)
            except redis.RedisError:
                continue
            if addr:
                return int(addr[1])
        return None

    def settled(self) -> bool:
        for node in self.sentinels:
            try:
                with node.client() as c:
                    m: Any = c.execute_command("SENTINEL", "master", MASTER_NAME)
            except redis.RedisError:
                return False
            info = m if isinstance(m, dict) else dict(zip(m[::2], m[1::2], strict=True))
            info = {_s(k): _s(v) for k, v in info.items()}
            if info.get("num-other-sentinels") != "2" or info.get("num-slaves") != "1":
                return False
        return True

    @property
    def url(self) -> str:
        """Celery's spelling: one ``sentinel://`` per sentinel, separated by ``;``."""
        return ";".join(f"sentinel://127.0.0.1:{n.port}/0" for n in self.sentinels)

    def fail_over(self, timeout: float = 60) -> tuple[int, int]:
        """SIGKILL the current master; wait until the sentinels promote the replica.

        Returns (old master port, new master port).
        """
        old = self.master_port()
        assert old is not None
        self.servers[old].stop()
        new = wait_for(lambda: (p := self.master_port()) not in (None, old) and p, timeout=timeout,
                       interval=0.1, what="the sentinels to promote the replica")
        wait_for(lambda: self._is_master(int(new)), timeout=timeout, what="the promotion")
        return old, int(new)

    def _is_master(self, port: int) -> bool:
        try:
            with self.servers[port].client() as c:
                return bool(c.info("replication")["role"] == "master")
        except redis.RedisError:
            return False

    def restart(self, port: int, timeout: float = 120) -> None:
        """Start a killed server again as a replica of the new master.

        The sentinels would reconfigure it themselves, but only after two of their 10 s INFO
        polls and 8 s without a missed 1 s ping: on a loaded CI machine that took over 60 s.
        The test sends the ``REPLICAOF`` an operator (or the sentinels) would; what is under
        test is the store across the failover, not how fast Sentinel tidies up afterwards.
        """
        self.servers[port].start()
        new = self.master_port()
        assert new is not None and new != port
        with self.servers[port].client() as c:
            c.execute_command("REPLICAOF", "127.0.0.1", str(new))

        def replicated() -> bool:
            # Whichever server the sentinels name now: on a loaded machine they may fail over
            # again (1 s down-after), and the master of the two is then the other one.
            master = self.master_port()
            return master is not None and self.replicas_online(master) >= 1

        try:
            wait_for(replicated, timeout=timeout, interval=0.2,
                     what=f"{port} to rejoin as a replica (of {new} when restarted)")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {self.describe()}") from None

    def describe(self) -> str:
        """Each server's replication role and the sentinels' view, for a failure message."""
        parts = []
        for p, server in self.servers.items():
            try:
                with server.client() as c:
                    info = c.info("replication")
                parts.append(f"{p}: role={info.get('role')} master_port={info.get('master_port')}"
                             f" link={info.get('master_link_status')}"
                             f" replicas={info.get('connected_slaves')}")
            except redis.RedisError as e:
                parts.append(f"{p}: {e!r}")
        parts.append(f"sentinels name {self.master_port()}")
        return "; ".join(parts)

    def cleanup(self) -> None:
        for node in self.sentinels:
            node.kill()
        for server in self.servers.values():
            server.cleanup()
        shutil.rmtree(self.root, ignore_errors=True)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class HaStack(Stack):
    """A chaos :class:`Stack` whose Celery result backend may be other than the broker."""

    def __init__(self, *args: Any, backend_url: str | None = None,
                 backend_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.backend_url = backend_url
        self.backend_conf: dict[str, Any] = {}
        import json

        # A failover on a loaded machine can outlast the default re-queues for an unreachable
        # store (3, about 7 s): these workers wait it out, as docs/production.md advises for a
        # replicated store.
        self.env["IDEM_CONF"] = json.dumps({"idempotency_store_requeues": None})
        if backend_url:
            self.backend_conf = {
                "result_backend": backend_url,
                "result_backend_transport_options": backend_options or {},
                # Without it Celery stores a result once: a task that finishes while the master
                # is down loses its result ("Exception raised outside body"), and its caller waits.
                "result_backend_always_retry": True,
            }
            self.env["IDEM_CONF"] = json.dumps(
                {"idempotency_store_requeues": None, **self.backend_conf})
        self._saved_backend: dict[str, Any] = {}

    def activate(self) -> None:
        saved = {k: self.app.conf.get(k) for k in self.backend_conf}
        super().activate()
        if self.backend_conf:
            self._saved_backend = saved
            reset_app(self.app)
            self.app.conf.update(self.backend_conf)

    def deactivate(self) -> None:
        super().deactivate()
        self.app.conf.update(self._saved_backend)
        self._saved_backend = {}
