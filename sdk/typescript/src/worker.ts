/**
 * The worker side: serve functions, and do the worker's part of the daemon's loss
 * handling (docs/semantics.md, "Loss"):
 *
 * - one `instanceId` for the life of a {@link Worker}, announced in every `hello` with
 *   the invocations still running (`inflight`) and the results not yet acknowledged
 *   (`finished`), so a reconnect keeps work instead of losing it;
 * - every result is held until the daemon acknowledges it: resent after
 *   `resultAckTimeoutMs` without an answer, after a retryable error, after every
 *   reconnect, and at once when a `probe`, `cancel` or repeated `invoke` shows the
 *   daemon is waiting for it;
 * - `probe` is answered from what this worker knows (`running`, `finished`,
 *   `unknown`), and `cancel` aborts the handler's `AbortSignal`;
 * - heartbeats are sent on their own while a handler runs;
 * - any end of a connection is a disconnect: the worker reconnects with capped,
 *   jittered backoff while handlers keep running, and registers its functions again;
 * - given several URLs (a cluster's nodes) it keeps a connection to each
 *   (`links.ts`) with these same tables: a probe on any of them is answered from all.
 */
import { randomUUID } from "node:crypto";
import { EventEmitter } from "node:events";
import {
  Connection,
  DEFAULT_MAX_FRAME_BYTES,
  frameOverhead,
  type HelloArgs,
  PROTOCOL_VERSION,
  type PushFrame,
} from "./connection.js";
import { ConnectionError, TurndError } from "./errors.js";
import {
  Cancelled,
  Continue,
  Fail,
  type FunctionOptions,
  type Handler,
  type Previous,
  Suspend,
  type TurnContext,
} from "./handler.js";
import { type Link, Links, message, sleep } from "./links.js";
import { Live, type LiveCounters, type Route, type Running } from "./live.js";
import type { Reconciled } from "./types.js";

export type WorkerState = "idle" | "connecting" | "connected" | "disconnected" | "draining" | "stopped";

export interface WorkerOptions {
  /**
   * Daemon URL, e.g. `ws://127.0.0.1:7420/v1`; or the URLs of a cluster's nodes: the
   * worker then keeps a connection to each, with one `workerId` and one `instanceId`.
   */
  url: string | readonly string[];
  /** Stable across restarts of this worker. */
  workerId: string;
  /** Token for role `worker`, when the daemon requires one. */
  token?: string;
  /** Shown in `workers.list`; default `workerId`. */
  name?: string;
  /** Identifies this process start; default a fresh UUID per `Worker`. */
  instanceId?: string;
  /** Resend a result that got no answer within this long (default 2000). */
  resultAckTimeoutMs?: number;
  /** First reconnect delay (default 200); doubled per failed attempt, jittered. */
  reconnectDelayMs?: number;
  /** Cap of the reconnect delay (default 5000). */
  maxReconnectDelayMs?: number;
  /** Handshake and `hello` timeout per connection attempt (default 10000). */
  connectTimeoutMs?: number;
  /** How long `stop()` (and SIGTERM under `run()`) waits for handlers and results (default 30000). */
  drainTimeoutMs?: number;
  /**
   * `ctx.progress` drops frames while the connection's send buffer holds more than
   * this many bytes (default 1 MiB): a slow daemon never makes a handler wait.
   */
  progressBufferBytes?: number;
  /**
   * Diagnostic messages; default: warnings and errors written to stderr
   * (`console.error`). Pass `() => {}` for none.
   */
  log?: (level: LogLevel, message: string) => void;
}

/** Counters of a running worker. */
export interface WorkerStats extends LiveCounters {
  invocationsStarted: number;
  resultsSent: number;
  resultsResent: number;
  resultsAcked: number;
  resultsDropped: number;
  connections: number;
}

type Outcome =
  | { complete: unknown }
  | { continue: unknown }
  | { suspend: Record<string, unknown> }
  | { fail: { code: string; message: string; retryable: boolean } }
  | { cancelled: { message: string } };

