/** Client behaviour against the real daemon: every op, typed errors, idempotency, watch resume. */
import assert from "node:assert/strict";
import { Socket } from "node:net";
import { after, before, describe, it } from "node:test";
import { type Client, ConnectionError, connect, type Event, TurndError, type Worker } from "../src/index.js";
import type { Turnd } from "../src/testing.js";
import { allEvents, client, daemon, FrameProxy, sleep, until, worker } from "./helpers.js";

describe("client", () => {
  let turnd: Turnd;
  let c: Client;
  let w: Worker;
  let release: () => void = () => {};

  before(async () => {
    turnd = await daemon();
    c = await client(turnd.url);
    w = worker(turnd.url);
    w.function("cl.echo", { concurrency: 4 }, async (_ctx, input) => input);
    // Holds each turn until the test lets it go.
    w.function("cl.gate", { concurrency: 4 }, async (ctx) => {
      await new Promise<void>((resolve) => {
        const prev = release;
        release = () => {
          prev();
          resolve();
        };
        ctx.signal.addEventListener("abort", () => resolve());
      });
      if (ctx.signal.aborted) throw new Error("stopped");
      return "released";
    });
    await w.start();
  });
  after(async () => {
    release();
    await w.stop(200);
    await c.close();
    await turnd.stop();
  });

  it("submits idempotently: the same key returns the same turn, other input is a conflict", async () => {
    const first = await c.submit("idem-1", "cl.echo", { a: 1 }, { idempotencyKey: "k-1" });
    assert.equal(first.deduplicated, false);
    const again = await c.submit("idem-1", "cl.echo", { a: 1 }, { idempotencyKey: "k-1" });
    assert.equal(again.deduplicated, true);
    assert.equal(again.turnId, first.turnId);
    const err = await c.submit("idem-1", "cl.echo", { a: 2 }, { idempotencyKey: "k-1" }).catch((e: unknown) => e);
    assert.ok(err instanceof TurndError);
    assert.equal(err.code, "conflict");
    assert.equal(err.retryable, false);
    assert.equal(err.op, "turn.submit");
    const page = await c.list("idem-1");
    assert.equal(page.turns.length, 1);
  });

  it("sends the frames of one tick in one write to its socket", async () => {
    // Every write a TCP socket of this process makes while 40 submits are sent at
    // once (to a function no worker serves, so that no worker answers meanwhile);
    // the test runner's own output goes to a pipe.
    const proto = Socket.prototype as unknown as Record<"_write" | "_writev", (...a: unknown[]) => unknown>;
    const [write, writev] = [proto._write, proto._writev];
    let writes = 0;
    const count = (socket: Socket) => {
      if (socket.remotePort !== undefined) writes += 1;
    };
    proto._write = function (this: Socket, ...a: unknown[]) {
      count(this);
      return write.apply(this, a);
    };
    proto._writev = function (this: Socket, ...a: unknown[]) {
      count(this);
      return writev.apply(this, a);
    };
    let turns: { turnId: string }[];
    try {
      turns = await Promise.all(
        Array.from({ length: 40 }, (_, i) => c.submit(`cl-tick-${process.pid}-${i}`, "cl.nobody", { i })),
      );
    } finally {
      proto._write = write;
      proto._writev = writev;
    }
    assert.equal(new Set(turns.map((t) => t.turnId)).size, 40);
    // One for the 40 frames; a heartbeat's ping may add one.
    assert.ok(writes <= 2, `${writes} writes for 40 frames sent in one tick`);
  });

  it("surfaces the daemon's errors as TurndError with code and retryable", async () => {
    const cases: Array<[() => Promise<unknown>, string]> = [
      [() => c.get("t_0000000000000000000000000000000"), "not_found"],
      [() => c.inspect("never-used-session"), "not_found"],
      [() => c.submit("", "cl.echo"), "bad_request"],
      [() => c.list("s", { limit: 0 }), "bad_request"],
      [() => c.request("no.such.op"), "unknown_op"],
      [() => c.request("function.register", { function_id: "x" }), "forbidden"],
    ];
    for (const [call, code] of cases) {
      const err = await call().catch((e: unknown) => e);
      assert.ok(err instanceof TurndError, `expected a TurndError for ${code}, got ${String(err)}`);
      assert.equal(err.code, code);
      assert.equal(err.retryable, false);
    }
    const big = "x".repeat(600_000);
    const tooLarge = await c.submit("big", "cl.echo", big).catch((e: unknown) => e);
    assert.ok(tooLarge instanceof TurndError && tooLarge.code === "too_large");
    // Over the frame limit the daemon would close the connection; the client refuses
    // it itself, and a keyed submit is not resent in a loop.
    const connection = c.hello?.connectionId;
    const huge = await c
      .submit("big", "cl.echo", "x".repeat(2_000_000), { idempotencyKey: "huge" })
      .catch((e: unknown) => e);
    assert.ok(huge instanceof TurndError && huge.code === "too_large", String(huge));
    await c.ping();
    assert.equal(c.hello?.connectionId, connection);
  });

  it("a refused hello rejects connect() with the daemon's error", async () => {
    const own = await (await import("../src/testing.js")).startTurnd({
      env: { TURND_AUTH__TOKENS: '[{ role = "client", token = "client-token" }]' },
    });
    try {
      const err = await connect({ url: own.url, token: "nope-nope" }).catch((e: unknown) => e);
      assert.ok(err instanceof TurndError && err.code === "not_authenticated");
      const ok = await connect({ url: own.url, token: "client-token" });
      await ok.ping();
      await ok.close();
    } finally {
      await own.stop();
    }
  });

  it("connect() to nothing fails with a ConnectionError", async () => {
    const err = await connect({ url: "ws://127.0.0.1:1/v1", reconnectTimeoutMs: 200 }).catch((e: unknown) => e);
    assert.ok(err instanceof ConnectionError);
    assert.equal(err.retryable, true);
  });

  it("lists, inspects, reads events, waits with a timeout and stops a session", async () => {
    const a = await c.submit("ops-1", "cl.gate", 1);
    const b = await c.submit("ops-1", "cl.gate", 2);
    await until("the first turn to run", async () => (await c.get(a.turnId)).status === "running");
    const session = await c.inspect("ops-1");
    assert.equal(session.lock?.turnId, a.turnId);
    assert.equal(session.lock?.wait.state, "awaiting_result");
    assert.deepEqual(
      session.queued.map((q) => q.turnId),
      [b.turnId],
    );
    assert.equal(session.turns.running, 1);
    const waited = await c.wait(b.turnId, { timeoutMs: 50 });
    assert.equal(waited.status, "queued");
    assert.equal(waited.wait?.state, "queued_behind");
    assert.equal(waited.wait?.ahead, 1);
    const page = await c.list("ops-1", { limit: 1 });
    assert.deepEqual(
      page.turns.map((t) => t.turnId),
      [b.turnId],
    );
    assert.equal(page.nextBeforeSeq, b.seq);
    const older = await c.list("ops-1", { beforeSeq: page.nextBeforeSeq ?? 0 });
    assert.deepEqual(
      older.turns.map((t) => t.turnId),
      [a.turnId],
    );
    const events = await c.events("ops-1", { after: 0, limit: 2 });
    assert.deepEqual(
      events.events.map((e) => e.seq),
      [1, 2],
    );
    assert.equal(events.next, 2);
    const stopped = await c.stopSession("ops-1", "closing the session");
    assert.deepEqual(stopped.map((t) => t.turnId).sort(), [a.turnId, b.turnId].sort());
    const done = await c.wait(a.turnId, { timeoutMs: 5000 });
    assert.equal(done.status, "cancelled");
    assert.equal(done.stop?.reason, "closing the session");
    assert.equal((await c.get(b.turnId)).status, "cancelled");
    const workers = await c.workers();
    assert.ok(workers.some((x) => x.workerId === w.workerId && x.connected));
  });

  it("watch resumes after a reconnect without gaps or duplicates", { timeout: 15_000 }, async () => {
    const proxy = await FrameProxy.start(turnd.url);
    const wc = await client(proxy.url);
    const seen: Event[] = [];
    try {
      const first = await c.submit("watch-1", "cl.echo", 0);
      await c.wait(first.turnId);
      // Start from the beginning: the replay comes first, then live events.
      const stream = await wc.watch({ sessionId: "watch-1" }, { after: 0 });
      const reader = (async () => {
        for await (const e of stream) {
          seen.push(e);
          if (seen.length >= 16) break;
        }
      })();
      await until("the replay", () => seen.length >= 4);
      // Cut the watcher's connection and keep it away while turns run.
      proxy.refuse = true;
      proxy.cut();
      for (let i = 1; i <= 3; i++) await c.wait((await c.submit("watch-1", "cl.echo", i)).turnId);
      await sleep(100);
      proxy.refuse = false;
      await reader;
      assert.equal(proxy.hellos().length >= 2, true);
      // Two watch requests: the first from 0, the second from the last event seen.
      const watches = proxy.sentToServer.filter((f) => f.op === "watch").map((f) => f.args as { after: number });
      assert.equal(watches[0]?.after, 0);
      assert.ok(watches.length >= 2 && (watches[1]?.after ?? 0) >= 4);
    } finally {
      await wc.close();
      await proxy.close();
    }
    const expected = await allEvents(c, "watch-1");
    assert.equal(expected.length, 16);
    assert.deepEqual(
      seen.slice(0, 16).map((e) => [e.seq, e.kind]),
      expected.map((e) => [e.seq, e.kind]),
    );
  });

  it("watch of a turn delivers only that turn's events, new ones by default", async () => {
    const gated = await c.submit("watch-2", "cl.gate", null);
    await until("the turn to run", async () => (await c.get(gated.turnId)).status === "running");
    const stream = await c.watch({ turnId: gated.turnId });
    const other = await c.submit("watch-2", "cl.echo", "behind");
    release();
    const kinds: string[] = [];
    for await (const e of stream) {
      assert.equal(e.turnId, gated.turnId);
      kinds.push(e.kind);
      if (e.kind === "completed") break;
    }
    assert.deepEqual(kinds, ["result", "completed"]);
    assert.equal((await c.wait(other.turnId)).status, "completed");
  });

  it("requests sent while disconnected go out on the next connection", async () => {
    const proxy = await FrameProxy.start(turnd.url);
    const rc = await client(proxy.url);
    try {
      const t = await rc.submit("reconnect-1", "cl.echo", "x", { idempotencyKey: "rk" });
      proxy.cut();
      const got = await rc.wait(t.turnId);
      assert.equal(got.status, "completed");
      assert.equal(proxy.hellos().length, 2);
      // A submit without a key is not resent: it might have been admitted.
      let keylessDrops = 1;
      proxy.toServer = (f) => {
        if (f.op === "turn.submit" && keylessDrops > 0) {
          keylessDrops -= 1;
          setImmediate(() => proxy.cut());
          return true;
        }
        return false;
      };
      const err = await rc.submit("reconnect-1", "cl.echo", "y").catch((e: unknown) => e);
      assert.ok(err instanceof ConnectionError, `expected a ConnectionError, got ${String(err)}`);
      // With a key it is resent, and the daemon deduplicates.
      let drops = 1;
      proxy.toServer = (f) => {
        if (f.op === "turn.submit" && drops > 0) {
          drops -= 1;
          setImmediate(() => proxy.cut());
          return true;
        }
        return false;
      };
      const keyed = await rc.submit("reconnect-1", "cl.echo", "z", { idempotencyKey: "rk-2" });
      assert.equal(keyed.deduplicated, false);
      assert.equal((await rc.list("reconnect-1")).turns.length, 2);
    } finally {
      await rc.close();
      await proxy.close();
    }
  });

  it("a submit without a key cut by a close other than 1001 is not sent again", async () => {
    // Only a 1001 says the daemon read no request it did not answer; after a 1011
    // (outcome unknown) the unanswered submit may have been admitted.
    const proxy = await FrameProxy.start(turnd.url);
    const rc = await client(proxy.url);
    try {
      // The submit's answer is lost, and the connection closed with 1011.
      let drops = 1;
      proxy.toClient = (f) => {
        if (drops === 0 || typeof f.ok !== "object" || f.ok === null || !("turn" in f.ok)) return false;
        drops -= 1;
        setImmediate(() => proxy.cut(1011));
        return true;
      };
      const err = await rc.submit("cut-1011", "cl.echo", "once").catch((e: unknown) => e);
      assert.ok(
        err instanceof ConnectionError && /code 1011/.test(err.message),
        `got ${err instanceof Error ? err.message : JSON.stringify(err)}`,
      );
      assert.equal(proxy.hellos().length, 1);
      assert.equal((await c.list("cut-1011")).turns.length, 1); // admitted once
    } finally {
      await rc.close();
      await proxy.close();
    }
  });
});
