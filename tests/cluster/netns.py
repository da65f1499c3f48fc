"""Hosts of their own on one machine: a network namespace per host, joined by a bridge.

Each host is a namespace with one interface, `eth0`, holding an address in SUBNET; its
other end sits on a bridge inside a namespace of its own (the switch), so nothing of it
touches the machine's own network and no address outside SUBNET is ever used. A link is
cut by taking the host's port on the switch down (packets are dropped, as by a pulled
cable: no reset reaches either end) and slowed by a token bucket on both directions.
The hosts named `apart` sit on a second bridge, joined to the first by one link (the
trunk): cutting it splits the cluster in two halves that each still work inside.

Code runs on a host either as a process (`argv`: `ip netns exec`) or in a thread of this
process (`inside`): setns(2) moves only the calling thread, and the sockets it opens
(and the threads and processes it starts) stay in that host's network. Those threads
live until `down`: a child started with a parent-death signal (every service is) gets
it when the thread that started it ends, not only when this process does.

Names carry this process's id; `sweep_stale` removes those a killed run left behind."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")

SUBNET = "10.213.77"  # a /24 used only inside the namespaces made here
PREFIX = "lamina-t"
_CLONE_NEWNET = 0x40000000


def missing() -> str | None:
    """What this machine lacks to make hosts (None: nothing)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool} command (iproute2) is not installed"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"network namespaces cannot be made here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def sweep_stale() -> None:
    """Delete the namespaces of runs whose process is gone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        m = re.match(rf"({PREFIX}(\d+)-\S+)", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            subprocess.run(["ip", "netns", "del", m.group(1)], capture_output=True)


class Hosts:
    """Namespaces named after `names`, each at SUBNET.(its position + 1); those in
    `apart` on a bridge of their own joined to the others' by the trunk."""

    def __init__(self, names: Sequence[str], apart: Sequence[str] = ()) -> None:
        self.names = list(names)
        self.apart = set(apart)
        assert self.apart <= set(self.names), f"{sorted(self.apart - set(self.names))} are not hosts"
        self._tag = f"{PREFIX}{os.getpid()}"
        self._switch = f"{self._tag}-sw"
        self._made: list[str] = []
        self._threads: dict[str, concurrent.futures.ThreadPoolExecutor] = {}  # per host, for `inside`

    def namespace(self, name: str) -> str:
        return f"{self._tag}-{name}"

    def address(self, name: str) -> str:
        return f"{SUBNET}.{self.names.index(name) + 1}"

    def _port(self, name: str) -> str:
        return f"p{self.names.index(name)}"  # the host's port on the switch

    def up(self) -> Hosts:
        sweep_stale()
        try:
            _ip("netns", "add", self._switch)
            self._made.append(self._switch)
            for bridge in ("br0", "br1"):
                _ip("-n", self._switch, "link", "add", bridge, "type", "bridge")
                _ip("-n", self._switch, "link", "set", bridge, "up")
            _ip("-n", self._switch, "link", "add", "trunk0", "type", "veth", "peer", "name", "trunk1")
            for end, bridge in (("trunk0", "br0"), ("trunk1", "br1")):
                _ip("-n", self._switch, "link", "set", end, "master", bridge, "up")
            for name in self.names:
                ns = self.namespace(name)
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("link", "add", "name", self._port(name), "netns", self._switch, "type", "veth",
                    "peer", "name", "eth0", "netns", ns)
                bridge = "br1" if name in self.apart else "br0"
                _ip("-n", self._switch, "link", "set", self._port(name), "master", bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """End the hosts' threads and delete every namespace (their interfaces go with them)."""
        for pool in self._threads.values():
            pool.shutdown(wait=True, cancel_futures=True)
        self._threads.clear()
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True)

    def __enter__(self) -> Hosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- the links -------------------------------------------------------------------------
    def cut(self, name: str) -> None:
        """Cut `name`'s link: nothing goes in or out, and neither end is told."""
        _ip("-n", self._switch, "link", "set", self._port(name), "down")

    def heal(self, name: str) -> None:
        _ip("-n", self._switch, "link", "set", self._port(name), "up")

    def split(self) -> None:
        """Cut the trunk: the `apart` hosts reach only each other, the rest only theirs."""
        _ip("-n", self._switch, "link", "set", "trunk0", "down")

    def join(self) -> None:
        _ip("-n", self._switch, "link", "set", "trunk0", "up")

    def limit(self, name: str, mbit: int) -> None:
        """A token bucket of `mbit` Mbit/s on both directions of `name`'s link."""
        for ns, dev in ((self.namespace(name), "eth0"), (self._switch, self._port(name))):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                            "rate", f"{mbit}mbit", "burst", "64kb", "latency", "50ms"], check=True,
                           capture_output=True)

    def unlimit(self, name: str) -> None:
        for ns, dev in ((self.namespace(name), "eth0"), (self._switch, self._port(name))):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)

    @contextlib.contextmanager
    def cut_off(self, *names: str) -> Iterator[None]:
        """Those hosts' links cut for the block, healed after it whatever happens."""
        try:
            for name in names:
                self.cut(name)
            yield
        finally:
            for name in names:
                self.heal(name)

    # -- running on a host -----------------------------------------------------------------
    def argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """`argv` as a process on host `name`."""
        return ["ip", "netns", "exec", self.namespace(name), *argv]

    def inside(self, name: str, fn: Callable[[], T]) -> T:
        """`fn()` run in a thread on host `name`'s network; its result or its exception.
        (A few threads per host, so a call may wait on another made from inside it.)"""
        if name not in self._threads:
            path = f"/run/netns/{self.namespace(name)}"
            self._threads[name] = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix=f"host-{name}", initializer=_enter, initargs=(path,))
        return self._threads[name].submit(fn).result()


def _enter(path: str) -> None:
    """Move the calling thread into the network namespace at `path`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {path} failed")
    finally:
        os.close(fd)