interface Registered {
  functionId: string;
  options: FunctionOptions;
  handler: Handler;
}

interface Held extends Sendable {
  /** The index of the URL whose daemon last pushed about the invocation. */
  home: number;
  /** Makes the pump send the result again now. */
  wake: () => void;
}

type LogLevel = "debug" | "info" | "warn" | "error";

/** The default `log`: warnings and errors on stderr, so a worker that cannot work says why. */
function logToStderr(workerId: string): (level: LogLevel, message: string) => void {
  return (level, message) => {
    if (level === "warn" || level === "error") console.error(`turnd worker ${workerId}: ${level}: ${message}`);
  };
}

/** An outcome as it is held for sending: its request's arguments, written. */
interface Sendable {
  /** The `invocation.result` request's arguments as JSON, written once. */
  args: string;
  /** Whether the outcome is a `fail`. */
  fails: boolean;
}

/** The `invocation.result` request's arguments as JSON. */
function resultArgs(invocationId: string, outcome: Outcome): string {
  return JSON.stringify({ invocation_id: invocationId, outcome });
}

/** A `fail` outcome (not retryable) and its arguments. */
function failed(invocationId: string, code: string, text: string): Sendable {
  const outcome: Outcome = { fail: { code, message: text, retryable: false } };
  return { args: resultArgs(invocationId, outcome), fails: true };
}

/** The bytes of an `invocation.result` frame besides its arguments, at the longest id. */
const RESULT_FRAME_BYTES = frameOverhead("invocation.result");

/** What a handler's return value says: another step, a wait for input, or the output. */
function outcomeOf(value: unknown): Outcome {
  if (value instanceof Continue) return { continue: value.state ?? null };
  if (value instanceof Suspend) return { suspend: value.toWire() };
  return { complete: value ?? null };
}

/** The invoke's `previous` member (an interrupted turn), when it has one. */
function previousFromWire(v: unknown): Previous | undefined {
  if (v === null || typeof v !== "object") return undefined;
  const p = v as Record<string, unknown>;
  if (typeof p.turn_id !== "string") return undefined;
  return { turnId: p.turn_id, status: String(p.status ?? ""), state: p.state ?? null };
}

/**
 * A worker: declare functions with {@link Worker.function}, then `await run()`.
 *
 * Events: `state` (a {@link WorkerState}), `reconciled` (a {@link Reconciled}, after
 * each `hello` that reports one).
 */
export class Worker extends EventEmitter {
  readonly workerId: string;
  readonly instanceId: string;
  /** Every URL the worker connects to. */
  readonly urls: readonly string[];
  private readonly opts: Required<Omit<WorkerOptions, "token" | "log">> & Pick<WorkerOptions, "token">;
  private readonly logFn: NonNullable<WorkerOptions["log"]>;
  private readonly functions = new Map<string, Registered>();
  private readonly running = new Map<string, Running>();
  private readonly unacked = new Map<string, Held>();
  private readonly links: Links;
  private currentState: WorkerState = "idle";
  private lastReconciled: Reconciled | undefined;
  /** Aborted at the hard stop: no more reconnects, pumps end. */
  private readonly halt = new AbortController();
  private supervisor: Promise<void> | undefined;
  /** Set by `stop()`: functions are not registered again on a reconnect. */
  private draining = false;
  /** The daemon's frame limit from the last `hello`. */
  private maxFrameBytes = DEFAULT_MAX_FRAME_BYTES;
  private stopping: Promise<void> | undefined;
  private drainWaiters: Array<() => void> = [];
  private firstConnect: { promise: Promise<void>; resolve: () => void; reject: (e: Error) => void };
  private readonly counters: WorkerStats = {
    invocationsStarted: 0,
    resultsSent: 0,
    resultsResent: 0,
    resultsAcked: 0,
    resultsDropped: 0,
    connections: 0,
    heartbeats: 0,
    progressSent: 0,
    progressDropped: 0,
    progressRefused: 0,
  };
  private readonly live: Live;

