/**
 * A worker (and a client) given several URLs, as for a cluster's nodes, through two
 * real daemons. Two independent `turnd serve` processes stand for two nodes: each
 * dispatches only its own turns and neither knows the other's invocations, so every
 * request of an invocation must reach the daemon that dispatched it (a cluster node
 * would forward it; these do not).
 */
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import { type Client, connect, TurndError, type Worker } from "../src/index.js";
import type { Turnd } from "../src/testing.js";
import { allEvents, client, daemon, FrameProxy, sleep, until, worker } from "./helpers.js";

describe("several URLs", () => {
  let a: Turnd;
  let b: Turnd;
  let onA: Client;
  let onB: Client;
  const cleanups: Array<() => Promise<void>> = [];

  before(async () => {
    [a, b] = await Promise.all([daemon(), daemon()]);
    [onA, onB] = await Promise.all([client(a.url), client(b.url)]);
  });
  after(async () => {
    for (const f of cleanups.reverse()) await f();
    await Promise.all([onA.close(), onB.close()]);
    await Promise.all([a.stop(), b.stop()]);
  });

  async function proxied(url: string): Promise<FrameProxy> {
    const proxy = await FrameProxy.start(url);
    cleanups.push(() => proxy.close());
    return proxy;
  }

  function stopLater(w: Worker): Worker {
    cleanups.push(() => w.stop(200));
    return w;
  }

  it("a worker serves the turns of both daemons, one worker and one instance on each", async () => {
    const w = stopLater(worker([a.url, b.url]));
    const served: unknown[] = [];
    w.function("both.echo", async (_ctx, input) => {
      served.push(input);
      return { echo: input };
    });
    await w.start();
    const doneA = await onA.wait((await onA.submit("both", "both.echo", "a")).turnId, { timeoutMs: 5000 });
    const doneB = await onB.wait((await onB.submit("both", "both.echo", "b")).turnId, { timeoutMs: 5000 });
    assert.deepEqual([doneA.output, doneB.output], [{ echo: "a" }, { echo: "b" }]);
    assert.deepEqual(served.sort(), ["a", "b"]);
    for (const c of [onA, onB]) {
      const mine = (await c.workers()).filter((x) => x.workerId === w.workerId);
      assert.deepEqual(
        mine.map((x) => x.instanceId),
        [w.instanceId],
      );
    }
    assert.equal(w.stats.connections, 2);
  });

  it("start() waits for every URL, while the one reachable is served", async () => {
    const toB = await proxied(b.url);
    toB.refuse = true;
    const w = stopLater(worker([a.url, toB.url]));
    w.function("wait.echo", async (_ctx, input) => input);
    let started = false;
    const starting = w.start().then(() => {
      started = true;
    });
    const done = await onA.wait((await onA.submit("wait", "wait.echo", 1)).turnId, { timeoutMs: 5000 });
    assert.equal(done.status, "completed");
    await sleep(300);
    assert.equal(started, false);
    assert.notEqual(w.state, "connected");
    toB.refuse = false;
    await starting;
    assert.equal(w.state, "connected");
  });

  it("a result waits for the daemon that dispatched it, and heartbeats elsewhere end nothing", async () => {
    const toA = await proxied(a.url);
    // A short timeout: heartbeats every 200 ms, to b while a is cut off.
    const w = stopLater(worker([toA.url, b.url]));
    let release!: () => void;
    const gate = new Promise<void>((r) => {
      release = r;
    });
    const aborted: boolean[] = [];
    w.function("home.work", { timeoutMs: 600 }, async (ctx, input) => {
      await gate;
      aborted.push(ctx.signal.aborted);
      return { done: input };
    });
    await w.start();
    const submitted = await onA.submit("home", "home.work", 5);
    const inv = await until("the handler to start", () => w.inflight[0]);
    toA.refuse = true;
    toA.cut();
    await until("the worker to see a gone", () => w.state !== "connected");
    await sleep(500); // heartbeats meanwhile reach b only
    release();
    // The result goes out on b, the one connection up: b never stored the invocation,
    // so the worker keeps the result for a.
    await until("the result to be sent", () => w.stats.resultsSent === 1);
    await sleep(200);
    assert.deepEqual(w.finished, [inv]);
    toA.refuse = false;
    const turn = await onA.wait(submitted.turnId, { timeoutMs: 5000 });
    assert.equal(turn.status, "completed");
    assert.deepEqual(turn.output, { done: 5 });
    assert.deepEqual(aborted, [false]);
    const kinds = (await allEvents(onA, "home")).map((e) => e.kind);
    assert.deepEqual(kinds, ["admitted", "dispatched", "result", "completed"]);
    const hello = toA.hellos().at(-1)?.args as { finished: string[] };
    assert.deepEqual(hello.finished, [inv]);
  });

  it("a probe after a restart is answered from every connection's work", async () => {
    const own = await daemon();
    cleanups.push(() => own.stop());
    const toOwn = await proxied(own.url);
    const oc = await client(own.url);
    cleanups.push(() => oc.close());
    const w = stopLater(worker([a.url, toOwn.url]));
    const ran: string[] = [];
    // No heartbeats: the deadline passes while the daemon is away, so it probes at once.
    w.function("probe.work", { timeoutMs: 300, autoHeartbeat: false }, async (ctx) => {
      ran.push(ctx.invocationId);
      // The cancel that follows the answer "running".
      await new Promise((r) => ctx.signal.addEventListener("abort", r, { once: true }));
      return { ran: true };
    });
    await w.start();
    const submitted = await oc.submit("probe", "probe.work", null);
    await until("the handler to start", () => ran.length === 1);
    toOwn.refuse = true;
    await own.restart("SIGKILL");
    await sleep(500); // past the attempt's deadline
    toOwn.refuse = false;
    const turn = await oc.wait(submitted.turnId, { timeoutMs: 10_000 });
    assert.equal(turn.status, "completed");
    assert.deepEqual(turn.output, { ran: true });
    assert.equal(ran.length, 1);
    const kinds = (await allEvents(oc, "probe")).map((e) => e.kind);
    assert.deepEqual(kinds, ["admitted", "dispatched", "probe_sent", "cancel_sent", "result", "completed"]);
    const status = toOwn.sentToServer.find((f) => f.op === "invocation.status");
    assert.deepEqual(status?.args, { invocation_id: ran[0], state: "running" });
  });

  it("a client connects to the first URL that answers, and moves on when its connection is lost", async () => {
    const toA = await proxied(a.url);
    const toB = await proxied(b.url);
    toA.refuse = true;
    const c = await connect({ url: [toA.url, toB.url], reconnectDelayMs: 50, reconnectTimeoutMs: 3000 });
    cleanups.push(() => c.close());
    assert.equal(c.url, toB.url);
    toA.refuse = false;
    toB.refuse = true;
    toB.cut();
    await c.stats();
    assert.equal(c.url, toA.url);
    assert.equal(toA.hellos().length, 1);
  });

  it("submits a stopping daemon never read are sent again to the next URL and run once", async (t) => {
    // A daemon that shuts down answers every request it read and closes with 1001: a
    // request it never read changed nothing, so the client sends it again, whatever
    // its op. Clients submitting turns without idempotency keys, many in flight on
    // each connection, across a SIGTERM of A and then of B (each restarted on its data
    // directory): no submit fails unanswered, and A and B together hold exactly the
    // turns acknowledged.
    const [clients, inFlight] = [4, 8];
    const [dA, dB] = await Promise.all([daemon(), daemon()]);
    cleanups.push(() => Promise.all([dA.stop(), dB.stop()]).then(() => undefined));
    const ackedBy = new Map<string, number>([
      [dA.url, 0],
      [dB.url, 0],
    ]);
    const acked = () => (ackedBy.get(dA.url) ?? 0) + (ackedBy.get(dB.url) ?? 0);
    let stop = false;
    const deadline = Date.now() + 20_000;
    const submitter = async (c: Client, name: string) => {
      for (let k = 0; !stop; k++) {
        assert.ok(Date.now() < deadline, "the SIGTERMs did not move the clients within 20 s");
        try {
          // A session per submit: no per-session queue limit is met.
          await c.submit(`${name}-${k}`, "nobody", 1);
          ackedBy.set(c.url, (ackedBy.get(c.url) ?? 0) + 1);
        } catch (err) {
          // An answer: nothing was created; a new submit follows.
          if (!(err instanceof TurndError && err.code === "shutting_down")) throw err;
        }
      }
    };
    const clientsDone = Promise.all(
      Array.from({ length: clients }, async (_, n) => {
        const c = await connect({ url: [dA.url, dB.url], reconnectDelayMs: 50, reconnectTimeoutMs: 10_000 });
        try {
          await Promise.all(Array.from({ length: inFlight }, (_, i) => submitter(c, `s${n}-${i}`)));
        } finally {
          await c.close();
        }
      }),
    );
    clientsDone.catch(() => undefined); // a failed submit is raised by the race below
    try {
      // Each stop is a chance to catch requests in flight unread: take two.
      for (const [stopped, next] of [
        [dA, dB],
        [dB, dA],
      ] as const) {
        await sleep(300);
        const before = ackedBy.get(next.url) ?? 0;
        await stopped.restart("SIGTERM");
        await Promise.race([
          clientsDone,
          until("submits acknowledged by the other daemon", () => (ackedBy.get(next.url) ?? 0) >= before + 200),
        ]);
      }
    } finally {
      stop = true;
    }
    await clientsDone;
    const held = async (url: string) => {
      const c = await client(url);
      try {
        return Object.values((await c.stats()).turns).reduce((sum, n) => sum + n, 0);
      } finally {
        await c.close();
      }
    };
    const [heldA, heldB] = [await held(dA.url), await held(dB.url)];
    t.diagnostic(`acknowledged ${acked()}: A holds ${heldA}, B holds ${heldB}`);
    assert.ok(heldA > 0 && heldB > 0, `both daemons took submits (A ${heldA}, B ${heldB})`);
    assert.equal(heldA + heldB, acked(), `acknowledged ${acked()}: A holds ${heldA}, B ${heldB}`);
  });
});
