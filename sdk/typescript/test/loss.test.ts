/**
 * The loss rules of docs/semantics.md, played out through the real daemon: frames
 * dropped by a proxy, connections cut, the daemon killed mid-turn.
 */
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import type { Client, Reconciled, Worker } from "../src/index.js";
import type { Turnd } from "../src/testing.js";
import { startTurnd } from "../src/testing.js";
import { allEvents, client, daemon, dropFirst, FAST, FrameProxy, SHORT_HEARTBEAT, sleep, until, worker } from "./helpers.js";

describe("loss", () => {
  let turnd: Turnd;
  let c: Client;
  const cleanups: Array<() => Promise<void>> = [];

  before(async () => {
    turnd = await daemon();
    c = await client(turnd.url);
  });
  after(async () => {
    for (const f of cleanups.reverse()) await f();
    await c.close();
    await turnd.stop();
  });

  async function proxied(): Promise<FrameProxy> {
    const proxy = await FrameProxy.start(turnd.url);
    cleanups.push(() => proxy.close());
    return proxy;
  }

  async function started(w: Worker): Promise<Worker> {
    cleanups.push(() => w.stop(200));
    await w.start();
    return w;
  }

  it("resends a result whose frame was lost, and it is applied", async () => {
    const proxy = await proxied();
    proxy.toServer = dropFirst((f) => f.op === "invocation.result");
    // Resent after 400 ms without an answer: once for the lost frame, and again each
    // time a stall delays the daemon's answer past 400 ms (answered as a duplicate).
    const w = worker(proxy.url, { resultAckTimeoutMs: 400 });
    w.function("lost.result", async (_ctx, input) => ({ echo: input }));
    await started(w);
    const submitted = await c.submit("lost-result", "lost.result", 7);
    const turn = await c.wait(submitted.turnId, { timeoutMs: 5000 });
    assert.equal(turn.status, "completed");
    assert.deepEqual(turn.output, { echo: 7 });
    await until("the result to be acknowledged", () => w.finished.length === 0);
    assert.equal(w.stats.resultsAcked, 1);
    // The first frame was lost; every frame the daemon got was a resend.
    assert.equal(proxy.dropped.filter((f) => f.op === "invocation.result").length, 1);
    assert.ok(w.stats.resultsResent >= 1, "the lost result was never resent");
    const passed = () => proxy.sentToServer.filter((f) => f.op === "invocation.result");
    await until("every resend to pass the proxy", () => passed().length === w.stats.resultsResent);
    const resends = passed();
    // Applied exactly once: one of the resends, and any other a duplicate.
    const answers = () => resends.map((r) => proxy.sentToClient.find((f) => f.id === r.id));
    await until("every resend to be answered", () => answers().every((a) => a !== undefined));
    const accepted = answers()
      .map((a) => (a?.ok as { accepted?: string } | undefined)?.accepted)
      .sort();
    const duplicates = Array.from({ length: resends.length - 1 }, () => "duplicate");
    assert.deepEqual(accepted, ["applied", ...duplicates].sort());
    const results = (await allEvents(c, "lost-result")).filter((e) => e.kind === "result");
    assert.equal(results.length, 1);
  });

  it("a lost dispatch is probed, answered unknown and dispatched again", async () => {
    const proxy = await proxied();
    proxy.toClient = dropFirst((f) => f.push === "invoke");
    const w = worker(proxy.url);
    const ran: string[] = [];
    w.function("lost.dispatch", { timeoutMs: 300 }, async (ctx) => {
      ran.push(ctx.invocationId);
      return "ran";
    });
    await started(w);
    const submitted = await c.submit("lost-dispatch", "lost.dispatch", null);
    const turn = await c.wait(submitted.turnId, { timeoutMs: 5000 });
    assert.equal(turn.status, "completed");
    assert.equal(turn.attempt, 1);
    const dropped = proxy.dropped.find((f) => f.push === "invoke");
    assert.ok(dropped);
    const status = proxy.sentToServer.find((f) => f.op === "invocation.status");
    assert.deepEqual(status?.args, { invocation_id: dropped.invocation_id, state: "unknown" });
    const events = await allEvents(c, "lost-dispatch");
    const redispatched = events.find((e) => e.kind === "redispatched");
    assert.equal(redispatched?.detail.previous_invocation_id, dropped.invocation_id);
    assert.equal(ran.length, 1);
    assert.notEqual(ran[0], dropped.invocation_id);
  });

  it("a probe for a running handler is answered by a heartbeat, so the step is not cancelled", async () => {
    const proxy = await proxied();
    // Heartbeats are lost until the daemon probes: the deadline passes.
    let probed = false;
    proxy.toClient = (f) => {
      if (f.push === "probe") probed = true;
      return false;
    };
    proxy.toServer = (f) => f.op === "invocation.heartbeat" && !probed;
    const w = worker(proxy.url);
    // The probe comes 3 s after the dispatch; the handler ends 2 s later, while the
    // heartbeats (every second from the probe on) keep the deadline 3 s ahead: a stall
    // under 2 s neither lets the result overtake the probe nor brings a second probe.
    w.function("probe.alive", { timeoutMs: 3000 }, async (ctx) => {
      await sleep(5000);
      return { aborted: ctx.signal.aborted };
    });
    await started(w);
    const submitted = await c.submit("probe-alive", "probe.alive", null);
    const turn = await c.wait(submitted.turnId, { timeoutMs: 20_000 });
    assert.equal(turn.status, "completed");
    assert.deepEqual(turn.output, { aborted: false });
    const kinds = (await allEvents(c, "probe-alive")).map((e) => e.kind);
    assert.deepEqual(kinds, ["admitted", "dispatched", "probe_sent", "result", "completed"]);
    assert.equal(proxy.sentToServer.filter((f) => f.op === "invocation.status").length, 0);
    // The probe was answered, by a heartbeat (the only ones let through came after it):
    // the result alone, coming within probe_timeout_ms, would give the same events.
    assert.ok(proxy.sentToServer.some((f) => f.op === "invocation.heartbeat"), "no heartbeat answered the probe");
  });

  it("reconnects with the running invocation in inflight, and it is kept", async () => {
    const proxy = await proxied();
    let release!: () => void;
    const gate = new Promise<void>((r) => {
      release = r;
    });
    const w = worker(proxy.url);
    const reconciled: Reconciled[] = [];
    w.on("reconciled", (r: Reconciled) => reconciled.push(r));
    w.function("rc.inflight", { timeoutMs: 10_000 }, async () => {
      await gate;
      return "kept";
    });
    await started(w);
    const submitted = await c.submit("rc-inflight", "rc.inflight", null);
    const inv = await until("the handler to start", () => w.inflight[0]);
    proxy.cut();
    await until("the worker to reconnect", () => w.stats.connections === 2 && w.state === "connected");
    const hello = proxy.hellos()[1]?.args as Record<string, unknown>;
    assert.deepEqual(hello.inflight, [inv]);
    assert.deepEqual(hello.finished, []);
    assert.equal(hello.instance_id, w.instanceId);
    assert.deepEqual(reconciled.at(-1), { kept: [inv], redispatched: [], unknown: [] });
    release();
    const turn = await c.wait(submitted.turnId, { timeoutMs: 5000 });
    assert.equal(turn.status, "completed");
    assert.equal(turn.output, "kept");
    const kinds = (await allEvents(c, "rc-inflight")).map((e) => e.kind);
    assert.deepEqual(kinds, ["admitted", "dispatched", "result", "completed"]);
  });

  it("a silent (half-open) connection is noticed by its silence and replaced", async () => {
    // A daemon of its own, with a heartbeat short enough for the silence to be
    // noticed in a test (FAST's is the daemon's default, 5 s).
    const own = await daemon(SHORT_HEARTBEAT);
    cleanups.push(() => own.stop());
    const oc = await client(own.url);
    cleanups.push(() => oc.close());
    const proxy = await FrameProxy.start(own.url);
    cleanups.push(() => proxy.close());
    let release!: () => void;
    const gate = new Promise<void>((r) => {
      release = r;
    });
    const w = worker(proxy.url);
    w.function("rc.silent", { timeoutMs: 10_000 }, async () => {
      await gate;
      return "heard";
    });
    await started(w);
    const submitted = await oc.submit("rc-silent", "rc.silent", null);
    const inv = await until("the handler to start", () => w.inflight[0]);
    const before = Date.now();
    proxy.stall();
    // heartbeat_ms is 500: three intervals of silence end the connection on both sides.
    await until("the worker to reconnect", () => w.stats.connections === 2 && w.state === "connected", 10_000);
    const silentFor = Date.now() - before;
    assert.ok(silentFor >= 1400, `reconnected after ${silentFor} ms of silence`);
    assert.deepEqual(w.reconciled, { kept: [inv], redispatched: [], unknown: [] });
    release();
    const turn = await oc.wait(submitted.turnId, { timeoutMs: 5000 });
    assert.equal(turn.output, "heard");
  });

  it("reconnects with an unacknowledged result in finished, and resends it", async () => {
    const proxy = await proxied();
    // Every result is lost until the connection is cut.
    proxy.toServer = (f) => f.op === "invocation.result";
    const w = worker(proxy.url, { resultAckTimeoutMs: 5000 });
    w.function("rc.finished", async () => "held");
    await started(w);
    const submitted = await c.submit("rc-finished", "rc.finished", null);
    const inv = await until("the result to be held", () => w.finished[0]);
    await until("the result to be sent once", () => proxy.dropped.length === 1);
    proxy.toServer = () => false;
    proxy.cut();
    const turn = await c.wait(submitted.turnId, { timeoutMs: 5000 });
    assert.equal(turn.status, "completed");
    assert.equal(turn.output, "held");
    const hello = proxy.hellos()[1]?.args as Record<string, unknown>;
    assert.deepEqual(hello.inflight, []);
    assert.deepEqual(hello.finished, [inv]);
    assert.deepEqual(w.reconciled, { kept: [inv], redispatched: [], unknown: [] });
    await until("the result to be acknowledged", () => w.finished.length === 0);
  });

  it("a worker that comes back as a new instance gets its invocation reconciled as unknown", async () => {
    const proxy = await proxied();
    const first = worker(proxy.url, { instanceId: "instance-a" });
    let started1 = false;
    first.function("rc.restart", { delivery: "at_least_once", timeoutMs: 10_000 }, async (ctx) => {
      started1 = true;
      await new Promise((r) => ctx.signal.addEventListener("abort", r));
      throw new Error("aborted");
    });
    await started(first);
    const submitted = await c.submit("rc-restart", "rc.restart", null);
    await until("the handler to start", () => started1);
    // The process "restarts": the old worker is gone without a word, a new instance
    // with the same worker id says hello.
    proxy.refuse = true;
    proxy.cut();
    await first.stop(0);
    const second = worker(turnd.url, { workerId: first.workerId, instanceId: "instance-b" });
    second.function("rc.restart", { delivery: "at_least_once", timeoutMs: 10_000 }, async (ctx) => ({
      attempt: ctx.attempt,
    }));
    await started(second);
    assert.equal(second.reconciled?.unknown.length, 1);
    const turn = await c.wait(submitted.turnId, { timeoutMs: 5000 });
    assert.equal(turn.status, "completed");
    assert.deepEqual(turn.output, { attempt: 2 });
    const kinds = (await allEvents(c, "rc-restart")).map((e) => e.kind);
    assert.ok(kinds.includes("outcome_unknown"), kinds.join(","));
  });

  it("a worker stopped while disconnected does not register again when it reconnects to drain", async () => {
    const proxy = await proxied();
    let release!: () => void;
    const gate = new Promise<void>((r) => {
      release = r;
    });
    const w = worker(proxy.url);
    w.function("drain.offline", { concurrency: 2 }, async () => {
      await gate;
      return "delivered";
    });
    await started(w);
    const submitted = await c.submit("drain-offline-1", "drain.offline", null);
    await until("the handler to start", () => w.inflight.length === 1);
    proxy.refuse = true;
    proxy.cut();
    await until("the worker to notice", () => w.state === "disconnected");
    const stopped = w.stop(5000);
    proxy.refuse = false;
    release();
    await stopped;
    assert.equal((await c.get(submitted.turnId)).output, "delivered");
    const registers = proxy.sentToServer.filter((f) => f.op === "function.register");
    assert.equal(registers.length, 1);
    assert.equal(proxy.hellos().length, 2);
  });

  it("survives a daemon restart mid-turn: reconnects, keeps the invocation, delivers the result", async () => {
    // A daemon of its own: this test kills it.
    const own = await startTurnd({ config: FAST });
    cleanups.push(() => own.stop());
    const oc = await client(own.url);
    cleanups.push(() => oc.close());
    let release!: () => void;
    const gate = new Promise<void>((r) => {
      release = r;
    });
    const w = worker(own.url);
    w.function("restart.mid", { timeoutMs: 10_000 }, async () => {
      await gate;
      return "survived";
    });
    await started(w);
    const submitted = await oc.submit("restart-mid", "restart.mid", null);
    const inv = await until("the handler to start", () => w.inflight[0]);
    await own.restart("SIGKILL");
    await until("the worker to reconnect", () => w.stats.connections >= 2 && w.state === "connected", 10_000);
    assert.deepEqual(w.reconciled, { kept: [inv], redispatched: [], unknown: [] });
    release();
    const turn = await oc.wait(submitted.turnId, { timeoutMs: 5000 });
    assert.equal(turn.status, "completed");
    assert.equal(turn.output, "survived");
    assert.equal(turn.attempt, 1);
  });

  it("a worker superseded by another process with its worker id stops, and run() rejects", async () => {
    const a = worker(turnd.url);
    a.function("dup.f", async () => "a");
    // Observed at once: the rejection may come before the test gets to look at it.
    const running = a.run().then(
      () => new Error("run() resolved"),
      (err: unknown) => err,
    );
    await until("the first worker to connect", () => a.state === "connected");
    const b = worker(turnd.url, { workerId: a.workerId });
    b.function("dup.f", async () => "b");
    await started(b);
    assert.match(String(await running), /superseded/);
    assert.equal(a.state, "stopped");
    assert.equal(b.state, "connected");
    const turn = await c.wait((await c.submit("dup-1", "dup.f", null)).turnId, { timeoutMs: 5000 });
    assert.equal(turn.output, "b");
  });

  it("a refused hello stops the worker with the daemon's error", async () => {
    const own = await startTurnd({ env: { TURND_AUTH__TOKENS: '[{ role = "worker", token = "right-token" }]' } });
    cleanups.push(() => own.stop());
    const w = worker(own.url, { token: "wrong-token" });
    w.function("auth.x", async () => null);
    await assert.rejects(w.start(), (err: Error & { code?: string }) => err.code === "not_authenticated");
    await sleep(10);
    assert.equal(w.state, "stopped");
  });
});
