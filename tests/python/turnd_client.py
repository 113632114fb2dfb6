"""A small, independent client for the turnd wire protocol, version 1.

Written only from the wire contract (docs/protocol.md) so that it keeps the
protocol honest: if this client cannot drive the real daemon, either the daemon
or the document is wrong.

Pieces:

* ``Connection`` -- one WebSocket to ``/v1``. Requests get increasing ids and are
  matched to responses by id by a background reader thread, so many requests can
  be outstanding at once (the server may answer out of order). Pushes (frames
  with a ``push`` field) go to ``Connection.pushes`` (a ``queue.Queue``) or to a
  push handler; responses whose ``id`` is null or matches nothing outstanding go
  to ``Connection.stray``.
* ``Client`` -- a ``Connection`` with helpers for the client ops.
* ``Worker`` -- a worker connection: ``hello`` with ``worker_id``/``instance_id``,
  ``function.register`` with a Python callable, runs ``invoke`` pushes and reports
  ``invocation.result`` (resent until acknowledged), answers ``probe`` with
  ``invocation.status`` and ``cancel`` with a result.

Only the ``websockets`` package (sync client) is needed.
"""

from __future__ import annotations

import inspect
import itertools
import json
import queue
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as _ws_connect

PROTOCOL_VERSION = 1

#: error codes the contract marks as retryable
RETRYABLE_CODES = frozenset({"rate_limited", "unavailable", "shutting_down", "internal"})


class TurndError(Exception):
    """An error response: ``{"id": n, "error": {"code", "message", "retryable"}}``."""

    def __init__(self, op: str, error: Dict[str, Any], frame: Dict[str, Any]):
        self.op = op
        self.code = error.get("code")
        self.message = error.get("message")
        self.retryable = error.get("retryable")
        self.error = error
        self.frame = frame
        super().__init__(f"{op}: {self.code}: {self.message} (retryable={self.retryable})")


class ConnectionLost(Exception):
    """The WebSocket closed while a request was outstanding (or before it was sent)."""

    def __init__(self, code: Optional[int] = None, reason: str = ""):
        self.code = code
        self.reason = reason
        super().__init__(f"connection closed (code={code}, reason={reason!r})")


class _Pending:
    __slots__ = ("event", "frame", "rid")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.frame: Optional[Dict[str, Any]] = None
        self.rid: Optional[int] = None


def _connect_kwargs() -> Dict[str, Any]:
    kwargs: Dict[str, Any] = {"open_timeout": 10, "close_timeout": 5, "max_size": 64 * 1024 * 1024}
    params = inspect.signature(_ws_connect).parameters
    if "proxy" in params:  # websockets >= 15 honours proxy env vars by default
        kwargs["proxy"] = None
    if "legacy" in params:  # websockets >= 17: keep the connection open outside a with-block
        kwargs["legacy"] = True
    return kwargs