  constructor(options: WorkerOptions) {
    super();
    // The halt ends every result's delivery: its pump, woken, finds no link to send on.
    this.halt.signal.addEventListener(
      "abort",
      () => {
        for (const held of this.unacked.values()) held.wake();
      },
      { once: true },
    );
    this.workerId = options.workerId;
    this.instanceId = options.instanceId ?? randomUUID();
    this.opts = {
      url: options.url,
      workerId: options.workerId,
      token: options.token,
      name: options.name ?? options.workerId,
      instanceId: this.instanceId,
      resultAckTimeoutMs: options.resultAckTimeoutMs ?? 2000,
      reconnectDelayMs: options.reconnectDelayMs ?? 200,
      maxReconnectDelayMs: options.maxReconnectDelayMs ?? 5000,
      connectTimeoutMs: options.connectTimeoutMs ?? 10_000,
      drainTimeoutMs: options.drainTimeoutMs ?? 30_000,
      progressBufferBytes: options.progressBufferBytes ?? 1_048_576,
    };
    this.urls = typeof options.url === "string" ? [options.url] : [...options.url];
    if (this.urls.length === 0) throw new TypeError("a worker needs at least one URL");
    this.logFn = options.log ?? logToStderr(options.workerId);
    this.links = new Links({
      urls: this.urls,
      halt: this.halt,
      reconnectDelayMs: this.opts.reconnectDelayMs,
      maxReconnectDelayMs: this.opts.maxReconnectDelayMs,
      open: (index, url) => this.connectAndRegister(index, url),
      up: (link) => this.linkUp(link),
      down: (trying) => this.setState(trying ? "connecting" : "disconnected"),
      log: (level, msg) => this.log(level, msg),
    });
    this.live = new Live({
      route: (invocationId) => this.route(invocationId),
      running: this.running,
      counters: this.counters,
      log: (level, msg) => this.log(level, msg),
      progressBufferBytes: this.opts.progressBufferBytes,
    });
    let resolve!: () => void;
    let reject!: (e: Error) => void;
    const promise = new Promise<void>((res, rej) => {
      resolve = res;
      reject = rej;
    });
    promise.catch(() => {});
    this.firstConnect = { promise, resolve, reject };
  }

  /** Serve `functionId` with `handler`. Call before `start()`/`run()`. */
  function<I = unknown>(functionId: string, options: FunctionOptions, handler: Handler<I>): this;
  function<I = unknown>(functionId: string, handler: Handler<I>): this;
  function<I = unknown>(
    functionId: string,
    optionsOrHandler: FunctionOptions | Handler<I>,
    maybeHandler?: Handler<I>,
  ): this {
    const [options, handler] =
      typeof optionsOrHandler === "function" ? [{}, optionsOrHandler] : [optionsOrHandler, maybeHandler];
    if (typeof handler !== "function") throw new TypeError(`no handler given for ${functionId}`);
    if (this.supervisor) throw new Error("functions must be declared before the worker starts");
    this.functions.set(functionId, { functionId, options, handler: handler as Handler });
    return this;
  }

  /** The connection state. */
  get state(): WorkerState {
    return this.currentState;
  }

  /** What the daemon reported at the last `hello` about this worker's invocations. */
  get reconciled(): Reconciled | undefined {
    return this.lastReconciled;
  }

  /** A snapshot of the counters. */
  get stats(): WorkerStats {
    return { ...this.counters };
  }

  /** Invocation ids whose handlers are running. */
  get inflight(): string[] {
    return [...this.running.keys()];
  }

  /** Invocation ids whose results wait for their acknowledgement. */
  get finished(): string[] {
    return [...this.unacked.keys()];
  }

  /**
   * Start serving in the background. Resolves once every URL's connection is up and
   * every function is registered (the worker keeps trying while the daemon cannot be
   * reached); rejects if the worker stops before that, at once when it cannot serve
   * (see `run()`).
   */
  start(): Promise<void> {
    if (!this.supervisor) {
      this.supervisor = this.supervise();
      this.supervisor.catch(() => {});
    }
    return this.firstConnect.promise;
  }

