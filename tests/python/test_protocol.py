#!/usr/bin/env python3
"""Protocol tests of the real turnd daemon through an independent Python client.

    python3 tests/python/test_protocol.py --turnd PATH_TO_BINARY [unittest args]

Starts ``PATH serve`` on loopback with ephemeral ports and a temporary data dir,
waits for its ready file, runs the tests (stdlib unittest) and kills the daemon.
The client (turnd_client.py) is written from docs/protocol.md alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from turnd_client import Client, Connection, TurndError, Worker  # noqa: E402

READY_TIMEOUT_S = 20.0
RUN_ID = uuid.uuid4().hex[:8]

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only

TURN_STATUSES = {"queued", "running", "completed", "failed", "cancelled"}


def sid(name: str) -> str:
    """A session id unique to this run."""
    return f"py-{name}-{RUN_ID}"


# --------------------------------------------------------------------------
# the daemon under test


class Daemon:
    def __init__(self, binary: str):
        self.binary = binary
        self.tmp = tempfile.mkdtemp(prefix="turnd-pytest-")
        self.data_dir = os.path.join(self.tmp, "data")
        self.ready_file = os.path.join(self.tmp, "ready.json")
        self.stdout_path = os.path.join(self.tmp, "stdout.log")
        self.stderr_path = os.path.join(self.tmp, "stderr.log")
        self.proc: subprocess.Popen | None = None
        self.ws = ""
        self.admin = ""

    def start(self) -> None:
        cmd = [self.binary, "serve", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
               "--data-dir", self.data_dir, "--ready-file", self.ready_file]
        self._out = open(self.stdout_path, "wb")
        self._err = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._out, stderr=self._err,
                                     cwd=self.tmp)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"turnd exited with {self.proc.returncode} before it was ready\n"
                                   + self.logs())
            try:
                with open(self.ready_file, encoding="utf-8") as f:
                    ready = json.load(f)
                self.ws, self.admin = ready["ws"], ready["admin"]
                return
            except (FileNotFoundError, ValueError, KeyError):
                time.sleep(0.05)  # absent, or not completely written yet
        raise RuntimeError(f"turnd wrote no ready file within {READY_TIMEOUT_S}s: {' '.join(cmd)}\n"
                           + self.logs())

    def logs(self, limit: int = 4000) -> str:
        out = []
        for name, path in (("stdout", self.stdout_path), ("stderr", self.stderr_path)):
            try:
                with open(path, "rb") as f:
                    text = f.read().decode("utf-8", "replace")
            except OSError:
                text = ""
            out.append(f"--- turnd {name} (last {limit} chars) ---\n{text[-limit:]}")
        return "\n".join(out)

    def stop(self) -> None:
        """Kill the daemon (its logs stay until cleanup())."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for f in (getattr(self, "_out", None), getattr(self, "_err", None)):
            if f is not None and not f.closed:
                f.close()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


DAEMON: Daemon | None = None
TURND_BINARY: str | None = None


def setUpModule() -> None:
    global DAEMON
    DAEMON = Daemon(TURND_BINARY)
    try:
        DAEMON.start()
    except Exception:
        DAEMON.cleanup()
        raise


def tearDownModule() -> None:
    if DAEMON is not None:
        DAEMON.stop()


def url() -> str:
    return DAEMON.ws


# --------------------------------------------------------------------------
# handlers


def echo(input, inv):
    return {"complete": input}


def count(input, inv):
    n = input["n"]
    if n < 3:
        return {"continue": {"n": n + 1}}
    return {"complete": input}


def flaky(input, inv):
    if inv.attempt == 1:
        return {"fail": {"code": "flaky", "message": "first attempt always fails", "retryable": True}}
    return {"complete": {"attempt": inv.attempt, "input": input}}


