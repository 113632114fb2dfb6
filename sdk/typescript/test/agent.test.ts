/**
 * Turns of agents against the real daemon: progress streamed to a turn's stream and
 * to watches, suspend for input and resume, and what a second message does (`onBusy`).
 */
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import {
  BusyError,
  type Client,
  Continue,
  connect,
  isEvent,
  isProgress,
  isProgressDropped,
  type Previous,
  type Progress,
  type Resumed,
  resumed,
  Suspend,
  type Turn,
  TurndError,
  type WatchItem,
  type Worker,
} from "../src/index.js";
import type { Turnd } from "../src/testing.js";
import { allEvents, client, daemon, FrameProxy, until, worker } from "./helpers.js";

/** A promise with its resolver, to hold a handler until the test lets it go. */
function gate(): { promise: Promise<void>; open: () => void } {
  let open!: () => void;
  const promise = new Promise<void>((resolve) => {
    open = resolve;
  });
  return { promise, open };
}

async function waitState(c: Client, turnId: string, state: string): Promise<Turn> {
  const found = await until(`${turnId} ${state}`, async () => {
    const t = await c.get(turnId);
    return t.wait?.state === state ? t : undefined;
  });
  return found as Turn;
}

describe("agent turns", () => {
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

  it("streams a turn's progress in order and ends the stream with the turn", async () => {
    const go = gate();
    const finish = gate();
    const w = worker(turnd.url);
    w.function("stream.model", async (ctx) => {
      await go.promise;
      for (const token of ["Hel", "lo", ",", " world"]) ctx.progress({ token });
      await finish.promise;
      return "Hello, world";
    });
    await start(w);
    const { turnId } = await c.submit("stream-1", "stream.model");
    const plain = await c.watch({ sessionId: "stream-1" }, { after: 0 });
    const items: WatchItem[] = [];
    for await (const item of await c.stream(turnId)) {
      items.push(item);
      if (isEvent(item) && item.kind === "dispatched") go.open();
      if (isProgress(item) && item.seq === 4) {
        const live = await c.get(turnId);
        assert.equal(live.progress?.seq, 4);
        assert.deepEqual(live.progress?.data, { token: " world" });
        assert.equal(live.progress?.invocationId, item.invocationId);
        finish.open();
      }
    }
    const progress = items.filter(isProgress);
    assert.deepEqual(
      progress.map((p) => (p.data as { token: string }).token),
      ["Hel", "lo", ",", " world"],
    );
    assert.deepEqual(
      progress.map((p) => [p.seq, p.step, p.attempt, p.turnId]),
      [1, 2, 3, 4].map((n) => [n, 0, 1, turnId]),
    );
    assert.equal(items.filter(isProgressDropped).length, 0);
    const last = items[items.length - 1];
    assert.ok(last && isEvent(last) && last.kind === "completed");
    const done = await c.get(turnId);
    assert.equal(done.status, "completed");
    assert.equal(done.progress, undefined);
    assert.equal(w.stats.progressSent, 4);
    // A watch that did not ask for progress gets events only.
    const seen: string[] = [];
    for await (const event of plain) {
      seen.push(event.kind);
      if (event.kind === "completed") break;
    }
    assert.deepEqual(seen, ["admitted", "dispatched", "result", "completed"]);
    // The stream of a finished turn replays its events and ends.
    const replay: string[] = [];
    for await (const item of await c.stream(turnId)) replay.push(item.kind);
    assert.deepEqual(replay, ["admitted", "dispatched", "result", "completed"]);
  });

  it("marks progress lost on the way, and a stream resumes after a cut", async () => {
    const queue: number[] = [];
    let wake: (() => void) | undefined;
    const put = (...ns: number[]) => {
      queue.push(...ns);
      wake?.();
    };
    const w = worker(turnd.url);
    w.function("gaps.model", async (ctx) => {
      for (;;) {
        while (queue.length === 0) await new Promise<void>((r) => (wake = r));
        const n = queue.shift() as number;
        if (n === 0) return "done";
        ctx.progress(n);
      }
    });
    await start(w);
    const proxy = await FrameProxy.start(turnd.url);
    // Frame 2 never reaches the watcher: the daemon did not drop it, only the SDK can
    // tell. Frame 4 arrives as the daemon's own marker for it, as for a watcher that
    // read too slowly: the SDK must not count it again.
    proxy.toClient = (f) => f.push === "progress" && f.seq === 2;
    proxy.editToClient = (f) =>
      f.push === "progress" && f.seq === 4
        ? {
            push: "progress_dropped",
            watch_id: f.watch_id,
            turn_id: f.turn_id,
            invocation_id: f.invocation_id,
            count: 1,
          }
        : undefined;
    const watcher = await connect({ url: proxy.url, reconnectDelayMs: 50, maxReconnectDelayMs: 200 });
    const items: WatchItem[] = [];
    try {
      const { turnId } = await watcher.submit("gaps-1", "gaps.model", null, { idempotencyKey: "k" });
      for await (const item of await watcher.stream(turnId)) {
        items.push(item);
        if (isEvent(item) && item.kind === "dispatched") put(1, 2, 3, 4, 5);
        if (isProgress(item) && item.seq === 5) {
          proxy.refuse = true;
          proxy.cut();
          put(6, 7); // sent while the watcher is away
          void (async () => {
            await until("frames 6 and 7 taken", () => w.stats.progressSent >= 7);
            proxy.refuse = false;
            // Answered, the reopened watch goes live at once (nothing to replay): frames
            // sent before the daemon took the watch up would reach no watch at all.
            const answered = () =>
              proxy.sentToClient.filter((f) => typeof (f.ok as { watch_id?: unknown } | undefined)?.watch_id === "string");
            await until("the watch reopened", () => answered().length >= 2);
            put(8, 9, 0);
          })();
        }
      }
    } finally {
      await watcher.close();
      await proxy.close();
    }
    const frames = items.filter((i) => !isEvent(i));
    const { turnId, invocationId } = frames[0] as Progress;
    const frame = (seq: number) => ({ kind: "progress", turnId, invocationId, step: 0, attempt: 1, seq, data: seq });
    const lostOne = { kind: "progress_dropped", turnId, invocationId, count: 1 };
    // 2 marked by the SDK, 4 by the daemon.
    assert.deepEqual(frames.slice(0, 5), [frame(1), lostOne, frame(3), lostOne, frame(5)]);
    assert.equal(frames[5]?.kind, "progress_dropped"); // 6 and 7, sent while away
    const seqs = items.filter(isProgress).map((p) => p.seq);
    assert.equal(seqs[seqs.length - 1], 9);
    const lost = items.filter(isProgressDropped).reduce((n, d) => n + d.count, 0);
    // Every frame is seen or counted as lost, whatever the daemon dropped itself
    // while the reopened watch replayed.
    assert.equal(seqs.length + lost, 9);
    assert.deepEqual(
      items.filter(isEvent).map((e) => e.kind),
      ["admitted", "dispatched", "result", "completed"],
    );
  });

  it("interrupts a running turn: previous for the new one, its progress refused and seen by no one", async () => {
    const started = gate();
    const interrupted = gate();
    const previous: Array<Previous | undefined> = [];
    let refusedBefore = -1;
    let droppedBefore = -1;
    const w = worker(turnd.url);
    w.function("chat.turn", { concurrency: 2 }, async (ctx, input) => {
      if (ctx.step === 0 && input === "first") return new Continue({ said: "first", draft: "Once upon" });
      if (ctx.step === 1) {
        started.open();
        await new Promise<void>((r) => ctx.signal.addEventListener("abort", () => r(), { once: true }));
        await interrupted.promise;
        refusedBefore = w.stats.progressRefused;
        droppedBefore = w.stats.progressDropped;
        ctx.progress("from the interrupted turn");
        await until("the refusal", () => w.stats.progressRefused > refusedBefore);
        ctx.progress("not even sent"); // the invocation is known to be no longer current
        return "too late";
      }
      previous.push(ctx.previous);
      return { reply: input };
    });
    await start(w);
    const first = await c.submit("chat-1", "chat.turn", "first");
    await started.promise;
    const watch = await c.watch({ sessionId: "chat-1" }, { progress: true });
    const second = await c.submit("chat-1", "chat.turn", "second", { onBusy: "interrupt" });
    interrupted.open();
    const done = await c.wait(second.turnId);
    const got: WatchItem[] = [];
    for await (const item of watch) {
      got.push(item);
      if (isEvent(item) && item.kind === "completed") break;
    }
    assert.equal(done.status, "completed");
    assert.deepEqual(done.output, { reply: "second" });
    assert.deepEqual(previous, [{ turnId: first.turnId, status: "cancelled", state: { said: "first", draft: "Once upon" } }]);
    const stopped = await c.get(first.turnId);
    assert.equal(stopped.status, "cancelled");
    assert.equal(stopped.stop?.reason, "interrupted");
    assert.equal(stopped.superseded, false);
    assert.equal(got.filter((i) => !isEvent(i)).length, 0);
    assert.equal(w.stats.progressRefused, refusedBefore + 1);
    assert.equal(w.stats.progressDropped, droppedBefore + 1);
    assert.equal(w.stats.progressSent, 0);
  });

  it("rejects a busy submit storing nothing, and rollback marks the stopped turn superseded", async () => {
    const first = await c.submit("busy-1", "nobody.busy", "first");
    await assert.rejects(
      c.submit("busy-1", "nobody.busy", "again", { onBusy: "reject", idempotencyKey: "r" }),
      (err: unknown) => err instanceof BusyError && err.code === "busy" && !err.retryable,
    );
    assert.deepEqual(
      (await c.list("busy-1")).turns.map((t) => t.turnId),
      [first.turnId],
    );
    const second = await c.submit("busy-1", "nobody.busy", "second", { onBusy: "rollback" });
    const stopped = await c.get(first.turnId);
    assert.equal(stopped.status, "cancelled");
    assert.equal(stopped.superseded, true);
    // The rejected submit's key was not kept.
    const again = await c.submit("busy-1", "nobody.busy", "third", { idempotencyKey: "r" });
    assert.equal(again.deduplicated, false);
    const listed = Object.fromEntries((await c.list("busy-1")).turns.map((t) => [t.turnId, t.superseded]));
    assert.deepEqual(listed, { [first.turnId]: true, [second.turnId]: false, [again.turnId]: false });
    await c.stopSession("busy-1");
  });

  it("suspends for approval without holding the worker, and resume runs the next step", async () => {
    const steps: Array<[number, Resumed | undefined]> = [];
    const w = worker(turnd.url);
    w.function("approve.deploy", { concurrency: 1 }, async (ctx, input) => {
      const answer = resumed<{ plan: unknown }, { ok: boolean }>(input);
      steps.push([ctx.step, answer]);
      if (!answer) return new Suspend({ waiting: "approval", plan: input }, { prompt: "deploy?", timeoutMs: 60_000 });
      return { deployed: answer.input?.ok, plan: answer.state.plan };
    });
    await start(w);
    const { turnId } = await c.submit("approve-1", "approve.deploy", "v2");
    const waiting = await waitState(c, turnId, "awaiting_input");
    // The worker's one slot is free: another session's turn runs meanwhile.
    const other = await c.submit("approve-2", "approve.deploy", "v3");
    await waitState(c, other.turnId, "awaiting_input");
    assert.equal(waiting.status, "running");
    assert.equal(waiting.inputRequest?.prompt, "deploy?");
    assert.equal(waiting.inputRequest?.onTimeout, "fail");
    assert.equal(waiting.inputRequest?.deadlineMs, waiting.wait?.deadlineMs);
    assert.equal((await c.inspect("approve-1")).lock?.wait.state, "awaiting_input");
    const won = await c.resume(turnId, { ok: true }, { idempotencyKey: "yes" });
    const again = await c.resume(turnId, { ok: true }, { idempotencyKey: "yes" });
    await assert.rejects(c.resume(turnId, { ok: false }), (e: unknown) => e instanceof TurndError && e.code === "conflict");
    const done = await c.wait(turnId);
    assert.equal((await c.stop(other.turnId)).status, "cancelled");
    assert.equal(won.deduplicated, false);
    assert.equal(again.deduplicated, true);
    assert.equal(done.status, "completed");
    assert.deepEqual(done.output, { deployed: true, plan: "v2" });
    assert.equal(done.inputRequest, undefined);
    assert.deepEqual(steps[0], [0, undefined]);
    assert.deepEqual(steps[steps.length - 1], [1, { state: { waiting: "approval", plan: "v2" }, input: { ok: true } }]);
    const kinds = (await allEvents(c, "approve-1")).map((e) => e.kind);
    assert.equal(kinds.filter((k) => k === "suspended").length, 1);
    assert.equal(kinds.filter((k) => k === "resumed").length, 1);
  });

  it("fails or continues at the input deadline", async () => {
    const got: Array<Resumed | undefined> = [];
    const w = worker(turnd.url);
    w.function("deadline.ask", async (ctx, input) => {
      if (ctx.step === 0) {
        return new Suspend({ asked: true }, { prompt: "?", timeoutMs: 200, onTimeout: input as "fail" | "continue" });
      }
      got.push(resumed(input));
      return "went on";
    });
    await start(w);
    const failed = await c.wait((await c.submit("deadline-1", "deadline.ask", "fail")).turnId);
    const wentOn = await c.wait((await c.submit("deadline-1", "deadline.ask", "continue")).turnId);
    assert.equal(failed.status, "failed");
    assert.equal(failed.error?.cause, "input_timeout");
    assert.equal(wentOn.status, "completed");
    assert.deepEqual(got, [{ state: { asked: true }, input: null }]);
  });

  it("refuses to resume a turn that is not awaiting input, changing nothing", async () => {
    const queued = await c.submit("resume-1", "nobody.resume", 1);
    const events = await allEvents(c, "resume-1");
    await assert.rejects(c.resume(queued.turnId, "yes"), (e: unknown) => e instanceof TurndError && e.code === "conflict" && !e.retryable);
    await assert.rejects(c.resume("t_00000000000000000000000000", "yes"), (e: unknown) => e instanceof TurndError && e.code === "not_found");
    // The wait's reason says how long ago it began: everything else is as it was.
    const { deduplicated: _, wait: __, ...before } = queued;
    const { wait: ___, ...now } = await c.get(queued.turnId);
    assert.deepEqual(now, before);
    assert.deepEqual(await allEvents(c, "resume-1"), events);
    await c.stopSession("resume-1");
  });

  it("checks a suspend's options and reads a resumed input without a daemon", () => {
    assert.deepEqual(new Suspend().toWire(), { state: null });
    assert.deepEqual(new Suspend([1], { prompt: { q: "ok?" }, timeoutMs: 5, onTimeout: "continue" }).toWire(), {
      state: [1],
      prompt: { q: "ok?" },
      timeout_ms: 5,
      on_timeout: "continue",
    });
    for (const bad of [{ timeoutMs: 0 }, { timeoutMs: 1.5 }, { onTimeout: "retry" as "fail" }]) {
      assert.throws(() => new Suspend(null, bad), RangeError);
    }
    assert.deepEqual(resumed({ state: 1, input: null }), { state: 1, input: null });
    assert.equal(resumed({ state: 1, input: 2, more: 3 }), undefined);
    assert.equal(resumed([1, 2]), undefined);
  });
});