  /**
   * Serve until SIGTERM or SIGINT (or `stop()`), then drain: resolves once running
   * handlers have finished and their results are acknowledged, or
   * `drainTimeoutMs` has passed. Rejects when the worker cannot serve: its URL can
   * never work ({@link BadUrl}), the daemon refused its `hello` or a registration for
   * good, or its connection was superseded by another worker with the same `workerId`.
   */
  async run(): Promise<void> {
    const onSignal = () => {
      void this.stop();
    };
    process.once("SIGTERM", onSignal);
    process.once("SIGINT", onSignal);
    try {
      void this.start();
      await this.supervisor;
      await this.stopping;
    } finally {
      process.removeListener("SIGTERM", onSignal);
      process.removeListener("SIGINT", onSignal);
    }
  }

  /**
   * Stop: unregister every function so nothing new is dispatched, wait up to
   * `drainMs` (default `drainTimeoutMs`) for running handlers and unacknowledged
   * results, then abort what is left, give its `cancelled` answers a moment, and
   * close. Resolves when the worker has stopped.
   */
  stop(drainMs?: number): Promise<void> {
    if (!this.stopping) {
      this.stopping = this.drainAndHalt(drainMs ?? this.opts.drainTimeoutMs);
    }
    return this.stopping;
  }

  // ---- lifecycle -------------------------------------------------------------------

  private setState(state: WorkerState): void {
    if (this.currentState === state) return;
    if (this.currentState === "stopped") return;
    if (this.currentState === "draining" && state !== "stopped") return;
    this.currentState = state;
    this.emit("state", state);
  }

  private log(level: LogLevel, msg: string): void {
    this.logFn(level, msg);
  }

  private async drainAndHalt(drainMs: number): Promise<void> {
    this.draining = true;
    this.setState("draining");
    this.log("info", "draining: no new invocations");
    const unregistered = [...this.links.live.values()].flatMap(({ conn }) =>
      [...this.functions.keys()].map((functionId) => conn.request("function.unregister", { function_id: functionId })),
    );
    await Promise.allSettled(unregistered);
    if (!(await this.waitDrained(drainMs))) {
      this.log("warn", `drain: ${this.running.size} handlers still running after ${drainMs} ms; aborting them`);
      for (const r of this.running.values()) r.controller.abort(new Cancelled("worker stopping"));
      await this.waitDrained(Math.min(1000, this.opts.resultAckTimeoutMs));
    }
    this.halt.abort();
    this.links.wake();
    await Promise.all([...this.links.live.values()].map(({ conn }) => conn.close(1000, "worker stopping")));
    await this.supervisor?.catch(() => {});
    this.setState("stopped");
  }

  /** Resolves `true` once nothing runs and nothing waits for an ack, `false` after `ms`. */
  private async waitDrained(ms: number): Promise<boolean> {
    const deadline = Date.now() + ms;
    while (this.running.size > 0 || this.unacked.size > 0) {
      const left = deadline - Date.now();
      if (left <= 0 || !this.supervisor) return this.running.size === 0 && this.unacked.size === 0;
      await new Promise<void>((resolve) => {
        const timer = setTimeout(done, left);
        this.drainWaiters.push(done);
        function done() {
          clearTimeout(timer);
          resolve();
        }
      });
    }
    return true;
  }

  private notifyDrain(): void {
    const waiters = this.drainWaiters;
    this.drainWaiters = [];
    for (const w of waiters) w();
  }

  private async supervise(): Promise<void> {
    try {
      await this.links.supervise();
    } catch (err) {
      // Nothing more can be delivered: stop every handler and pump.
      const failure = err instanceof Error ? err : new Error(String(err));
      for (const r of this.running.values()) r.controller.abort(new Cancelled(failure.message));
      this.halt.abort();
      this.links.wake();
      this.notifyDrain();
      this.setState("stopped");
      this.firstConnect.reject(failure);
      throw failure;
    }
    this.firstConnect.reject(new Error("worker stopped before it connected"));
  }