class TurndTestCase(unittest.TestCase):
    worker: Worker
    client: Client

    @classmethod
    def setUpClass(cls) -> None:
        cls.worker = Worker(url(), f"w-py-{cls.__name__}-{RUN_ID}", name="py-test-worker")
        cls.worker.register("py.echo", echo, concurrency=4)
        cls.worker.register("py.count", count, concurrency=4)
        cls.worker.register("py.flaky", flaky, concurrency=2, delivery="at_least_once")
        cls.client = Client(url(), name="py-test-client")

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.worker.close()

    def assertError(self, resp: dict, code: str, rid=...) -> dict:
        self.assertIn("error", resp, f"expected error {code}, got {resp!r}")
        self.assertNotIn("ok", resp)
        err = resp["error"]
        self.assertEqual(err.get("code"), code, resp)
        self.assertIsInstance(err.get("message"), str, resp)
        self.assertIs(err.get("retryable"), False, resp)
        if rid is not ...:
            self.assertIn("id", resp)
            self.assertEqual(resp["id"], rid, resp)
        return err

    def assertTurnShape(self, turn: dict) -> None:
        for key in ("turn_id", "session_id", "seq", "function_id", "status", "step", "attempt",
                    "created_at_ms", "updated_at_ms"):
            self.assertIn(key, turn, turn)
        self.assertIn(turn["status"], TURN_STATUSES, turn)
        self.assertIsInstance(turn["seq"], int, turn)
        if turn["status"] in ("completed", "failed", "cancelled"):
            self.assertIsInstance(turn.get("finished_at_ms"), int, turn)
            self.assertIsNone(turn.get("wait"), turn)
        if turn["status"] == "completed":
            self.assertIn("output", turn, turn)
        if turn["status"] == "failed":
            self.assertIn("cause", turn.get("error") or {}, turn)

    def wait_turn(self, turn_id: str, timeout_ms: int = 10000) -> dict:
        turn = self.client.wait(turn_id, timeout_ms)
        self.assertTurnShape(turn)
        return turn


# --------------------------------------------------------------------------


class T01Transport(TurndTestCase):
    def test_ready_file_and_stdout_line(self):
        self.assertRegex(DAEMON.ws, r"^ws://127\.0\.0\.1:\d+/v1$")
        self.assertRegex(DAEMON.admin, r"^http://127\.0\.0\.1:\d+$")
        want = f"turnd listening on {DAEMON.ws} admin {DAEMON.admin}"
        deadline = time.monotonic() + 3
        text = ""
        while time.monotonic() < deadline:
            with open(DAEMON.stdout_path, "rb") as f:
                text = f.read().decode("utf-8", "replace")
            if want in text:
                break
            time.sleep(0.05)
        self.assertIn(want, text)

    def test_admin_health(self):
        def status(path):
            try:
                with NO_PROXY.open(DAEMON.admin + path, timeout=5) as resp:
                    return resp.status
            except urllib.error.HTTPError as err:
                return err.code
        self.assertEqual(status("/healthz"), 200)
        deadline = time.monotonic() + 5  # ready once recovery has finished
        while status("/readyz") != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(status("/readyz"), 200)
        self.assertEqual(status("/metrics"), 200)

    def test_other_path_is_404(self):
        import websockets.exceptions as wsx
        with self.assertRaises(wsx.InvalidHandshake) as cm:
            Connection(DAEMON.ws.rsplit("/v1", 1)[0] + "/v2")
        response = getattr(cm.exception, "response", None)
        status = getattr(response, "status_code", None) or getattr(cm.exception, "status_code", None)
        self.assertEqual(status, 404, repr(cm.exception))

    def test_hello_shapes(self):
        ok = self.client.hello_result
        self.assertEqual(ok["server"], "turnd")
        for key in ("version", "boot_id", "connection_id"):
            self.assertIsInstance(ok.get(key), str, ok)
        self.assertEqual(ok["heartbeat_ms"], 5000)
        self.assertEqual(ok["max_frame_bytes"], 1048576)
        w = self.worker.hello_result
        self.assertEqual(w["server"], "turnd")
        self.assertEqual(w["boot_id"], ok["boot_id"])
        self.assertNotEqual(w["connection_id"], ok["connection_id"])
        for key in ("kept", "redispatched", "unknown"):
            self.assertEqual(w["reconciled"][key], [], w)
        self.assertEqual(self.client.ping(), {})
        self.assertEqual(self.worker.conn.ping(), {})

    def test_functions_and_workers_list(self):
        funcs = {f["function_id"]: f for f in self.client.request("functions.list")["functions"]}
        echo_f, flaky_f = funcs["py.echo"], funcs["py.flaky"]
        self.assertEqual(echo_f["delivery"], "at_most_once")
        self.assertEqual(echo_f["max_attempts"], 1)
        self.assertEqual(echo_f["concurrency"], 4)
        self.assertEqual(echo_f["workers"], 1)
        self.assertIsInstance(echo_f["timeout_ms"], int)
        self.assertEqual(flaky_f["delivery"], "at_least_once")
        self.assertEqual(flaky_f["max_attempts"], 3)
        workers = {w["worker_id"]: w for w in self.client.request("workers.list")["workers"]}
        me = workers[self.worker.worker_id]
        self.assertIs(me["connected"], True)
        self.assertEqual(me["instance_id"], self.worker.instance_id)
        names = {f if isinstance(f, str) else f.get("function_id") for f in me["functions"]}
        self.assertTrue({"py.echo", "py.count", "py.flaky"} <= names, me)


