"""Worker indexes claimed in the metadata store (`--index auto`).

Replicas of one service definition (compose's `deploy.replicas`, `docker compose up
--scale`) all run the same command, so none can be given its index on the command
line. Each claims one instead: the key NS:index:SECTION:I holds its owner (host name and
process id) with a time-to-live, renewed by a daemon thread for the life of the process
(the service's event loop starts only after the index is known, which its id and head
range depend on). redis-py's Lock does the compare-and-set.

- A worker restarted in its own container gets its index back at once: the container
  keeps its host name and the entrypoint's `exec` makes the worker process 1 again.
- A new replica takes the lowest index that no one holds; when every index is held it
  waits for one to lapse (a replica that died without releasing), and gives up after
  `wait_s` naming the count to raise.
- A worker that stops releases its claim; one that is killed lets it lapse after `ttl_s`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

import redis
from redis.exceptions import LockError, LockNotOwnedError

log = logging.getLogger(__name__)

CLAIM_TTL_S = 15.0  # a killed worker's index is free again this long after its last renewal
CLAIM_WAIT_S = 60.0  # how long a replica waits for an index when every one is held


def choose_index(holders: Sequence[str | None], owner: str) -> int | None:
    """The index `owner` should claim, given each index's holder (None: free): the one
    it holds already (a restart), else the lowest free one, else None."""
    if owner in holders:
        return holders.index(owner)
    return next((i for i, holder in enumerate(holders) if holder is None), None)


def default_owner() -> str:
    """This process, as a claim names it: the host name (a container's own) and the pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


class IndexClaim:
    """One process's claim of an index among `count` workers of `section`.

    `acquire()` claims and starts the renewing thread; `release()` stops it and deletes
    the key if it is still this owner's. The thread is the claim's only other user.
    """

    def __init__(self, redis_url: str, namespace: str, section: str, count: int, owner: str | None = None,
                 ttl_s: float = CLAIM_TTL_S, limit_setting: str | None = None) -> None:
        self.section = section
        self.count = count
        self.limit_setting = limit_setting or f"{section}.workers"  # named when every index is held
        self.owner = owner or default_owner()
        self.ttl_s = ttl_s
        self.index: int | None = None
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=ttl_s / 3)
        self._keys = [f"{namespace}:index:{section}:{i}" for i in range(count)]
        self._lock: redis.lock.Lock | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _lock_for(self, index: int) -> redis.lock.Lock:
        return self._redis.lock(self._keys[index], timeout=self.ttl_s, blocking=False, thread_local=False)

    def holders(self) -> list[str | None]:
        return [v.decode() if isinstance(v, bytes) else v for v in self._redis.mget(self._keys)]

    def _take(self, index: int, holder: str | None) -> bool:
        lock = self._lock_for(index)
        if holder == self.owner:  # our own, from before a restart: renew it as ours
            lock.local.token = self.owner.encode()
            try:
                lock.reacquire()
            except LockNotOwnedError:  # lapsed or taken since we read it
                return lock.acquire(token=self.owner)
            return True
        return lock.acquire(token=self.owner)

    def acquire(self, wait_s: float = CLAIM_WAIT_S) -> int:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                holders = self.holders()
                index = choose_index(holders, self.owner)
                claimed = index if index is not None and self._take(index, holders[index]) else None
            except (redis.ConnectionError, redis.TimeoutError) as exc:  # Redis not up yet (containers start together)
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no {self.section} index claimed: Redis unreachable ({exc})") from exc
                log.warning("%s: waiting for Redis to claim an index (%s)", self.section, exc)
                time.sleep(1.0)
                continue
            if claimed is not None:
                self.index = claimed
                lock = self._lock = self._lock_for(claimed)
                lock.local.token = self.owner.encode()
                self._thread = threading.Thread(target=self._renew, args=(lock, claimed),
                                                name=f"index-claim:{self.section}", daemon=True)
                self._thread.start()
                log.info("%s index %d claimed by %s", self.section, claimed, self.owner)
                return claimed
            if time.monotonic() >= deadline:
                held = ", ".join(h or "-" for h in holders)
                raise TimeoutError(f"every {self.section} index 0..{self.count - 1} is held by another worker "
                                   f"({held}); raise {self.limit_setting} to run more")
            # A lapsed claim is announced to no one (a key's expiry), so look again shortly.
            time.sleep(1.0)

    def _renew(self, lock: redis.lock.Lock, index: int) -> None:
        # A periodic timer: the claim's time-to-live needs renewing on time.
        while not self._stop.wait(self.ttl_s / 3):
            try:
                lock.reacquire()
            except LockNotOwnedError:
                # Gone (Redis restarted empty, or this process stalled past the TTL): take it again.
                if not lock.acquire(token=self.owner):
                    log.error("%s index %d is now held by %s: two workers have one index", self.section, index,
                              self.holders()[index])
            except (redis.RedisError, OSError) as exc:
                log.warning("%s index %d: claim not renewed (%s)", self.section, index, exc)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lock is not None:
            try:
                self._lock.release()
            except (LockError, redis.RedisError, OSError) as exc:
                log.warning("%s index %s: claim not released (%s); it lapses in %.0f s", self.section, self.index,
                            exc, self.ttl_s)
        self._redis.close()
