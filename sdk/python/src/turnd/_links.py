"""A worker's connections: one per URL (a cluster's nodes each get one), and which of
them an invocation's own requests go on.

A cluster node dispatches only the turns of the partitions it leads, to the workers
attached to it, so a worker keeps a connection to every node, with one ``worker_id``
and one ``instance_id``. Each connection's loop connects, says ``hello`` listing every
invocation the worker runs or holds a result of (its tables are one, ``worker.py``),
registers every function and reconnects with backoff until the worker stops.

An invocation's requests (its result, heartbeats, progress) go on the connection of
its *home*, the URL whose daemon last pushed about it, while that connection is up,
else on any live one (a cluster node forwards them to the partition's leader).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._connection import CLOSE_SUPERSEDED, PROTOCOL_VERSION, Connection
from .errors import BadEndpoint, ConnectionLost, ProtocolError, TurndError, WorkerSuperseded
from .types import Reconciled

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("turnd.worker")


@dataclass
class Link:
    """A connection the worker serves on (hello and registrations done)."""

    index: int
    """The index of its URL in ``worker.urls``."""
    generation: int
    """Unique among all the worker's connections."""
    conn: Connection


class Links:
    """The live connections of one serving worker, by the index of their URL."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self.live: dict[int, Link] = {}
        self.changed = asyncio.Condition()
        self._generations = 0

    @property
    def all_up(self) -> bool:
        return len(self.live) == len(self._worker.urls)

    def pick(self, home: int | None, skip: Container[int] = ()) -> Link | None:
        """``home``'s connection when it is up, else any live one; none whose
        generation is in ``skip``."""
        link = self.live.get(home) if home is not None else None
        if link is not None and link.generation not in skip:
            return link
        return next((lk for lk in self.live.values() if lk.generation not in skip), None)

    async def wait(self, home: Callable[[], int | None], skip: Container[int]) -> Link:
        """Wait for a connection :meth:`pick` would give."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.pick(home(), skip) is not None)
        link = self.pick(home(), skip)
        assert link is not None
        return link

    async def _set(self, index: int, link: Link | None) -> None:
        if link is None:
            self.live.pop(index, None)
        else:
            self.live[index] = link
        self._worker._refresh_state()
        async with self.changed:
            self.changed.notify_all()

    async def supervise(self) -> None:
        """Run every URL's connection loop until the worker stops."""
        loops = [
            asyncio.ensure_future(self._loop(index, url))
            for index, url in enumerate(self._worker.urls)
        ]
        try:
            ended = await asyncio.gather(*loops, return_exceptions=True)
        finally:
            for loop in loops:
                loop.cancel()
        for error in ended:
            if isinstance(error, BaseException):
                raise error

    async def close(self) -> None:
        live, self.live = list(self.live.values()), {}
        for link in live:
            await link.conn.close()

    async def _loop(self, index: int, url: str) -> None:
        """One URL's connection: connect, serve, reconnect with backoff, until stopped."""
        w = self._worker
        assert w._stopping is not None
        delay = w.reconnect_delay
        while not w._stopping.is_set():
            w._refresh_state(trying=True)
            conn = await w._until_stopped(self._connect(index, url))
            if isinstance(conn, Connection):
                delay = w.reconnect_delay
                self._generations += 1
                w.stats.connections += 1
                log.info(
                    "worker %s connected to %s (generation %d)", w.worker_id, url, self._generations
                )
                await self._set(index, Link(index, self._generations, conn))
                await w._until_stopped(conn.closed.wait())
                await self._set(index, None)
                if w._stopping.is_set():
                    await conn.close()
                    return
                if conn.close_code == CLOSE_SUPERSEDED:
                    log.error("worker %s superseded by another connection", w.worker_id)
                    w.stop()  # every other connection ends too
                    raise WorkerSuperseded(
                        f"another connection took worker_id {w.worker_id} (close 4001)"
                    )
                log.warning(
                    "worker %s lost its connection to %s (close %s); reconnecting",
                    w.worker_id,
                    url,
                    conn.close_code,
                )
            w._refresh_state()
            # Equal jitter: half the delay fixed, half random.
            await w._until_stopped(asyncio.sleep(delay / 2 + random.uniform(0, delay / 2)))
            delay = min(delay * 2, w.reconnect_max_delay)

    async def _connect(self, index: int, url: str) -> Connection | None:
        w = self._worker
        hello: dict[str, Any] = {
            "protocol": PROTOCOL_VERSION,
            "role": "worker",
            "worker_id": w.worker_id,
            "name": w.name,
            "instance_id": w.instance_id,
            # Every invocation of the worker's, whichever connection it came on.
            "inflight": sorted(w._running),
            "finished": sorted(w._held),
        }
        if w.token is not None:
            hello["token"] = w.token
        try:
            conn = await Connection.open(
                url, hello, lambda conn, frame: w._on_push(index, conn, frame)
            )
        except (BadEndpoint, ProtocolError) as e:
            if e.retryable:
                log.warning("worker %s: hello failed: %s", w.worker_id, e)
                return None
            # A wrong URL or a refused token fails the same way on every attempt.
            log.error("worker %s cannot serve: %s", w.worker_id, e)
            w._fatal = e
            w.stop()
            return None
        except (ConnectionLost, OSError, asyncio.TimeoutError) as e:
            log.warning("worker %s: cannot connect: %s", w.worker_id, e)
            return None
        w.reconciled = Reconciled.from_wire(conn.hello.get("reconciled"))
        if w.reconciled.redispatched or w.reconciled.unknown:
            log.info(
                "%s reconciled worker %s: kept %s, redispatched %s, unknown %s",
                url,
                w.worker_id,
                w.reconciled.kept,
                w.reconciled.redispatched,
                w.reconciled.unknown,
            )
        if not await self._register(conn):
            return None
        # Results held across the reconnect are resent now (the daemon kept them
        # waiting for that, "finished" in hello).
        for held in w._held.values():
            held.resend_now.set()
        return conn

    async def _register(self, conn: Connection) -> bool:
        """Register every function (none while draining); False closes ``conn``."""
        w = self._worker
        try:
            # A draining worker reconnects only to report and deliver what it holds.
            specs = [] if w._draining else w._functions.values()
            for spec in sorted(specs, key=lambda s: s.function_id):
                await conn.call("function.register", spec.register_args())
        except ProtocolError as e:
            await conn.close()
            if not e.retryable:
                # The same registration would be refused again on every reconnect.
                log.error("worker %s: the daemon refused a registration: %s", w.worker_id, e)
                w._fatal = e
                w.stop()
                return False
            log.warning("worker %s: registering failed: %s", w.worker_id, e)
            return False
        except TurndError as e:
            log.warning("worker %s: registering failed: %s", w.worker_id, e)
            await conn.close()
            return False
        return True
