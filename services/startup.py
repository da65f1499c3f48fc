"""A service's first contact with its metadata store, said in one line.

Compose and Kubernetes may start a service before its Redis answers. Before anything
else, a service started from the command line pings the store: while it does not
answer, the service says so once (the URL, without its password, and the error) and
retries for `deadlines.startup_s`; then it either goes on or exits non-zero with one
more line, instead of ending in a traceback from deep inside its start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

import redis

RETRY_S = 1.0


def shown_url(url: str) -> str:
    """The URL without its password (the embedded Redis's is the cluster token)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = (f"{parts.username}:***@" if parts.username else ":***@") + host + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def wait_for_store(url: str, startup_s: float, say: Callable[[str], None],
                   clock: Callable[[], float] = time.monotonic) -> bool:
    """Whether the Redis at `url` answered a ping within `startup_s` seconds."""
    start = clock()
    warned = False
    while True:
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        try:
            client.ping()
            if warned:
                say(f"Redis at {shown_url(url)} answered after {clock() - start:.0f} s")
            return True
        except (redis.RedisError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            client.close()
        waited = clock() - start
        if waited >= startup_s:
            say(f"giving up: Redis at {shown_url(url)} did not answer in {startup_s:g} s "
                f"(deadlines.startup_s): {error}")
            return False
        if not warned:
            say(f"cannot reach Redis at {shown_url(url)} ({error}); retrying for up to {startup_s:g} s "
                "(deadlines.startup_s)")
            warned = True
        time.sleep(min(RETRY_S, max(0.0, startup_s - waited)))