  /** A connection is up: count it, resume what waits for it, and say when all are. */
  private linkUp(link: Link): void {
    this.counters.connections += 1;
    if (this.links.allUp) {
      this.setState("connected");
      this.firstConnect.resolve();
    }
    this.resumeAfterConnect(link);
  }

  private async connectAndRegister(index: number, url: string): Promise<Connection> {
    // Every invocation of the worker's, whichever connection it came on.
    const hello: HelloArgs = {
      protocol: PROTOCOL_VERSION,
      role: "worker",
      name: this.opts.name,
      worker_id: this.workerId,
      instance_id: this.instanceId,
      inflight: [...this.running.keys()].sort(),
      finished: [...this.unacked.keys()].sort(),
    };
    if (this.opts.token !== undefined) hello.token = this.opts.token;
    const { conn, hello: ok } = await Connection.open(url, hello, {
      connectTimeoutMs: this.opts.connectTimeoutMs,
      onPush: (push, c) => this.onPush(index, push, c),
    });
    if (ok.reconciled) {
      this.lastReconciled = ok.reconciled;
      const r = ok.reconciled;
      if (r.redispatched.length > 0 || r.unknown.length > 0) {
        this.log(
          "info",
          `reconciled: kept ${r.kept.length}, redispatched ${r.redispatched.join(",") || "-"}, unknown ${r.unknown.join(",") || "-"}`,
        );
      }
      this.emit("reconciled", ok.reconciled);
    }
    this.maxFrameBytes = conn.maxFrameBytes;
    try {
      for (const f of [...this.functions.values()].sort((a, b) => a.functionId.localeCompare(b.functionId))) {
        // A draining worker takes no new work, also after a reconnect.
        if (this.draining) break;
        const args: Record<string, unknown> = {
          function_id: f.functionId,
          concurrency: f.options.concurrency ?? 1,
        };
        if (f.options.timeoutMs !== undefined) args.timeout_ms = f.options.timeoutMs;
        if (f.options.delivery !== undefined) args.delivery = f.options.delivery;
        if (f.options.maxAttempts !== undefined) args.max_attempts = f.options.maxAttempts;
        await conn.request("function.register", args);
      }
    } catch (err) {
      conn.terminate();
      throw err;
    }
    return conn;
  }

  /** After a reconnect: every held result goes out again, the handlers it dispatched heartbeat. */
  private resumeAfterConnect(link: Link): void {
    for (const held of this.unacked.values()) held.wake();
    for (const [invocationId, r] of this.running) {
      if (r.autoHeartbeat && r.home === link.index) {
        void this.live.heartbeat({ conn: link.conn, atHome: true }, invocationId).catch(() => {});
      }
    }
  }

  /** The connection an invocation's requests go on now (`links.ts`). */
  private route(invocationId: string): Route | undefined {
    const home = (this.running.get(invocationId) ?? this.unacked.get(invocationId))?.home;
    const link = this.links.pick(home);
    return link && { conn: link.conn, atHome: link.index === home };
  }

  // ---- pushes ----------------------------------------------------------------------

  /** A push on the connection to `this.urls[index]`. */
  private onPush(index: number, push: PushFrame, conn: Connection): void {
    const invocationId = push.invocation_id;
    if (typeof invocationId !== "string") return;
    // The daemon that pushes about an invocation is the one that waits for it (after
    // a cluster's takeover, the partition's new leader).
    const known = this.running.get(invocationId) ?? this.unacked.get(invocationId);
    if (known) known.home = index;
    switch (push.push) {
      case "invoke":
        this.onInvoke(push, invocationId, index);
        break;
      case "cancel":
        this.onCancel(invocationId, String(push.reason ?? ""), index);
        break;
      case "probe":
        this.onProbe(conn, invocationId);
        break;
      default:
        break;
    }
  }