class T02Turns(TurndTestCase):
    def test_two_sessions_echo_and_multistep(self):
        sa, sb = sid("a"), sid("b")
        plan = [  # interleaved submissions to two sessions
            (sa, "py.echo", {"msg": "a1"}),
            (sb, "py.count", {"n": 1}),
            (sa, "py.count", {"n": 0}),
            (sb, "py.echo", {"msg": "b2", "nested": [1, {"x": None}]}),
            (sa, "py.echo", {"msg": "a3"}),
        ]
        submitted = []
        for session, fn, inp in plan:
            ok = self.client.submit(session, fn, inp)
            self.assertIs(ok["deduplicated"], False, ok)
            turn = ok["turn"]
            self.assertTurnShape(turn)
            self.assertEqual(turn["session_id"], session)
            self.assertEqual(turn["function_id"], fn)
            self.assertEqual(turn["input"], inp)
            self.assertIn(turn["status"], {"queued", "running", "completed"}, turn)
            submitted.append(turn)

        done = [self.wait_turn(t["turn_id"]) for t in submitted]
        for (session, fn, inp), turn in zip(plan, done):
            self.assertEqual(turn["status"], "completed", turn)
            self.assertIs(turn.get("recovered", False), False, turn)
            self.assertEqual(turn["attempt"], 1, turn)
            if fn == "py.echo":
                self.assertEqual(turn["output"], inp)
                self.assertEqual(turn["step"], 0, turn)
            else:
                self.assertEqual(turn["output"], {"n": 3})
                self.assertEqual(turn["step"], 3 - inp["n"], turn)
        a1, b1, a2, b2, a3 = done
        self.assertEqual(a2["step"], 3)

        # per-session seq: increasing in admission order; turn.list newest first
        for session, turns in ((sa, [a1, a2, a3]), (sb, [b1, b2])):
            seqs = [t["seq"] for t in turns]
            self.assertEqual(seqs, sorted(seqs), turns)
            self.assertEqual(len(set(seqs)), len(seqs), turns)
            listed = self.client.list_turns(session)
            self.assertIn("next_before_seq", listed)
            self.assertEqual([t["turn_id"] for t in listed["turns"]],
                             [t["turn_id"] for t in reversed(turns)])
            self.assertEqual([t["seq"] for t in listed["turns"]], list(reversed(seqs)))
            only_done = self.client.list_turns(session, status="completed")["turns"]
            self.assertEqual(len(only_done), len(turns))
            self.assertEqual(self.client.list_turns(session, status="queued")["turns"], [])
            # paging: limit 1, before_seq = next_before_seq until null
            paged, before = [], None
            for _ in range(len(turns) + 2):
                args = {"limit": 1}
                if before is not None:
                    args["before_seq"] = before
                page = self.client.list_turns(session, **args)
                self.assertLessEqual(len(page["turns"]), 1)
                paged += page["turns"]
                before = page["next_before_seq"]
                if before is None or not page["turns"]:
                    break
            self.assertEqual([t["turn_id"] for t in paged], [t["turn_id"] for t in reversed(turns)])

        # the worker saw the steps of each session in FIFO order, one at a time
        for session, turns in ((sa, [a1, a2, a3]), (sb, [b1, b2])):
            invs = sorted((i for i in self.worker.invocations.values() if i.session_id == session),
                          key=lambda i: i.received_at)
            self.assertEqual([i.turn_id for i in invs],
                             [t["turn_id"] for t in turns for _ in range(t["step"] + 1)])
            for t in turns:
                mine = [i for i in invs if i.turn_id == t["turn_id"]]
                self.assertEqual([i.step for i in mine], list(range(t["step"] + 1)))
                self.assertTrue(all(i.attempt == 1 and i.function_id == t["function_id"] for i in mine))
                self.assertIsInstance(mine[0].deadline_ms, int)
            self.assertEqual(invs[0].input, turns[0]["input"])
            self.assertEqual(len({i.invocation_id for i in invs}), len(invs))
            self.assertTrue(self.worker.wait_acked(invs), invs)
            self.assertEqual({i.accepted for i in invs}, {"applied"}, invs)
        count_a = [i for i in self.worker.invocations.values() if i.turn_id == a2["turn_id"]]
        self.assertEqual(sorted(i.input["n"] for i in count_a), [0, 1, 2, 3])

        # session.inspect of an idle session
        for session, turns in ((sa, [a1, a2, a3]), (sb, [b1, b2])):
            s = self.client.inspect(session)
            self.assertEqual(s["session_id"], session)
            self.assertIsNone(s["lock"], s)
            self.assertEqual(s["queued"], [], s)
            self.assertEqual(s["turns"], {"queued": 0, "running": 0, "completed": len(turns),
                                          "failed": 0, "cancelled": 0})
            self.assertIsInstance(s["last_event"], int)

            # session.events: seq 1..N without gaps, per-turn kinds in order
            events = self.client.all_events(session)
            self.assertEqual([e["seq"] for e in events], list(range(1, len(events) + 1)), events)
            self.assertEqual(s["last_event"], len(events))
            self.assertEqual(self.client.all_events(session, page=2), events)
            tail = self.client.events(session, after=len(events))
            self.assertEqual(tail["events"], [])
            self.assertIsInstance(tail["next"], int)
            for e in events:
                for key in ("seq", "session_id", "turn_id", "at_ms", "kind", "detail"):
                    self.assertIn(key, e, e)
                self.assertEqual(e["session_id"], session)
            for t in turns:
                kinds = [e["kind"] for e in events if e["turn_id"] == t["turn_id"]]
                self.assertEqual(kinds[0], "admitted", kinds)
                self.assertEqual(kinds[-1], "completed", kinds)
                self.assertEqual(kinds.count("dispatched"), t["step"] + 1, kinds)
                self.assertEqual(kinds.count("result"), t["step"] + 1, kinds)
                self.assertTrue(is_subsequence(["admitted", "dispatched", "result", "completed"], kinds),
                                kinds)
                if t["function_id"] == "py.echo":
                    self.assertEqual(kinds, ["admitted", "dispatched", "result", "completed"])
            # FIFO in the log: a turn completes before the next one is dispatched
            done_at = {e["turn_id"]: e["seq"] for e in events if e["kind"] == "completed"}
            first_dispatch = {}
            for e in events:
                if e["kind"] == "dispatched":
                    first_dispatch.setdefault(e["turn_id"], e["seq"])
            for prev, nxt in zip(turns, turns[1:]):
                self.assertLess(done_at[prev["turn_id"]], first_dispatch[nxt["turn_id"]])

        # turn.get agrees with turn.wait
        self.assertEqual(self.client.get(a2["turn_id"])["output"], {"n": 3})

    def test_idempotency(self):
        session = sid("idem")
        key = f"msg-{RUN_ID}"
        first = self.client.submit(session, "py.echo", {"v": 1}, idempotency_key=key)
        self.assertIs(first["deduplicated"], False)
        again = self.client.submit(session, "py.echo", {"v": 1}, idempotency_key=key)
        self.assertIs(again["deduplicated"], True, again)
        self.assertEqual(again["turn"]["turn_id"], first["turn"]["turn_id"])
        done = self.wait_turn(first["turn"]["turn_id"])
        self.assertEqual(done["status"], "completed")
        after = self.client.submit(session, "py.echo", {"v": 1}, idempotency_key=key)
        self.assertIs(after["deduplicated"], True, after)
        self.assertEqual(after["turn"]["turn_id"], first["turn"]["turn_id"])
        for args in ({"function_id": "py.echo", "input": {"v": 2}},
                     {"function_id": "py.count", "input": {"v": 1}}):
            resp = self.client.call("turn.submit", dict(args, session_id=session, idempotency_key=key))
            self.assertError(resp, "conflict")
        # the same key in another session is another turn
        other = self.client.submit(sid("idem2"), "py.echo", {"v": 1}, idempotency_key=key)
        self.assertIs(other["deduplicated"], False)
        self.assertNotEqual(other["turn"]["turn_id"], first["turn"]["turn_id"])
        self.assertEqual(self.wait_turn(other["turn"]["turn_id"])["status"], "completed")
        self.assertEqual(len(self.client.list_turns(session)["turns"]), 1)

    def test_retryable_failure_is_retried(self):
        session = sid("flaky")
        ok = self.client.submit(session, "py.flaky", {"k": "v"})
        turn = self.wait_turn(ok["turn"]["turn_id"])
        self.assertEqual(turn["status"], "completed", turn)
        self.assertEqual(turn["attempt"], 2, turn)
        self.assertEqual(turn["step"], 0, turn)
        self.assertEqual(turn["output"], {"attempt": 2, "input": {"k": "v"}})
        invs = self.worker.invocations_for(turn["turn_id"])
        self.assertEqual([(i.step, i.attempt) for i in invs], [(0, 1), (0, 2)], invs)
        self.assertNotEqual(invs[0].invocation_id, invs[1].invocation_id)
        self.assertTrue(self.worker.wait_acked(invs), invs)
        self.assertEqual([i.accepted for i in invs], ["applied", "applied"])
        kinds = [e["kind"] for e in self.client.all_events(session)]
        self.assertEqual(kinds[0], "admitted")
        self.assertEqual(kinds[-1], "completed")
        self.assertIn("retry_scheduled", kinds)
        self.assertEqual(kinds.count("result"), 2, kinds)
        self.assertTrue(is_subsequence(["admitted", "dispatched", "result", "retry_scheduled",
                                        "result", "completed"], kinds), kinds)


    def test_watch_session_events(self):
        session = sid("watch")
        # a first turn makes the session exist (watching an unknown session may be not_found)
        first = self.client.submit(session, "py.echo", {"w": 0})["turn"]["turn_id"]
        self.assertEqual(self.wait_turn(first)["status"], "completed")
        before = self.client.all_events(session)
        watcher = Client(url(), name="py-watcher")
        self.addCleanup(watcher.close)
        watch_id = watcher.request("watch", {"session_id": session})["watch_id"]
        self.assertIsInstance(watch_id, str)
        turn_id = self.client.submit(session, "py.echo", {"w": 1})["turn"]["turn_id"]
        self.assertEqual(self.wait_turn(turn_id)["status"], "completed")
        got = []
        while not got or got[-1]["kind"] != "completed":
            push = watcher.next_push(timeout=5)
            self.assertEqual(push["push"], "event", push)
            self.assertEqual(push["watch_id"], watch_id)
            got.append(push["event"])
        self.assertEqual([e["kind"] for e in got], ["admitted", "dispatched", "result", "completed"])
        self.assertEqual(got, self.client.all_events(session)[len(before):])
        self.assertEqual({e["turn_id"] for e in got}, {turn_id})
        self.assertEqual(got[0]["seq"], before[-1]["seq"] + 1)
        self.assertEqual(watcher.request("unwatch", {"watch_id": watch_id}), {})
        self.assertError(watcher.call("unwatch", {"watch_id": watch_id}), "not_found")

    def test_stop_turn_waiting_for_a_worker(self):
        session = sid("stop")
        blocked = self.client.submit(session, "py.nobody-serves-this", {"x": 1})["turn"]
        behind = self.client.submit(session, "py.echo", {"x": 2})["turn"]
        # turn.wait returns the turn as it is when timeout_ms passes
        t1 = self.client.wait(blocked["turn_id"], timeout_ms=300)
        self.assertNotIn(t1["status"], ("completed", "failed", "cancelled"), t1)
        self.assertEqual(t1["wait"]["state"], "awaiting_worker", t1)
        self.assertIsInstance(t1["wait"]["reason"], str)
        t2 = self.client.wait(behind["turn_id"], timeout_ms=100)
        self.assertEqual(t2["status"], "queued", t2)
        self.assertEqual(t2["wait"]["state"], "queued_behind", t2)
        s = self.client.inspect(session)
        self.assertEqual(s["lock"]["turn_id"], blocked["turn_id"], s)
        self.assertEqual(s["lock"]["wait"]["state"], "awaiting_worker", s)
        self.assertIn(behind["turn_id"], [q["turn_id"] for q in s["queued"]], s)

        stopped = self.client.stop(blocked["turn_id"], reason="py test stop")
        self.assertEqual(stopped["stop"]["reason"], "py test stop", stopped)
        t1 = self.wait_turn(blocked["turn_id"])
        self.assertEqual(t1["status"], "cancelled", t1)
        self.assertEqual(t1["stop"]["reason"], "py test stop")
        t2 = self.wait_turn(behind["turn_id"])
        self.assertEqual(t2["status"], "completed", t2)
        self.assertEqual(t2["output"], {"x": 2})
        # stopping a terminal turn changes nothing
        self.assertEqual(self.client.stop(t2["turn_id"])["status"], "completed")
        kinds = [e["kind"] for e in self.client.all_events(session) if e["turn_id"] == blocked["turn_id"]]
        self.assertEqual(kinds[0], "admitted")
        self.assertIn("stop_requested", kinds)
        self.assertEqual(kinds[-1], "cancelled")
        self.assertNotIn("dispatched", kinds)


    def test_sessions_list_pages_the_sessions_waiting_for_a_function(self):
        fn = sid("fn.nobody")
        names = sorted(sid(f"list-{i}") for i in range(3))
        turns = [self.client.submit(n, fn, {"n": i})["turn"] for i, n in enumerate(names)]
        args = {"function_id": fn, "state": "awaiting_worker", "order": "id", "limit": 2}
        first = self.client.request("sessions.list", args)
        self.assertEqual(first["total"], 3, first)
        self.assertEqual(first["counts"], {"awaiting_worker": 3}, first)
        self.assertEqual([r["session_id"] for r in first["sessions"]], names[:2], first)
        self.assertIsNotNone(first["next"], first)
        rest = self.client.request("sessions.list", dict(args, after=first["next"]))
        self.assertEqual([r["session_id"] for r in rest["sessions"]], names[2:], rest)
        self.assertIsNone(rest["next"], rest)
        row = first["sessions"][0]
        self.assertEqual(row["turn_id"], turns[0]["turn_id"], row)
        self.assertEqual(row["function_id"], fn, row)
        self.assertEqual((row["attempt"], row["queued"]), (0, 0), row)
        self.assertEqual(row["wait"]["state"], "awaiting_worker", row)
        self.assertTrue(row["stuck"], row)  # no connected worker serves fn
        # oldest wait first is the default order
        by_wait = self.client.request("sessions.list", {"function_id": fn})["sessions"]
        since = [r["wait"]["since_ms"] for r in by_wait]
        self.assertEqual(since, sorted(since), by_wait)
        for bad in ({"limit": 0}, {"after": "nonsense"}, {"state": "asleep"}):
            with self.assertRaises(TurndError) as cm:
                self.client.request("sessions.list", bad)
            self.assertEqual(cm.exception.code, "bad_request", bad)
        for t in turns:
            self.client.stop(t["turn_id"], reason="py test done")
        self.assertEqual(self.client.request("sessions.list", {"function_id": fn})["total"], 0)


