/**
 * The operator's questions, typed: `sessions()` with every filter and its pages,
 * `functions()` telling a function nobody serves from a served one, `stats()`.
 */
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import { type Client, type SessionPage, type SubmittedTurn, TurndError, type Worker } from "../src/index.js";
import type { Turnd } from "../src/testing.js";
import { client, daemon, until, worker } from "./helpers.js";

describe("sessions, functions and stats", () => {
  let turnd: Turnd;
  let c: Client;
  let w: Worker;
  let release: () => void = () => {};
  const turns: Record<string, SubmittedTurn> = {};

  before(async () => {
    turnd = await daemon();
    c = await client(turnd.url);
    w = worker(turnd.url);
    // Holds every turn until the test lets them go.
    const gate = new Promise<void>((resolve) => {
      release = resolve;
    });
    w.function("ss.gate", { concurrency: 4, timeoutMs: 60_000 }, async () => {
      await gate;
      return "released";
    });
    await w.start();
    // ss-a and ss-b run (ss-b with a turn queued behind), ss-c waits for a worker
    // of a function nobody serves: stuck.
    turns.a = await c.submit("ss-a", "ss.gate", 1);
    turns.b = await c.submit("ss-b", "ss.gate", 2);
    turns.b2 = await c.submit("ss-b", "ss.gate", 3);
    turns.c = await c.submit("ss-c", "ss.nobody", 4);
    await until("both gates to run", async () => (await c.stats()).invocationsInflight === 2);
  });
  after(async () => {
    release();
    await w.stop(500);
    await c.close();
    await turnd.stop();
  });

  const ids = (page: SessionPage) => page.sessions.map((r) => r.sessionId);

  it("sessions() lists one typed row per session with its holder, total and counts", async () => {
    const page = await c.sessions({ order: "id" });
    assert.deepEqual(ids(page), ["ss-a", "ss-b", "ss-c"]);
    assert.equal(page.next, null);
    assert.equal(page.total, 3);
    assert.deepEqual(page.counts, { awaiting_result: 2, awaiting_worker: 1 });
    const [a, b, stuck] = page.sessions;
    assert.equal(a?.turnId, turns.a?.turnId);
    assert.equal(a?.functionId, "ss.gate");
    assert.equal(a?.step, 0);
    assert.equal(a?.attempt, 1);
    assert.equal(a?.queued, 0);
    assert.equal(a?.stuck, false);
    assert.equal(a?.wait.state, "awaiting_result");
    assert.equal(typeof a?.wait.invocationId, "string");
    assert.equal(a?.wait.workerId, w.workerId);
    assert.ok((a?.lockedSinceMs ?? 0) >= (turns.a?.createdAtMs ?? Number.POSITIVE_INFINITY));
    assert.equal(b?.turnId, turns.b?.turnId);
    assert.equal(b?.queued, 1);
    assert.equal(stuck?.turnId, turns.c?.turnId);
    assert.equal(stuck?.functionId, "ss.nobody");
    assert.equal(stuck?.attempt, 0);
    assert.equal(stuck?.stuck, true);
    assert.equal(stuck?.wait.state, "awaiting_worker");
  });

  it("sessions() filters by stuck, state and function, and orders by wait", async () => {
    const stuck = await c.sessions({ stuck: true });
    assert.deepEqual(ids(stuck), ["ss-c"]);
    assert.equal(stuck.total, 1);
    assert.deepEqual(stuck.counts, { awaiting_worker: 1 });

    const running = await c.sessions({ state: "awaiting_result" });
    // Oldest wait first: ss-a's holder was dispatched before ss-b's.
    assert.deepEqual(ids(running), ["ss-a", "ss-b"]);
    assert.equal(running.total, 2);
    // `counts` ignore the state filter: every state a look could go to next.
    assert.deepEqual(running.counts, { awaiting_result: 2, awaiting_worker: 1 });

    const nobody = await c.sessions({ functionId: "ss.nobody" });
    assert.deepEqual(ids(nobody), ["ss-c"]);
    assert.deepEqual(nobody.counts, { awaiting_worker: 1 });

    const none = await c.sessions({ stuck: true, state: "awaiting_result" });
    assert.deepEqual(ids(none), []);
    assert.equal(none.total, 0);
  });

  it("pages follow next, from the start or from a cursor; a bad cursor is bad_request", async () => {
    const first = await c.sessions({ order: "id", limit: 2 });
    assert.deepEqual(ids(first), ["ss-a", "ss-b"]);
    assert.equal(typeof first.next, "string");
    const second = await c.sessions({ order: "id", limit: 2, after: first.next ?? "" });
    assert.deepEqual(ids(second), ["ss-c"]);
    assert.equal(second.next, null);

    const pages: string[][] = [];
    for await (const page of c.sessionPages({ order: "id", limit: 1 })) pages.push(ids(page));
    assert.deepEqual(pages, [["ss-a"], ["ss-b"], ["ss-c"]]);
    const fromB: string[][] = [];
    for await (const page of c.sessionPages({ order: "id", limit: 1, after: first.next ?? "" })) fromB.push(ids(page));
    assert.deepEqual(fromB, [["ss-c"]]);

    const err = await c.sessions({ after: "not a cursor" }).catch((e: unknown) => e);
    assert.ok(err instanceof TurndError && err.code === "bad_request", String(err));
  });

  it("functions() says which functions a worker registered", async () => {
    const fns = new Map((await c.functions()).map((f) => [f.functionId, f]));
    const served = fns.get("ss.gate");
    assert.equal(served?.registered, true);
    assert.equal(served?.concurrency, 4);
    assert.equal(served?.timeoutMs, 60_000);
    assert.equal(served?.workers, 1);
    const nobody = fns.get("ss.nobody");
    assert.equal(nobody?.registered, false);
    assert.equal(nobody?.workers, 0);
    assert.equal(nobody?.queued, 1);
  });

  it("stats() is typed with camelCase names", async () => {
    const stats = await c.stats();
    assert.deepEqual(Object.keys(stats).sort(), [
      "invocationsInflight",
      "oldestWaitMs",
      "sessions",
      "storage",
      "turns",
      "workersConnected",
    ]);
    assert.deepEqual(stats.sessions, { active: 3, blocked: { awaiting_result: 2, awaiting_worker: 1 } });
    assert.equal(stats.turns.running, 2);
    assert.equal(stats.turns.queued, 2);
    assert.equal(stats.invocationsInflight, 2);
    assert.equal(stats.workersConnected, 1);
    assert.equal(typeof stats.oldestWaitMs, "number");
    assert.deepEqual(stats.storage, { writable: true, lastError: null });
  });
});