  private onInvoke(push: PushFrame, invocationId: string, home: number): void {
    if (this.running.has(invocationId)) return;
    const held = this.unacked.get(invocationId);
    if (held) {
      held.wake();
      return;
    }
    const functionId = String(push.function_id);
    const registered = this.functions.get(functionId);
    const controller = new AbortController();
    const autoHeartbeat = registered?.options.autoHeartbeat ?? true;
    this.running.set(invocationId, { controller, autoHeartbeat, stale: false, home });
    this.counters.invocationsStarted += 1;
    const turnId = String(push.turn_id);
    const step = Number(push.step);
    const deadlineMs = Number(push.deadline_ms);
    const ctx: TurnContext = {
      sessionId: String(push.session_id),
      turnId,
      functionId,
      step,
      attempt: Number(push.attempt),
      invocationId,
      idempotencyKey: `${turnId}/${step}`,
      deadlineMs,
      signal: controller.signal,
      heartbeat: () => {
        const route = this.route(invocationId);
        if (!route) return Promise.reject(new ConnectionError("not connected"));
        return this.live.heartbeat(route, invocationId);
      },
      progress: (data) => this.live.progress(invocationId, data),
      previous: previousFromWire(push.previous),
    };
    void this.runHandler(registered, ctx, push.input);
  }

  private async runHandler(registered: Registered | undefined, ctx: TurnContext, input: unknown): Promise<void> {
    const { invocationId } = ctx;
    let outcome: Outcome;
    if (!registered) {
      outcome = {
        fail: {
          code: "unknown_function",
          message: `this worker does not serve ${ctx.functionId}`,
          retryable: false,
        },
      };
    } else {
      const timeoutMs = registered.options.timeoutMs ?? Math.max(ctx.deadlineMs - Date.now(), 300);
      const stopBeats =
        registered.options.autoHeartbeat === false
          ? () => {}
          : this.live.heartbeatLoop(invocationId, timeoutMs, ctx.signal);
      try {
        outcome = outcomeOf(await registered.handler(ctx, input));
      } catch (err) {
        if (err instanceof Fail) {
          outcome = { fail: { code: err.code, message: err.message, retryable: err.retryable } };
        } else if (err instanceof Cancelled || ctx.signal.aborted) {
          outcome = { cancelled: { message: message(err) } };
        } else {
          const name = err instanceof Error ? err.name || "Error" : "Error";
          outcome = { fail: { code: name, message: message(err), retryable: false } };
        }
      } finally {
        stopBeats();
      }
    }
    this.holdResult(invocationId, this.sendable(invocationId, outcome));
  }

  private onCancel(invocationId: string, reason: string, index: number): void {
    const running = this.running.get(invocationId);
    if (running) {
      this.log("info", `cancel ${invocationId}: ${reason}`);
      running.controller.abort(new Cancelled(reason || "cancelled"));
      return;
    }
    const held = this.unacked.get(invocationId);
    if (held) {
      held.wake();
      return;
    }
    // Not running here (never received, or already delivered): say so.
    this.holdResult(invocationId, this.sendable(invocationId, { cancelled: { message: "not running" } }), index);
  }

  private onProbe(conn: Connection, invocationId: string): void {
    const running = this.running.get(invocationId);
    if (running) {
      // A heartbeat answers a pending probe and moves the deadline: the truth that
      // the handler is still working, without turning into a cancel.
      const answer = running.autoHeartbeat
        ? this.live.heartbeat({ conn, atHome: true }, invocationId).catch(() =>
            conn.request("invocation.status", { invocation_id: invocationId, state: "running" }),
          )
        : conn.request("invocation.status", { invocation_id: invocationId, state: "running" });
      answer.catch((err) => this.log("warn", `probe answer for ${invocationId} failed: ${message(err)}`));
      return;
    }
    const held = this.unacked.get(invocationId);
    const state = held ? "finished" : "unknown";
    conn
      .request("invocation.status", { invocation_id: invocationId, state })
      .catch((err) => this.log("warn", `probe answer for ${invocationId} failed: ${message(err)}`))
      .finally(() => held?.wake()); // the status first, then the result it promised
  }

  // ---- results ---------------------------------------------------------------------