class T03Errors(TurndTestCase):
    def fresh(self) -> Connection:
        conn = Connection(url())
        self.addCleanup(conn.close)
        return conn

    def test_op_before_hello(self):
        conn = self.fresh()
        resp = conn.call("turn.get", {"turn_id": "t_nothing"})
        self.assertError(resp, "not_authenticated")
        resp = conn.call("ping")
        self.assertError(resp, "not_authenticated")
        # the request was refused, not the connection: hello still works
        self.assertEqual(conn.hello("client")["server"], "turnd")

    def test_unsupported_protocol(self):
        conn = self.fresh()
        resp = conn.call("hello", {"protocol": 2, "role": "client", "token": "x"})
        self.assertError(resp, "unsupported_protocol")

    def test_second_hello_is_conflict(self):
        conn = self.fresh()
        conn.hello("client")
        resp = conn.call("hello", {"protocol": 1, "role": "client", "token": "x"})
        self.assertError(resp, "conflict")
        self.assertEqual(conn.ping(), {})

    def test_unknown_op_not_found_bad_request(self):
        conn = self.fresh()
        conn.hello("client")
        self.assertError(conn.call("no.such.op", {}), "unknown_op")
        self.assertError(conn.call("turn.get", {"turn_id": "t_does_not_exist"}), "not_found")
        self.assertError(conn.call("session.inspect", {}), "bad_request")
        self.assertError(conn.call("turn.get", {}), "bad_request")
        self.assertError(conn.call("turn.get", {"turn_id": 42}), "bad_request")
        self.assertError(conn.call("turn.submit", {"function_id": "py.echo", "input": {}}), "bad_request")
        # args may be omitted (means {}): a missing required field, not a bad frame
        self.assertError(conn.call("turn.get", omit_args=True), "bad_request")
        self.assertEqual(conn.call("ping", omit_args=True).get("ok"), {})

    def test_bad_frames(self):
        conn = self.fresh()
        conn.hello("client")
        conn.send_raw("{not json")
        self.assertError(conn.next_stray(), "bad_frame", None)
        conn.send_raw("[1, 2, 3]")
        self.assertError(conn.next_stray(), "bad_frame", None)
        conn.send_raw(json.dumps({"op": "ping"}))
        self.assertError(conn.next_stray(), "bad_frame", None)
        conn.send_raw(json.dumps({"id": 900001, "args": {}}))  # id readable, op missing
        self.assertError(conn.next_stray(), "bad_frame", 900001)
        conn.send_raw(json.dumps({"id": 900002, "op": 7}))
        self.assertError(conn.next_stray(), "bad_frame", 900002)
        conn.send_raw(b'{"id": 900003, "op": "ping"}')  # binary frame
        resp = conn.next_stray()
        self.assertEqual(resp["error"]["code"], "bad_frame", resp)
        self.assertIn(resp.get("id", None), (None, 900003), resp)
        # the connection stays open and usable
        self.assertEqual(conn.ping(), {})

    def test_sixteen_bad_frames_close_1008(self):
        conn = self.fresh()
        conn.hello("client")
        try:
            for _ in range(16):
                conn.send_raw("not json at all")
        except Exception:
            pass  # the server may close while we are still sending
        self.assertTrue(conn.wait_closed(5), "connection not closed after 16 bad frames in a row")
        self.assertEqual(conn.close_code, 1008)

    def test_too_large_frame_closes_1009(self):
        conn = Connection(url(), compression=None)  # the frame must really be over 1 MiB
        self.addCleanup(conn.close)
        conn.hello("client")
        big = json.dumps({"id": 900010, "op": "ping", "args": {"pad": "x" * (1024 * 1024 + 16)}})
        try:
            conn.send_raw(big)
        except Exception:
            pass
        self.assertTrue(conn.wait_closed(5), "connection not closed after an oversized frame")
        self.assertEqual(conn.close_code, 1009)
        while not conn.stray.empty():
            resp = conn.stray.get()
            self.assertEqual(resp["error"]["code"], "too_large", resp)

    def test_worker_may_not_submit(self):
        w = Worker(url(), f"w-forbidden-{RUN_ID}")
        self.addCleanup(w.close)
        resp = w.conn.call("turn.submit", {"session_id": sid("forbidden"), "function_id": "py.echo",
                                           "input": {}})
        self.assertError(resp, "forbidden")
        self.assertError(w.conn.call("store.check"), "forbidden")
        self.assertEqual(w.conn.ping(), {})
        # nothing was admitted (a session that never had a turn may also be not_found)
        resp = self.client.call("turn.list", {"session_id": sid("forbidden")})
        if "error" in resp:
            self.assertError(resp, "not_found")
        else:
            self.assertEqual(resp["ok"]["turns"], [])

    def test_client_may_not_use_worker_ops(self):
        resp = self.client.call("function.register", {"function_id": "py.nope"})
        self.assertError(resp, "forbidden")
        resp = self.client.call("store.check")
        self.assertError(resp, "forbidden")

    def test_operator_store_check_is_clean(self):
        op = Client(url(), role="operator", name="py-operator")
        self.addCleanup(op.close)
        self.assertEqual(op.request("store.check")["violations"], [])
        stats = op.request("stats")["stats"]
        for key in ("sessions", "turns", "invocations_inflight", "workers_connected", "storage"):
            self.assertIn(key, stats, stats)
        self.assertGreaterEqual(stats["workers_connected"], 1)
        self.assertIs(stats["storage"]["writable"], True)


