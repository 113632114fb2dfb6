/** Worker behaviour against the real daemon: outcomes, retries, cancel, heartbeats, drain. */
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import v8 from "node:v8";
import { runInNewContext } from "node:vm";
import { Cancelled, type Client, Continue, Fail, type Worker, type WorkerState } from "../src/index.js";
import type { Turnd } from "../src/testing.js";
import { allEvents, client, daemon, sleep, until, worker } from "./helpers.js";

describe("worker", () => {
  let turnd: Turnd;
  let c: Client;
  const workers: Worker[] = [];
  const start = async (w: Worker) => {
    workers.push(w);
    await w.start();
    return w;
  };

  before(async () => {
    turnd = await daemon();
    c = await client(turnd.url);
  });
  after(async () => {
    await Promise.all(workers.map((w) => w.stop(200)));
    await c.close();
    await turnd.stop();
  });

  it("runs a one-step turn and reports its context", async () => {
    const seen: unknown[] = [];
    const states: WorkerState[] = [];
    const w = worker(turnd.url);
    w.on("state", (s: WorkerState) => states.push(s));
    w.function("happy.echo", { concurrency: 2 }, async (ctx, input: { text: string }) => {
      seen.push({ ...ctx, signal: undefined, heartbeat: undefined });
      return { reply: input.text.toUpperCase() };
    });
    await start(w);
    assert.equal(w.state, "connected");
    assert.deepEqual(states, ["connecting", "connected"]);
    const submitted = await c.submit("happy-1", "happy.echo", { text: "hi" });
    const turn = await c.wait(submitted.turnId);
    assert.equal(turn.status, "completed");
    assert.deepEqual(turn.output, { reply: "HI" });
    assert.equal(seen.length, 1);
    const ctx = seen[0] as Record<string, unknown>;
    assert.equal(ctx.sessionId, "happy-1");
    assert.equal(ctx.turnId, submitted.turnId);
    assert.equal(ctx.step, 0);
    assert.equal(ctx.attempt, 1);
    assert.equal(ctx.idempotencyKey, `${submitted.turnId}/0`);
    assert.match(String(ctx.invocationId), /^inv_/);
    const fns = await c.functions();
    assert.deepEqual(
      fns.filter((f) => f.functionId === "happy.echo").map((f) => [f.concurrency, f.workers]),
      [[2, 1]],
    );
  });

  it("keeps no memory per result it delivered, and warns of no listeners", async () => {
    // The heap after 1,000 turns and after 4,000 more, each measured after full
    // collections: a worker that kept what each result's delivery held (as a race
    // against a promise settled only at the stop did) grew by about 5 MB here.
    v8.setFlagsFromString("--expose-gc");
    const gc = runInNewContext("gc") as () => void;
    const heap = () => {
      gc();
      gc();
      return process.memoryUsage().heapUsed;
    };
    const w = worker(turnd.url);
    w.function("mem.echo", { concurrency: 64 }, async (_ctx, input) => input);
    await start(w);
    const run = (turns: number) =>
      Promise.all(
        Array.from({ length: 50 }, async (_, s) => {
          for (let k = 0; k < turns / 50; k++) {
            const t = await c.submit(`mem-${s}`, "mem.echo", { k });
            await c.wait(t.turnId, { timeoutMs: 20_000 });
          }
        }),
      );
    const warnings: string[] = [];
    const onWarning = (w: Error) => warnings.push(`${w.name}: ${w.message}`);
    process.on("warning", onWarning);
    await run(1000);
    const before = heap();
    await run(4000);
    const grown = heap() - before;
    process.off("warning", onWarning);
    // Results in delivery, up to 64 at once, each listening for the worker's halt.
    assert.deepEqual(warnings, []);
    assert.ok(w.stats.resultsAcked >= 4000, `${w.stats.resultsAcked} results acknowledged`);
    assert.ok(grown < 2 * 2 ** 20, `the heap grew by ${(grown / 2 ** 20).toFixed(1)} MB over 4,000 turns`);
  });

  it("runs a multi-step turn through Continue", async () => {
    const steps: number[] = [];
    const w = worker(turnd.url);
    w.function("multi.count", async (ctx, input: { n: number; trail: number[] }) => {
      steps.push(ctx.step);
      const trail = [...input.trail, ctx.step];
      return input.n > 1 ? new Continue({ n: input.n - 1, trail }) : { trail };
    });
    await start(w);
    const turn = await c.wait((await c.submit("multi-1", "multi.count", { n: 4, trail: [] })).turnId);
    assert.equal(turn.status, "completed");
    assert.equal(turn.step, 3);
    assert.deepEqual(turn.output, { trail: [0, 1, 2, 3] });
    assert.deepEqual(steps, [0, 1, 2, 3]);
  });

  it("turns Fail and thrown errors into failed turns", async () => {
    const w = worker(turnd.url);
    w.function("fail.hard", async () => {
      throw new Fail("bad_input", "no such thing");
    });
    w.function("fail.throw", async () => {
      throw new RangeError("index out of range");
    });
    await start(w);
    const hard = await c.wait((await c.submit("fail-1", "fail.hard", null)).turnId);
    assert.equal(hard.status, "failed");
    assert.equal(hard.error?.cause, "handler_failed");
    assert.equal(hard.error?.code, "bad_input");
    assert.equal(hard.error?.message, "no such thing");
    const thrown = await c.wait((await c.submit("fail-2", "fail.throw", null)).turnId);
    assert.equal(thrown.status, "failed");
    assert.equal(thrown.error?.code, "RangeError");
    assert.equal(thrown.error?.message, "index out of range");
  });

  it("a result too large for a frame, or too deep, fails the step instead of breaking the connection", async () => {
    const w = worker(turnd.url);
    w.function("big.result", async () => "x".repeat(2 * 1024 * 1024));
    w.function("big.bigint", async () => ({ n: 10n }));
    w.function("big.deep", async () => {
      let v: unknown = "leaf";
      for (let i = 0; i < 100; i++) v = [v];
      return v;
    });
    await start(w);
    // Deeper than the daemon's max_json_depth (64): refused with id null, then the
    // result is sent again as a fail that says so.
    const deep = await c.wait((await c.submit("big-3", "big.deep", null)).turnId, { timeoutMs: 5000 });
    assert.equal(deep.status, "failed");
    assert.equal(deep.error?.cause, "handler_failed");
    assert.equal(deep.error?.code, "too_large");
    assert.match(deep.error?.message ?? "", /max_json_depth \(64\)/);
    assert.equal(deep.attempt, 1);
    const turn = await c.wait((await c.submit("big-1", "big.result", null)).turnId, { timeoutMs: 5000 });
    assert.equal(turn.status, "failed");
    assert.equal(turn.error?.code, "too_large");
    assert.match(turn.error?.message ?? "", /max_frame_bytes 1048576/);
    const notJson = await c.wait((await c.submit("big-2", "big.bigint", null)).turnId, { timeoutMs: 5000 });
    assert.equal(notJson.error?.code, "invalid_output");
    assert.equal(w.stats.connections, 1);
  });

  it("retries a retryable Fail and completes on a later attempt", async () => {
    const attempts: number[] = [];
    const w = worker(turnd.url);
    w.function("retry.flaky", { delivery: "at_least_once", maxAttempts: 3 }, async (ctx) => {
      attempts.push(ctx.attempt);
      if (ctx.attempt < 3) throw new Fail("busy", "try again", { retryable: true });
      return { attempt: ctx.attempt };
    });
    w.function("retry.never", { delivery: "at_least_once", maxAttempts: 2 }, async () => {
      throw new Fail("busy", "always busy", { retryable: true });
    });
    await start(w);
    const turn = await c.wait((await c.submit("retry-1", "retry.flaky", null)).turnId);
    assert.equal(turn.status, "completed");
    assert.deepEqual(turn.output, { attempt: 3 });
    assert.deepEqual(attempts, [1, 2, 3]);
    const kinds = (await allEvents(c, "retry-1")).map((e) => e.kind);
    assert.equal(kinds.filter((k) => k === "retry_scheduled").length, 2);
    const exhausted = await c.wait((await c.submit("retry-2", "retry.never", null)).turnId);
    assert.equal(exhausted.status, "failed");
    assert.equal(exhausted.error?.cause, "attempts_exhausted");
    assert.equal(exhausted.attempt, 2);
  });

  it("aborts the handler's signal on a stop and answers cancelled", async () => {
    let started = false;
    let abortReason: unknown;
    const w = worker(turnd.url);
    w.function("cancel.slow", { timeoutMs: 10_000 }, async (ctx) => {
      started = true;
      await new Promise<void>((_resolve, reject) => {
        ctx.signal.addEventListener("abort", () => {
          abortReason = ctx.signal.reason;
          reject(new Error("aborted"));
        });
      });
      return "never";
    });
    await start(w);
    const submitted = await c.submit("cancel-1", "cancel.slow", null);
    await until("the handler to start", () => started);
    const stopping = await c.stop(submitted.turnId, "user pressed stop");
    assert.equal(stopping.status, "running");
    assert.equal(stopping.wait?.state, "cancelling");
    const turn = await c.wait(submitted.turnId, { timeoutMs: 5000 });
    assert.equal(turn.status, "cancelled");
    assert.equal(turn.stop?.reason, "user pressed stop");
    assert.ok(abortReason instanceof Cancelled);
    const results = (await allEvents(c, "cancel-1")).filter((e) => e.kind === "result");
    assert.deepEqual(
      results.map((e) => e.detail.outcome),
      ["cancelled"],
    );
  });

  it("keeps a handler that runs past its timeout alive with heartbeats", async () => {
    // A 3 s attempt timeout, heartbeats every second: the deadline passes only if the
    // worker (or the daemon) stalls for 2 s between two beats, not for a short stall of
    // a loaded machine. The handler runs twice the timeout.
    const w = worker(turnd.url);
    w.function("beat.long", { timeoutMs: 3000, delivery: "at_least_once" }, async (_ctx, input: { ms: number }) => {
      await sleep(input.ms);
      return "done";
    });
    await start(w);
    const submitted = await c.submit("beat-1", "beat.long", { ms: 6000 });
    const turn = await c.wait(submitted.turnId, { timeoutMs: 20_000 });
    assert.equal(turn.status, "completed");
    assert.equal(turn.attempt, 1);
    const kinds = (await allEvents(c, "beat-1")).map((e) => e.kind);
    assert.deepEqual(kinds, ["admitted", "dispatched", "result", "completed"]);
    assert.ok(w.stats.heartbeats >= 3, `heartbeats: ${w.stats.heartbeats}`);
  });

  it("without heartbeats the same handler is probed, cancelled, and times out", async () => {
    // The control case of the test above: it shows the timeout is real. The handler
    // honours the cancel the deadline asked for, so the turn fails timed_out: nobody
    // asked it to stop.
    const w = worker(turnd.url);
    w.function(
      "beat.none",
      { timeoutMs: 300, autoHeartbeat: false },
      async (ctx, input: { ms: number }) => {
        await Promise.race([sleep(input.ms), new Promise((r) => ctx.signal.addEventListener("abort", r))]);
        if (ctx.signal.aborted) throw new Cancelled("gave up");
        return "done";
      },
    );
    await start(w);
    const submitted = await c.submit("beat-2", "beat.none", { ms: 1500 });
    const turn = await c.wait(submitted.turnId, { timeoutMs: 5000 });
    assert.equal(turn.status, "failed");
    assert.equal(turn.error?.cause, "timed_out");
    assert.equal(turn.stop, undefined);
    const kinds = (await allEvents(c, "beat-2")).map((e) => e.kind);
    assert.ok(kinds.includes("probe_sent"), kinds.join(","));
    assert.ok(kinds.includes("cancel_sent"), kinds.join(","));
  });

  it("stop() drains: a running handler finishes and its result is delivered", async () => {
    let release!: () => void;
    const gate = new Promise<void>((r) => {
      release = r;
    });
    const w = worker(turnd.url);
    // Capacity for two: only the unregistration keeps the second turn away.
    w.function("drain.gate", { concurrency: 2 }, async () => {
      await gate;
      return "drained";
    });
    await w.start();
    const submitted = await c.submit("drain-1", "drain.gate", null);
    await until("the handler to start", () => w.inflight.length === 1);
    const stopped = w.stop(5000);
    await until("the worker to drain", () => w.state === "draining");
    // The daemon has taken the unregistration: no connected worker serves the
    // function any more (its answer may still be on the way to the worker).
    await until("the daemon to drop the function's worker", async () => {
      const f = (await c.functions()).find((x) => x.functionId === "drain.gate");
      return f !== undefined && f.workers === 0;
    });
    // Nothing new is dispatched to a draining worker.
    const queued = await c.submit("drain-2", "drain.gate", null);
    await sleep(100);
    assert.equal((await c.get(queued.turnId)).status, "queued");
    release();
    await stopped;
    assert.equal(w.state, "stopped");
    const turn = await c.get(submitted.turnId);
    assert.equal(turn.status, "completed");
    assert.equal(turn.output, "drained");
    await c.stop(queued.turnId);
  });
});
