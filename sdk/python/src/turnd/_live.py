"""What a running invocation tells the daemon while its handler works: heartbeats
(``invocation.heartbeat``, sent on their own and on request) and progress frames
(``invocation.progress``, the partial output a handler streams to watchers).

Both answer ``not_found`` once the invocation is no longer current (a stop, a
reconcile, a retry); this module owns what the worker then does: the handler's
``ctx.cancelled`` is set and no more progress is sent for it. Only the daemon that
dispatched the invocation can say so: with several URLs, a ``not_found`` on another
connection (a daemon that never stored it, while the invocation's own connection is
down) ends nothing. Kept apart from the worker's connection and result handling
(``worker.py``, ``_links.py``), which start the heartbeats and hand out the link.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from ._handler import FunctionSpec, TurnContext, _to_json
from .errors import ConnectionLost, NotFound, TooLarge, TurndError

if TYPE_CHECKING:
    from ._links import Link
    from .worker import Worker

log = logging.getLogger("turnd.worker")

# Heartbeats of one invocation sent and not yet answered, at most: as many as one
# attempt timeout holds at three beats per timeout.
_BEATS_IN_FLIGHT = 3


class Live:
    """Heartbeats and progress of one worker's running invocations."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    def no_longer_current(self, ctx: TurnContext) -> None:
        """The daemon answered ``not_found`` for ``ctx``'s invocation: tell its handler."""
        if ctx.stale:
            return
        ctx.stale = True
        running = self._worker._running.get(ctx.invocation_id)
        if running is not None:
            ctx.log.info("invocation no longer current; cancelling its handler")
            self._worker._cancel_running(running)

    # ------------------------------------------------------------------ heartbeats

    def _at_home(self, ctx: TurnContext, link: Link) -> bool:
        """Whether ``link`` reaches the daemon that last pushed about ``ctx``'s invocation."""
        return link.index == self._worker._home(ctx.invocation_id)

    async def heartbeat(self, ctx: TurnContext) -> int:
        link = self._worker._link_for(ctx.invocation_id)
        if link is None:
            raise ConnectionLost("worker not connected")
        try:
            ok = await link.conn.call("invocation.heartbeat", {"invocation_id": ctx.invocation_id})
        except NotFound as e:
            if not self._at_home(ctx, link):
                raise ConnectionLost(
                    f"the daemon that dispatched {ctx.invocation_id} is not connected ({e})"
                ) from e
            self.no_longer_current(ctx)
            raise
        self._worker.stats.heartbeats_sent += 1
        deadline = int(ok.get("deadline_ms", 0)) if isinstance(ok, dict) else 0
        if deadline:
            # Answers of heartbeats in flight together may come in any order.
            ctx.deadline_ms = max(ctx.deadline_ms, deadline)
        return deadline

    async def heartbeat_loop(self, ctx: TurnContext, spec: FunctionSpec) -> None:
        """Renew the deadline at a third of the attempt timeout while the handler runs.

        The beats keep their schedule whatever the answers take: the daemon moves the
        deadline when it takes a heartbeat up, and answers once the move is durable, so a
        slow disk must not also space the heartbeats out (waiting for each answer before
        the next interval would let the deadline pass between two of them). At most
        ``_BEATS_IN_FLIGHT`` go unanswered; a tick finding that many skips its beat."""
        if spec.timeout_ms is not None:
            timeout_s = spec.timeout_ms / 1000
        else:
            # Registered without timeout_ms: the daemon's default applies, seen in the
            # first deadline. A clock far off the daemon's gives nothing usable; then
            # assume the daemon's built-in default (30 s).
            timeout_s = ctx.deadline_ms / 1000 - time.time()
            if timeout_s <= 0.15:
                timeout_s = 30.0
        interval = max(0.05, timeout_s / 3)
        loop = asyncio.get_running_loop()
        beats: set[asyncio.Task[None]] = set()
        ended = False

        async def beat() -> None:
            nonlocal ended
            try:
                await self.heartbeat(ctx)
            except NotFound:
                ended = True
            except TurndError as e:
                ctx.log.debug("heartbeat failed: %s", e)
            except Exception:
                ctx.log.exception("heartbeat failed")

        next_at = loop.time()
        try:
            while not ended:
                next_at = max(next_at + interval, loop.time())
                await asyncio.sleep(next_at - loop.time())
                if not ended and len(beats) < _BEATS_IN_FLIGHT:
                    task = loop.create_task(beat())
                    beats.add(task)
                    task.add_done_callback(beats.discard)
        finally:
            for task in beats:
                task.cancel()
            await asyncio.gather(*beats, return_exceptions=True)

    # ------------------------------------------------------------------ progress

    async def progress(self, ctx: TurnContext, data: Any) -> None:
        """Send one progress frame in call order; its answer is taken when it comes."""
        worker = self._worker
        payload = _to_json(data)
        link = worker._link_for(ctx.invocation_id)
        if ctx.stale or link is None:
            json.dumps(payload, allow_nan=False)  # not JSON is the caller's error, always
            worker.stats.progress_dropped += 1
            return
        args = {"invocation_id": ctx.invocation_id, "data": payload}
        try:
            answer = await asyncio.wait_for(
                link.conn.send("invocation.progress", args), worker.progress_timeout
            )
        except TooLarge as e:  # over max_frame_bytes: measured before sending
            self._refused(ctx, e)
            return
        except (ConnectionLost, asyncio.TimeoutError) as e:
            ctx.log.debug("progress not sent: %s", e or "the connection takes no more")
            worker.stats.progress_dropped += 1
            return
        answer.add_done_callback(functools.partial(self._answered, ctx, self._at_home(ctx, link)))

    def _answered(self, ctx: TurnContext, at_home: bool, answer: asyncio.Future[Any]) -> None:
        if answer.cancelled():
            return
        error = answer.exception()
        if error is None:
            self._worker.stats.progress_sent += 1
            result = answer.result()
            if isinstance(result, dict) and isinstance(result.get("seq"), int):
                ctx.progress_seq = result["seq"]
        elif isinstance(error, NotFound) and at_home:
            self._worker.stats.progress_refused += 1
            self.no_longer_current(ctx)
        elif isinstance(error, (ConnectionLost, NotFound)):
            self._worker.stats.progress_dropped += 1
        else:
            self._refused(ctx, error)

    def _refused(self, ctx: TurnContext, error: BaseException) -> None:
        self._worker.stats.progress_refused += 1
        ctx.log.warning("progress refused: %s", error)