def is_subsequence(needle, haystack) -> bool:
    it = iter(haystack)
    return all(any(x == y for y in it) for x in needle)


# --------------------------------------------------------------------------


def main() -> int:
    global TURND_BINARY
    parser = argparse.ArgumentParser(
        description="Protocol tests of the real turnd daemon through an independent Python client "
                    "(written from docs/protocol.md). Starts the daemon on loopback with "
                    "ephemeral ports and a temporary data dir, runs the tests, kills it.",
        epilog="Arguments after the known ones go to unittest, e.g. "
               "'T02Turns.test_idempotency' or '-k idem -v'.")
    parser.add_argument("--turnd", default=os.environ.get("TURND_BIN"),
                        help="path to the turnd binary (default: $TURND_BIN)")
    args, rest = parser.parse_known_args()
    if not args.turnd:
        parser.error("--turnd PATH_TO_BINARY is required (or set TURND_BIN)")
    if not (os.path.isfile(args.turnd) and os.access(args.turnd, os.X_OK)):
        parser.error(f"not an executable file: {args.turnd}")
    TURND_BINARY = os.path.abspath(args.turnd)

    # make sure the daemon dies with us on SIGTERM/SIGINT
    def on_signal(signum, frame):
        if DAEMON is not None:
            DAEMON.cleanup()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)

    # a watchdog: the whole run is meant to take well under a minute
    def watchdog():
        time.sleep(120)
        sys.stderr.write("test_protocol.py: watchdog: still running after 120 s, giving up\n")
        if DAEMON is not None:
            sys.stderr.write(DAEMON.logs() + "\n")
            DAEMON.cleanup()
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()

    failed = False
    try:
        prog = unittest.main(module=__name__, argv=[sys.argv[0]] + rest, exit=False,
                             verbosity=2, failfast=False)
        result = prog.result
        bad = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
        skipped = len(result.skipped)
        passed = max(0, result.testsRun - bad - skipped)
        failed = bad > 0 or result.testsRun == 0
        if failed and DAEMON is not None:
            if DAEMON.proc is not None and DAEMON.proc.returncode not in (None, -signal.SIGKILL):
                sys.stderr.write(f"turnd exited by itself with status {DAEMON.proc.returncode}\n")
            sys.stderr.write(DAEMON.logs() + "\n")
        line = f"{passed} passed, {bad} failed"
        if skipped:
            line += f", {skipped} skipped"
        print(line)
    finally:
        if DAEMON is not None:
            DAEMON.cleanup()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