class Connection:
    """One WebSocket connection to turnd (path ``/v1``)."""

    def __init__(self, url: str, *, push_handler: Optional[Callable[[Dict[str, Any]], None]] = None,
                 default_timeout: float = 15.0, **ws_kwargs: Any):
        """``ws_kwargs`` go to ``websockets.sync.client.connect`` (e.g. ``compression=None``)."""
        self.url = url
        self.default_timeout = default_timeout
        self.ws = _ws_connect(url, **dict(_connect_kwargs(), **ws_kwargs))
        self.pushes: "queue.Queue[Dict[str, Any]]" = queue.Queue()
        self.stray: "queue.Queue[Dict[str, Any]]" = queue.Queue()
        self.push_handler = push_handler
        self.hello_result: Optional[Dict[str, Any]] = None
        self.close_code: Optional[int] = None
        self.close_reason: str = ""
        self.closed = threading.Event()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._pending: Dict[int, _Pending] = {}
        self._reader = threading.Thread(target=self._read_loop, name="turnd-reader", daemon=True)
        self._reader.start()

    # -- reading ---------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while True:
                raw = self.ws.recv()
                try:
                    frame = json.loads(raw)
                except ValueError:
                    self.stray.put({"_unparsable": raw})
                    continue
                if not isinstance(frame, dict):
                    self.stray.put({"_not_object": frame})
                elif "push" in frame:
                    handler = self.push_handler
                    if handler is not None:
                        try:
                            handler(frame)
                        except Exception as exc:  # a handler bug must not kill the reader
                            self.stray.put({"_push_handler_error": repr(exc), "push_frame": frame})
                    else:
                        self.pushes.put(frame)
                else:
                    fid = frame.get("id")
                    with self._lock:
                        slot = self._pending.pop(fid, None) if isinstance(fid, int) else None
                    if slot is None:
                        self.stray.put(frame)
                    else:
                        slot.frame = frame
                        slot.event.set()
        except ConnectionClosed as exc:
            rcvd = getattr(exc, "rcvd", None)
            self.close_code = getattr(rcvd, "code", None)
            self.close_reason = getattr(rcvd, "reason", "") or ""
        except Exception as exc:  # socket errors etc.
            self.close_reason = repr(exc)
        finally:
            self.closed.set()
            with self._lock:
                pending, self._pending = self._pending, {}
            for slot in pending.values():
                slot.event.set()  # frame stays None -> ConnectionLost

    # -- sending ---------------------------------------------------------

    def next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def send_raw(self, data: "str | bytes") -> None:
        """Send one frame as is (text for ``str``, binary for ``bytes``)."""
        with self._send_lock:
            self.ws.send(data)

    def send_request(self, op: Optional[str], args: Optional[Dict[str, Any]] = None, *,
                     omit_args: bool = False, frame: Optional[Dict[str, Any]] = None) -> "_Pending":
        """Send a request without waiting; the returned slot's ``event`` is set when its
        response (``slot.frame``) arrives or the connection closes (``slot.frame`` None)."""
        rid = self.next_id()
        if frame is None:
            frame = {"op": op}
            if not omit_args:
                frame["args"] = {} if args is None else args
        frame = dict(frame, id=rid)
        slot = _Pending()
        with self._lock:
            if self.closed.is_set():
                raise ConnectionLost(self.close_code, self.close_reason)
            self._pending[rid] = slot
        try:
            self.send_raw(json.dumps(frame))
        except ConnectionClosed as exc:
            with self._lock:
                self._pending.pop(rid, None)
            raise ConnectionLost(self.close_code, self.close_reason or str(exc)) from exc
        slot.rid = rid
        return slot

    def call(self, op: Optional[str], args: Optional[Dict[str, Any]] = None, *,
             timeout: Optional[float] = None, omit_args: bool = False,
             frame: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Send a request and return the whole response frame (``ok`` or ``error``).

        ``frame`` lets a test send an arbitrary object; its ``id`` is set here.
        """
        slot = self.send_request(op, args, omit_args=omit_args, frame=frame)
        if not slot.event.wait(self.default_timeout if timeout is None else timeout):
            with self._lock:
                self._pending.pop(slot.rid, None)
            raise TimeoutError(f"no response to {op!r} (id {slot.rid}) in time")
        if slot.frame is None:
            raise ConnectionLost(self.close_code, self.close_reason)
        return slot.frame

    def request(self, op: str, args: Optional[Dict[str, Any]] = None, *,
                timeout: Optional[float] = None) -> Dict[str, Any]:
        """Send a request; return its ``ok`` object or raise ``TurndError``."""
        resp = self.call(op, args, timeout=timeout)
        if "error" in resp:
            err = resp["error"] if isinstance(resp["error"], dict) else {"code": None, "message": resp["error"]}
            raise TurndError(op, err, resp)
        if "ok" not in resp:
            raise ValueError(f"{op}: response has neither ok nor error: {resp!r}")
        return resp["ok"]

    def hello(self, role: str, *, token: str = "turnd-python-test", name: Optional[str] = None,
              protocol: int = PROTOCOL_VERSION, **extra: Any) -> Dict[str, Any]:
        args: Dict[str, Any] = {"protocol": protocol, "role": role, "token": token}
        if name is not None:
            args["name"] = name
        args.update(extra)
        ok = self.request("hello", args)
        self.hello_result = ok
        return ok

    def ping(self) -> Dict[str, Any]:
        return self.request("ping")

    # -- helpers ---------------------------------------------------------

    def next_push(self, timeout: float = 5.0) -> Dict[str, Any]:
        return self.pushes.get(timeout=timeout)

    def next_stray(self, timeout: float = 5.0) -> Dict[str, Any]:
        return self.stray.get(timeout=timeout)

    def wait_closed(self, timeout: float = 5.0) -> bool:
        return self.closed.wait(timeout)

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:
            pass
        self._reader.join(timeout=5)

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Client(Connection):
    """A connection in the ``client`` role (or ``operator`` with ``role=``)."""

    def __init__(self, url: str, *, token: str = "turnd-python-test", name: str = "py-client",
                 role: str = "client", **kw: Any):
        super().__init__(url, **kw)
        self.hello(role, token=token, name=name)

    def submit(self, session_id: str, function_id: str, input: Any, **extra: Any) -> Dict[str, Any]:
        args = {"session_id": session_id, "function_id": function_id, "input": input}
        args.update(extra)
        return self.request("turn.submit", args)

    def get(self, turn_id: str) -> Dict[str, Any]:
        return self.request("turn.get", {"turn_id": turn_id})["turn"]

    def wait(self, turn_id: str, timeout_ms: int = 10000) -> Dict[str, Any]:
        ok = self.request("turn.wait", {"turn_id": turn_id, "timeout_ms": timeout_ms},
                          timeout=timeout_ms / 1000.0 + 10)
        return ok["turn"]

    def stop(self, turn_id: str, reason: str = "stopped by test") -> Dict[str, Any]:
        return self.request("turn.stop", {"turn_id": turn_id, "reason": reason})["turn"]

    def list_turns(self, session_id: str, **extra: Any) -> Dict[str, Any]:
        return self.request("turn.list", dict({"session_id": session_id}, **extra))

    def inspect(self, session_id: str) -> Dict[str, Any]:
        return self.request("session.inspect", {"session_id": session_id})["session"]

    def events(self, session_id: str, **extra: Any) -> Dict[str, Any]:
        return self.request("session.events", dict({"session_id": session_id}, **extra))

    def all_events(self, session_id: str, page: Optional[int] = None) -> List[Dict[str, Any]]:
        """Every event of a session, paging with ``after`` = last seq seen."""
        out: List[Dict[str, Any]] = []
        after: Optional[int] = None
        for _ in range(10000):
            args: Dict[str, Any] = {}
            if after is not None:
                args["after"] = after
            if page is not None:
                args["limit"] = page
            evs = self.events(session_id, **args)["events"]
            if not evs:
                break
            out.extend(evs)
            after = evs[-1]["seq"]
        return out


# --------------------------------------------------------------------------
# Worker


TERMINAL_OUTCOMES = ("complete", "continue", "fail", "cancelled")


class Invocation:
    """One ``invoke`` push as seen by the worker, plus what became of it.

    Handlers receive it as their second argument: ``handler(input, inv)``.
    ``inv.cancelled`` is set when a ``cancel`` push arrived; a cooperative handler
    checks it and returns early (its outcome is then ignored: ``cancelled`` was
    already reported).
    """

    def __init__(self, worker: "Worker", push: Dict[str, Any]):
        self.worker = worker
        self.push = push
        self.invocation_id: str = push.get("invocation_id")
        self.function_id: str = push.get("function_id")
        self.session_id: str = push.get("session_id")
        self.turn_id: str = push.get("turn_id")
        self.step: int = push.get("step")
        self.attempt: int = push.get("attempt")
        self.input: Any = push.get("input")
        self.deadline_ms: Optional[int] = push.get("deadline_ms")
        self.received_at = time.time()
        self.cancelled = threading.Event()
        self.cancel_reason: Optional[str] = None
        self.state = "running"  # running -> finished (result held) -> acked
        self.outcome: Optional[Dict[str, Any]] = None
        self.discarded_outcome: Optional[Dict[str, Any]] = None
        self.accepted: Optional[str] = None  # the server's "accepted" value
        self.result_error: Optional[TurndError] = None
        self.acked = threading.Event()
        self.lock = threading.Lock()
        self.sending = False

    def heartbeat(self) -> Dict[str, Any]:
        return self.worker.conn.request("invocation.heartbeat", {"invocation_id": self.invocation_id})

    def __repr__(self) -> str:
        return (f"Invocation({self.invocation_id} {self.function_id} {self.session_id}/{self.turn_id} "
                f"step={self.step} attempt={self.attempt} state={self.state} accepted={self.accepted})")


Handler = Callable[[Any, Invocation], Dict[str, Any]]


class Worker:
    """A worker: registers functions and runs the invocations pushed to it.

    A handler is ``handler(input, invocation) -> outcome`` where the outcome is one of
    ``{"complete": value}``, ``{"continue": state}``,
    ``{"fail": {"code", "message", "retryable"}}`` or ``{"cancelled": {"message"}}``.
    An exception in a handler is reported as a non-retryable ``fail``.
    """

    def __init__(self, url: str, worker_id: str, *, instance_id: Optional[str] = None,
                 token: str = "turnd-python-test", name: Optional[str] = None,
                 result_ack_timeout: float = 2.0,
                 inflight: Optional[List[str]] = None, finished: Optional[List[str]] = None):
        self.url = url
        self.worker_id = worker_id
        self.instance_id = instance_id or uuid.uuid4().hex
        self.result_ack_timeout = result_ack_timeout
        self.handlers: Dict[str, Handler] = {}
        self.invocations: Dict[str, Invocation] = {}
        self.log: List[Dict[str, Any]] = []  # every push received, in order
        self.errors: List[str] = []  # anything that went wrong in background threads
        self._lock = threading.Lock()
        self._closing = False
        self.conn = Connection(url, push_handler=self._on_push)
        self.hello_result = self.conn.hello(
            "worker", token=token, name=name or worker_id, worker_id=worker_id,
            instance_id=self.instance_id, inflight=list(inflight or []), finished=list(finished or []))

    # -- registration ----------------------------------------------------

    def register(self, function_id: str, handler: Handler, **settings: Any) -> Dict[str, Any]:
        """``function.register``; ``settings`` are concurrency, timeout_ms, delivery, max_attempts."""
        self.handlers[function_id] = handler
        args = {"function_id": function_id}
        args.update(settings)
        return self.conn.request("function.register", args)

    def unregister(self, function_id: str) -> Dict[str, Any]:
        ok = self.conn.request("function.unregister", {"function_id": function_id})
        self.handlers.pop(function_id, None)
        return ok

    # -- pushes (called on the reader thread: never block here) -----------

    def _on_push(self, frame: Dict[str, Any]) -> None:
        with self._lock:
            self.log.append(frame)
        kind = frame.get("push")
        if kind == "invoke":
            inv = Invocation(self, frame)
            with self._lock:
                known = self.invocations.get(inv.invocation_id)
                if known is None:
                    self.invocations[inv.invocation_id] = inv
            if known is not None:
                # the same invocation pushed twice: never run it twice; resend a held result
                self._spawn(self._send_result, known)
                return
            self._spawn(self._run, inv)
        elif kind == "probe":
            self._spawn(self._answer_probe, frame.get("invocation_id"))
        elif kind == "cancel":
            self._spawn(self._answer_cancel, frame.get("invocation_id"), frame.get("reason"))
        else:
            self._note(f"unexpected push: {frame!r}")

    def _spawn(self, fn: Callable[..., None], *args: Any) -> None:
        threading.Thread(target=fn, args=args, daemon=True, name=f"turnd-worker-{fn.__name__}").start()

    def _note(self, msg: str) -> None:
        with self._lock:
            self.errors.append(msg)

    def _run(self, inv: Invocation) -> None:
        handler = self.handlers.get(inv.function_id)
        if handler is None:
            outcome: Dict[str, Any] = {"fail": {"code": "not_registered", "retryable": False,
                                                "message": f"worker has no handler for {inv.function_id}"}}
        else:
            try:
                outcome = handler(inv.input, inv)
                if not (isinstance(outcome, dict) and len(outcome) == 1
                        and next(iter(outcome)) in TERMINAL_OUTCOMES):
                    raise ValueError(f"handler returned an invalid outcome: {outcome!r}")
            except Exception as exc:
                outcome = {"fail": {"code": "handler_exception", "message": repr(exc), "retryable": False}}
        with inv.lock:
            if inv.outcome is not None:  # a cancel already answered for it
                inv.discarded_outcome = outcome
                return
            inv.outcome = outcome
            inv.state = "finished"
        self._send_result(inv)

    def _send_result(self, inv: Invocation) -> None:
        """Send ``invocation.result``, resending the same result every
        ``result_ack_timeout`` s until one of the sends is acknowledged. A late
        acknowledgement of an earlier send counts, so a slow ``applied`` is not
        mistaken for the ``duplicate`` that answers the resend."""
        with inv.lock:
            if inv.sending or inv.outcome is None:
                return
            inv.sending = True
            outcome = inv.outcome
        args = {"invocation_id": inv.invocation_id, "outcome": outcome}
        slots: List[Any] = []
        try:
            while not self._closing and not self.conn.closed.is_set():
                try:
                    slots.append(self.conn.send_request("invocation.result", args))
                except ConnectionLost:
                    return
                deadline = time.monotonic() + self.result_ack_timeout
                while time.monotonic() < deadline:
                    answered = [sl.frame for sl in slots if sl.event.is_set()]
                    if any(f is None for f in answered):
                        return  # connection lost
                    oks = [f["ok"] for f in answered if isinstance(f.get("ok"), dict)]
                    if oks:
                        accepted = [o.get("accepted") for o in oks]
                        with inv.lock:  # a resend after an "applied" must not hide it
                            if inv.accepted != "applied":
                                inv.accepted = "applied" if "applied" in accepted else accepted[0]
                            inv.state = "acked"
                        inv.acked.set()
                        return
                    errors = [f.get("error") or {} for f in answered]
                    if errors and not all(e.get("retryable") for e in errors):
                        frame = next(f for f in answered if not (f.get("error") or {}).get("retryable"))
                        inv.result_error = TurndError("invocation.result", frame.get("error") or {}, frame)
                        self._note(f"invocation.result for {inv.invocation_id} refused: {inv.result_error}")
                        return
                    if errors:  # retryable refusal (unavailable, ...): resend after a pause
                        slots = [sl for sl in slots if not sl.event.is_set()]
                        time.sleep(0.2)
                        break
                    time.sleep(0.01)
                # no acknowledgement in time: resend the same result
        finally:
            with inv.lock:
                inv.sending = False

    def _answer_probe(self, invocation_id: str) -> None:
        with self._lock:
            inv = self.invocations.get(invocation_id)
        if inv is None:
            state = "unknown"
        else:
            with inv.lock:
                state = "running" if inv.outcome is None else "finished"
        try:
            self.conn.request("invocation.status", {"invocation_id": invocation_id, "state": state})
        except (TurndError, ConnectionLost, TimeoutError) as exc:
            self._note(f"invocation.status for {invocation_id} failed: {exc}")
        if state == "finished":
            self._send_result(inv)  # "finished": it has a result and is resending it

    def _answer_cancel(self, invocation_id: str, reason: Optional[str]) -> None:
        with self._lock:
            inv = self.invocations.get(invocation_id)
        if inv is None:
            # never received here: nothing runs, say so as cancelled
            try:
                self.conn.request("invocation.result", {"invocation_id": invocation_id,
                                  "outcome": {"cancelled": {"message": "not running on this worker"}}})
            except (TurndError, ConnectionLost, TimeoutError) as exc:
                self._note(f"cancel answer for unknown {invocation_id} failed: {exc}")
            return
        with inv.lock:
            inv.cancel_reason = reason
            inv.cancelled.set()
            if inv.outcome is None:  # still running: stop it, report cancelled
                inv.outcome = {"cancelled": {"message": f"cancelled: {reason}"}}
                inv.state = "finished"
        self._send_result(inv)  # cancelled, or the real outcome if it had finished

    # -- helpers ---------------------------------------------------------

    def invocations_for(self, turn_id: str) -> List[Invocation]:
        with self._lock:
            invs = [i for i in self.invocations.values() if i.turn_id == turn_id]
        return sorted(invs, key=lambda i: (i.step, i.attempt, i.received_at))

    def wait_acked(self, invs: List[Invocation], timeout: float = 5.0) -> bool:
        end = time.time() + timeout
        return all(i.acked.wait(max(0.0, end - time.time())) for i in invs)

    def close(self) -> None:
        self._closing = True
        self.conn.close()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