  /**
   * The outcome as it can be sent: one that is not JSON, or whose frame the daemon
   * would refuse (closing the connection, so that resending would never end),
   * becomes a `fail` that says so.
   */
  private sendable(invocationId: string, outcome: Outcome): Sendable {
    let args: string;
    try {
      args = resultArgs(invocationId, outcome);
    } catch (err) {
      return failed(invocationId, "invalid_output", `result is not JSON: ${message(err)}`);
    }
    const size = RESULT_FRAME_BYTES + Buffer.byteLength(args);
    if (size > this.maxFrameBytes) {
      return failed(
        invocationId,
        "too_large",
        `result frame of ${size} bytes exceeds the daemon's max_frame_bytes ${this.maxFrameBytes}`,
      );
    }
    return { args, fails: "fail" in outcome };
  }

  private holdResult(invocationId: string, { args, fails }: Sendable, home = 0): void {
    const running = this.running.get(invocationId);
    this.running.delete(invocationId);
    let wake: () => void = () => {};
    const held: Held = {
      args,
      fails,
      home: running?.home ?? home,
      wake: () => wake(),
    };
    const wakeup = () =>
      new Promise<void>((resolve) => {
        wake = resolve;
      });
    this.unacked.set(invocationId, held);
    void this.pump(invocationId, held, wakeup);
  }

  private release(invocationId: string, held: Held): void {
    if (this.unacked.get(invocationId) === held) this.unacked.delete(invocationId);
    this.notifyDrain();
  }

  /** Deliver one result until the daemon acknowledges it (or refuses it for good). */
  private async pump(invocationId: string, held: Held, wakeup: () => Promise<void>): Promise<void> {
    const ackMs = this.opts.resultAckTimeoutMs;
    // Generations of connections gone, or whose daemon never stored the invocation.
    const dead = new Set<number>();
    let first = true;
    for (;;) {
      const link = await this.links.wait(() => held.home, dead);
      // A halt while it waited woke the round before's wakeup, not this one's.
      if (!link || this.halt.signal.aborted) return;
      if (first) this.counters.resultsSent += 1;
      else this.counters.resultsResent += 1;
      first = false;
      const woken = wakeup();
      let timer: NodeJS.Timeout | undefined;
      const result = await Promise.race([
        link.conn.requestWithArgs("invocation.result", held.args).then(
          (ok) => ({ kind: "ok" as const, ok }),
          (err: unknown) => ({ kind: "err" as const, err }),
        ),
        woken.then(() => ({ kind: "wake" as const })),
        new Promise<{ kind: "timeout" }>((resolve) => {
          timer = setTimeout(() => resolve({ kind: "timeout" }), ackMs);
        }),
      ]);
      clearTimeout(timer);
      switch (result.kind) {
        case "ok": {
          const accepted = (result.ok as { accepted?: string }).accepted;
          if (accepted === "unknown" && link.index !== held.home) {
            // Not a node of one cluster with the daemon that dispatched it (that one
            // would have forwarded it): wait for that daemon's connection.
            dead.add(link.generation);
            continue;
          }
          this.counters.resultsAcked += 1;
          this.log("debug", `${invocationId}: result ${accepted}`);
          this.release(invocationId, held);
          return;
        }
        case "wake":
        case "timeout":
          continue;
        case "err": {
          const err = result.err;
          if (err instanceof ConnectionError) {
            dead.add(link.generation);
            continue;
          }
          if (err instanceof TurndError && err.code === "too_large" && !held.fails) {
            // Nested deeper than the daemon's max_json_depth (which `hello` does not
            // say): the handler's answer can never be delivered, but that fact can.
            this.log("error", `${invocationId}: result refused (${err.message}); sending it as a fail`);
            Object.assign(held, failed(invocationId, "too_large", `result refused: ${err.message}`));
            continue;
          }
          if (err instanceof TurndError && !err.retryable) {
            this.log("error", `${invocationId}: result refused (${err.message}); dropping it`);
            this.counters.resultsDropped += 1;
            this.release(invocationId, held);
            return;
          }
          this.log("warn", `${invocationId}: result not taken yet (${message(err)}); resending later`);
          await Promise.race([sleep(ackMs, this.halt.signal), wakeup()]);
          continue;
        }
      }
    }
  }
}
