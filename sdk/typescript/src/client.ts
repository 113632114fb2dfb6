/**
 * The caller side: `connect()` gives a {@link Client} with one method per client op
 * (`submit` with what to do when the session is busy, `resume` of a turn awaiting
 * input), and `watch()` / `stream()` streams of events and progress that survive
 * reconnects.
 *
 * The client reconnects on its own (capped, jittered backoff). A request cut by a
 * lost connection is sent again on the next connection when that is safe: every op
 * except a `turn.submit` or `turn.resume` without an idempotency key, which rejects
 * with {@link ConnectionError} instead (it may or may not have been admitted), and
 * any op at all when the daemon closed the connection with 1001 (it answered every
 * request it read, so one with no answer was never read).
 */
import { EventEmitter } from "node:events";
import {
  CLOSE_GOING_AWAY,
  Connection,
  type HelloArgs,
  type HelloOk,
  PROTOCOL_VERSION,
  type PushFrame,
} from "./connection.js";
import { ConnectionError, isRetryable, TurndError } from "./errors.js";
import {
  type Event,
  type EventPage,
  eventFromWire,
  type FunctionInfo,
  functionFromWire,
  isProgress,
  isProgressDropped,
  isTerminal,
  type Session,
  type SessionPage,
  type SessionsListOptions,
  type Stats,
  type SubmittedTurn,
  sessionFromWire,
  sessionPageFromWire,
  statsFromWire,
  type Turn,
  type TurnPage,
  type TurnStatus,
  turnFromWire,
  type WatchItem,
  type WorkerInfo,
  watchItemFromWire,
  workerFromWire,
} from "./types.js";

export interface ClientOptions {
  /**
   * Daemon URL, e.g. `ws://127.0.0.1:7420/v1`; or the URLs of a cluster's nodes: the
   * client connects to the first that answers, and moves on to the next when a
   * connection cannot be opened, when reconnecting too.
   */
  url: string | readonly string[];
  /** Token for the role, when the daemon requires one. */
  token?: string;
  /** `client` (default) or `operator`. */
  role?: "client" | "operator";
  /** Name sent in `hello`. */
  name?: string;
  /** First reconnect delay (default 100); doubled per failed attempt, jittered. */
  reconnectDelayMs?: number;
  /** Cap of the reconnect delay (default 5000). */
  maxReconnectDelayMs?: number;
  /**
   * How long a request waits for a connection before it fails with
   * {@link ConnectionError} (default 30000).
   */
  reconnectTimeoutMs?: number;
  /** Handshake and `hello` timeout per attempt (default 10000). */
  connectTimeoutMs?: number;
}

export interface SubmitOptions {
  /** The same key in the same session returns the existing turn (`deduplicated: true`). */
  idempotencyKey?: string;
  /** Fail the turn (`timed_out`) when it is not finished this long after admission. */
  turnTimeoutMs?: number;
  /**
   * When the session has an unfinished turn: `enqueue` (the daemon's default) queues
   * behind it; `reject` throws {@link BusyError} and stores nothing; `interrupt` stops
   * the unfinished turns (reason `interrupted`) and gives this turn's step 0 the
   * stopped one as `ctx.previous`; `rollback` does the same and marks them `superseded`.
   */
  onBusy?: OnBusy;
}

export type OnBusy = "enqueue" | "reject" | "interrupt" | "rollback";

export interface ResumeOptions {
  /**
   * The same key with the same input returns the winner's turn (`deduplicated: true`)
   * and makes the resume safe to send again after a lost connection.
   */
  idempotencyKey?: string;
}

export type WatchTarget = { sessionId: string; turnId?: never } | { turnId: string; sessionId?: never };

export interface WatchOptions {
  /**
   * Replay events with `seq > after` first. Default: the session's last event at
   * the time of the call, i.e. only new events.
   */
  after?: number;
  /**
   * Also yield the `progress` frames of the watched turns and `progress_dropped`
   * markers (default false). Progress is not stored: frames sent while the watch
   * replays or reconnects come as a marker, never as a silent gap.
   */
  progress?: boolean;
}

/** What the client routes a watch's pushes to, whatever the stream yields. */
interface WatchRoute {
  watchId: string | undefined;
  generation: number;
  deliver(item: WatchItem): void;
  reopen(generation: number, first?: boolean): Promise<void>;
  fail(err: unknown): void;
  end(): void;
}

export type ClientState = "connected" | "disconnected" | "closed";

/** The most `turn.wait` may wait per request (protocol limit). */
const WAIT_MAX_MS = 300_000;

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/**
 * Whether `conn` ended with the daemon's 1001 close frame, once it has ended (a
 * request can fail while the close handshake is still under way).
 */
async function wentAway(conn: Connection): Promise<boolean> {
  await conn.closed;
  return conn.closeCode === CLOSE_GOING_AWAY;
}

/** Connect with role `client` (or `operator`) and say `hello`. */
export async function connect(options: ClientOptions): Promise<Client> {
  const client = new Client(options);
  await client.connection();
  return client;
}

/**
 * A caller connection. Events: `state` ({@link ClientState}), emitted on every
 * change.
 */
export class Client extends EventEmitter {
  private readonly opts: ClientOptions;
  /** Every URL the client may connect to, in the order it tries them. */
  readonly urls: readonly string[];
  /** The index in `urls` of the current connection's URL (or of the next one tried). */
  private at = 0;
  private conn: Connection | null = null;
  private connecting: Promise<Connection> | null = null;
  private closedByUser = false;
  private generation = 0;
  /** Watch streams by watch id on the current connection. */
  private routes = new Map<string, WatchRoute>();
  /** Every open watch stream (re-opened after a reconnect). */
  private readonly watches = new Set<WatchRoute>();
  private lastHello: HelloOk | undefined;

  constructor(options: ClientOptions) {
    super();
    this.opts = options;
    this.urls = typeof options.url === "string" ? [options.url] : [...options.url];
    if (this.urls.length === 0) throw new TypeError("a client needs at least one URL");
  }

  /** The URL of the current connection (or of the next one tried). */
  get url(): string {
    return this.urls[this.at] as string;
  }

  /** The `hello` answer of the current (or last) connection. */
  get hello(): HelloOk | undefined {
    return this.lastHello;
  }

  /** The connection, opened (again) when needed. */
  connection(): Promise<Connection> {
    if (this.closedByUser) return Promise.reject(new ConnectionError("client closed"));
    if (this.conn?.isOpen) return Promise.resolve(this.conn);
    if (!this.connecting) {
      this.connecting = this.open().finally(() => {
        this.connecting = null;
      });
    }
    return this.connecting;
  }

  private async open(): Promise<Connection> {
    const base = this.opts.reconnectDelayMs ?? 100;
    const cap = Math.max(base, this.opts.maxReconnectDelayMs ?? 5000);
    const giveUp = Date.now() + (this.opts.reconnectTimeoutMs ?? 30_000);
    let delay = base;
    let failed = 0; // URLs that failed since the last wait
    for (;;) {
      const hello: HelloArgs = {
        protocol: PROTOCOL_VERSION,
        role: this.opts.role ?? "client",
        name: this.opts.name ?? "turnd-typescript",
      };
      if (this.opts.token !== undefined) hello.token = this.opts.token;
      try {
        let opened: Connection | undefined;
        const { conn, hello: ok } = await Connection.open(this.url, hello, {
          connectTimeoutMs: this.opts.connectTimeoutMs ?? 10_000,
          onPush: (push, c) => this.onPush(push, c),
          onClose: () => {
            if (opened !== undefined) this.onConnectionClosed(opened);
          },
        });
        opened = conn;
        if (this.closedByUser) {
          await conn.close();
          throw new ConnectionError("client closed");
        }
        if (!conn.isOpen) throw new ConnectionError("connection closed right after hello");
        this.conn = conn;
        this.lastHello = ok;
        this.generation += 1;
        this.routes = new Map();
        this.emit("state", "connected" satisfies ClientState);
        for (const w of this.watches) w.reopen(this.generation);
        return conn;
      } catch (err) {
        // A URL that can never work, a refused `hello`: the same again would fail again.
        if (!isRetryable(err)) throw err;
        if (this.closedByUser) throw new ConnectionError("client closed");
        if (Date.now() >= giveUp) throw err;
        this.at = (this.at + 1) % this.urls.length;
        failed += 1;
        if (failed < this.urls.length) continue; // the next URL at once
        failed = 0;
        await sleep(Math.min(delay / 2 + (Math.random() * delay) / 2, Math.max(0, giveUp - Date.now())));
        delay = Math.min(delay * 2, cap);
      }
    }
  }

  private onConnectionClosed(conn: Connection): void {
    if (this.conn !== conn) return;
    this.conn = null;
    this.routes = new Map();
    if (this.closedByUser) return;
    this.emit("state", "disconnected" satisfies ClientState);
    if (this.watches.size > 0) {
      // Watches resume on the next connection; open it now rather than on the next request.
      this.connection().catch((err: unknown) => {
        for (const w of this.watches) w.fail(err);
      });
    }
  }

  private onPush(push: PushFrame, conn: Connection): void {
    if (conn !== this.conn) return;
    const item = watchItemFromWire(push);
    if (item === undefined) return;
    this.routes.get(String(push.watch_id))?.deliver(item);
  }

  /**
   * Send any request and return its `ok` value. `retry` (default true) sends it again
   * on the next connection when the connection ends before the answer; without it,
   * the request is sent again only when the daemon closed the connection with 1001
   * (it had answered every request it read, so this one was never read).
   */
  async request(op: string, args: Record<string, unknown> = {}, retry = true): Promise<unknown> {
    for (;;) {
      const conn = await this.connection();
      try {
        return await conn.request(op, args);
      } catch (err) {
        if (!(err instanceof ConnectionError) || this.closedByUser) throw err;
        if (retry || (await wentAway(conn))) continue;
        throw err;
      }
    }
  }

  /** `turn.submit`: admit a turn to `sessionId`. */
  async submit(
    sessionId: string,
    functionId: string,
    input: unknown = null,
    options: SubmitOptions = {},
  ): Promise<SubmittedTurn> {
    const args: Record<string, unknown> = { session_id: sessionId, function_id: functionId, input };
    if (options.idempotencyKey !== undefined) args.idempotency_key = options.idempotencyKey;
    if (options.turnTimeoutMs !== undefined) args.turn_timeout_ms = options.turnTimeoutMs;
    if (options.onBusy !== undefined) args.on_busy = options.onBusy;
    // Without a key a repeat could admit the turn twice: only a keyed submit is resent.
    return this.submitted(await this.request("turn.submit", args, options.idempotencyKey !== undefined));
  }

  /**
   * `turn.resume`: answer a turn awaiting input; its next step runs with
   * `{ state: <the suspend's state>, input }`. Resolves once the resume is durable.
   * A turn that is not awaiting input rejects with `conflict` and nothing changes;
   * of two resumes exactly one wins. Only a resume with an idempotency key is sent
   * again after a lost connection.
   */
  async resume(turnId: string, input: unknown = null, options: ResumeOptions = {}): Promise<SubmittedTurn> {
    const args: Record<string, unknown> = { turn_id: turnId, input };
    if (options.idempotencyKey !== undefined) args.idempotency_key = options.idempotencyKey;
    return this.submitted(await this.request("turn.resume", args, options.idempotencyKey !== undefined));
  }

  private submitted(answer: unknown): SubmittedTurn {
    const ok = answer as { turn: unknown; deduplicated: boolean };
    return { ...turnFromWire(ok.turn), deduplicated: ok.deduplicated === true };
  }

  /** `turn.get`. */
  async get(turnId: string): Promise<Turn> {
    const ok = (await this.request("turn.get", { turn_id: turnId })) as { turn: unknown };
    return turnFromWire(ok.turn);
  }

  /**
   * Wait until the turn is terminal (repeating `turn.wait` as needed). With
   * `timeoutMs`, resolves with the turn as it is when that time has passed.
   */
  async wait(turnId: string, options: { timeoutMs?: number } = {}): Promise<Turn> {
    const deadline = options.timeoutMs === undefined ? Number.POSITIVE_INFINITY : Date.now() + options.timeoutMs;
    for (;;) {
      const left = Math.max(0, Math.min(WAIT_MAX_MS, deadline - Date.now()));
      const ok = (await this.request("turn.wait", { turn_id: turnId, timeout_ms: Math.round(left) })) as {
        turn: unknown;
      };
      const turn = turnFromWire(ok.turn);
      if (isTerminal(turn.status) || Date.now() >= deadline) return turn;
    }
  }

  /** `turn.stop`: the turn as it is after the stop was recorded. */
  async stop(turnId: string, reason?: string): Promise<Turn> {
    const args: Record<string, unknown> = { turn_id: turnId };
    if (reason !== undefined) args.reason = reason;
    const ok = (await this.request("turn.stop", args)) as { turn: unknown };
    return turnFromWire(ok.turn);
  }

  /** `session.stop`: every unfinished turn of the session, as it is after the stop. */
  async stopSession(sessionId: string, reason?: string): Promise<Turn[]> {
    const args: Record<string, unknown> = { session_id: sessionId };
    if (reason !== undefined) args.reason = reason;
    const ok = (await this.request("session.stop", args)) as { turns: unknown[] };
    return ok.turns.map(turnFromWire);
  }

  /** `turn.list`: newest first. */
  async list(
    sessionId: string,
    options: { status?: TurnStatus; limit?: number; beforeSeq?: number } = {},
  ): Promise<TurnPage> {
    const args: Record<string, unknown> = { session_id: sessionId };
    if (options.status !== undefined) args.status = options.status;
    if (options.limit !== undefined) args.limit = options.limit;
    if (options.beforeSeq !== undefined) args.before_seq = options.beforeSeq;
    const ok = (await this.request("turn.list", args)) as { turns: unknown[]; next_before_seq: number | null };
    return { turns: ok.turns.map(turnFromWire), nextBeforeSeq: ok.next_before_seq ?? null };
  }

  /** `session.inspect`. */
  async inspect(sessionId: string): Promise<Session> {
    const ok = (await this.request("session.inspect", { session_id: sessionId })) as { session: unknown };
    return sessionFromWire(ok.session);
  }

  /** `session.events`: events with `seq > after`, ascending. */
  async events(sessionId: string, options: { after?: number; limit?: number } = {}): Promise<EventPage> {
    const args: Record<string, unknown> = { session_id: sessionId };
    if (options.after !== undefined) args.after = options.after;
    if (options.limit !== undefined) args.limit = options.limit;
    const ok = (await this.request("session.events", args)) as { events: unknown[]; next: number };
    return { events: ok.events.map(eventFromWire), next: ok.next };
  }

  /**
   * Stream the events of a session or of one turn (with `progress: true`, also its
   * progress frames and `progress_dropped` markers). The stream resumes after a
   * reconnect from the last event it delivered, so it has no gap and no repeat.
   * End it with `close()` or by leaving a `for await` loop.
   */
  watch(target: WatchTarget, options?: WatchOptions & { progress?: false }): Promise<WatchStream<Event>>;
  watch(target: WatchTarget, options: WatchOptions & { progress: true }): Promise<WatchStream<WatchItem>>;
  watch(target: WatchTarget, options?: WatchOptions): Promise<WatchStream<WatchItem>>;
  async watch(target: WatchTarget, options: WatchOptions = {}): Promise<WatchStream<Event> | WatchStream<WatchItem>> {
    let after = options.after;
    if (after === undefined) after = await this.lastEventOf(target);
    const stream = await this.openStream(target, after, options.progress === true, false);
    // Without progress the daemon pushes events only.
    return options.progress === true ? stream : (stream as unknown as WatchStream<Event>);
  }

  /**
   * One turn's events and progress from its first event (or `after`), ending after
   * the event that makes the turn terminal (`completed`, `failed`, `cancelled`); at
   * once for a turn already done. Resumes after a reconnect like {@link watch}.
   */
  stream(turnId: string, options: { after?: number } = {}): Promise<WatchStream<WatchItem>> {
    return this.openStream({ turnId }, options.after ?? 0, true, true);
  }

  private async openStream(
    target: WatchTarget,
    after: number,
    progress: boolean,
    untilDone: boolean,
  ): Promise<WatchStream<WatchItem>> {
    const args: Record<string, unknown> =
      target.turnId !== undefined ? { turn_id: target.turnId } : { session_id: target.sessionId };
    if (progress) args.progress = true;
    const stream = new WatchStream<WatchItem>(this, args, after, untilDone);
    this.watches.add(stream);
    try {
      await stream.reopen(this.generation, true);
    } catch (err) {
      this.watches.delete(stream);
      throw err;
    }
    return stream;
  }

  private async lastEventOf(target: WatchTarget): Promise<number> {
    const sessionId = target.turnId !== undefined ? (await this.get(target.turnId)).sessionId : target.sessionId;
    try {
      return (await this.inspect(sessionId)).lastEvent;
    } catch (err) {
      // A session without turns has no events yet.
      if (err instanceof TurndError && err.code === "not_found") return 0;
      throw err;
    }
  }

  /** Send `watch` on the current connection and route its events to `stream`. */
  async openWatch(stream: WatchRoute, args: Record<string, unknown>): Promise<void> {
    const conn = await this.connection();
    const generation = this.generation;
    await conn.request("watch", args, (ok) => {
      // Runs as the answer is read, before any event frame that follows it.
      const watchId = String((ok as { watch_id: unknown }).watch_id);
      if (stream.generation === generation) {
        // Opened twice on one connection (a reconnect raced the first open): one is enough.
        conn.request("unwatch", { watch_id: watchId }).catch(() => {});
        return;
      }
      if (this.conn === conn && this.generation === generation) {
        this.routes.set(watchId, stream);
        stream.watchId = watchId;
        stream.generation = generation;
      }
    });
  }

  /** Stop routing to `stream` and tell the daemon. */
  async closeWatch(stream: WatchRoute): Promise<void> {
    this.watches.delete(stream);
    const watchId = stream.watchId;
    if (watchId === undefined || stream.generation !== this.generation) return;
    this.routes.delete(watchId);
    const conn = this.conn;
    if (conn?.isOpen) await conn.request("unwatch", { watch_id: watchId }).catch(() => {});
  }

  /** `stats`. */
  async stats(): Promise<Stats> {
    return statsFromWire(((await this.request("stats")) as { stats: unknown }).stats);
  }

  /**
   * `sessions.list`: the sessions with an unfinished turn, one row per session
   * describing its lock holder; `stuck: true` finds the ones that need a look.
   */
  async sessions(options: SessionsListOptions = {}): Promise<SessionPage> {
    const args: Record<string, unknown> = {};
    if (options.state !== undefined) args.state = options.state;
    if (options.functionId !== undefined) args.function_id = options.functionId;
    if (options.stuck !== undefined) args.stuck = options.stuck;
    if (options.order !== undefined) args.order = options.order;
    if (options.limit !== undefined) args.limit = options.limit;
    if (options.after !== undefined) args.after = options.after;
    return sessionPageFromWire(await this.request("sessions.list", args));
  }

  /** Every page of `sessions.list` from `options.after` on, following `next`. */
  async *sessionPages(options: SessionsListOptions = {}): AsyncGenerator<SessionPage, void, undefined> {
    let after = options.after;
    for (;;) {
      const page = await this.sessions(after === undefined ? options : { ...options, after });
      yield page;
      if (page.next === null) return;
      after = page.next;
    }
  }

  /** `workers.list`. */
  async workers(): Promise<WorkerInfo[]> {
    return ((await this.request("workers.list")) as { workers: unknown[] }).workers.map(workerFromWire);
  }

  /** `functions.list`. */
  async functions(): Promise<FunctionInfo[]> {
    return ((await this.request("functions.list")) as { functions: unknown[] }).functions.map(functionFromWire);
  }

  /** `ping`. */
  async ping(): Promise<void> {
    await this.request("ping");
  }

  /** Close the connection; open watches end. */
  async close(): Promise<void> {
    if (this.closedByUser) return;
    this.closedByUser = true;
    for (const w of [...this.watches]) w.end();
    this.watches.clear();
    const conn = this.conn;
    this.conn = null;
    await conn?.close();
    this.emit("state", "closed" satisfies ClientState);
  }
}

/**
 * The items of one watch as an async iterator: events in `seq` order and, when the
 * watch asked for progress, progress frames (in `seq` order per invocation) and
 * `progress_dropped` markers. Ends when closed, when the client is closed, or (a
 * `stream()`) after the turn's terminal event.
 */
export class WatchStream<T extends WatchItem = Event> implements AsyncIterableIterator<T>, WatchRoute {
  /** The watch id on the current connection. */
  watchId: string | undefined;
  /** The connection generation `watchId` belongs to. */
  generation = -1;
  private lastSeq: number;
  private readonly queue: T[] = [];
  private waiter: ((r: IteratorResult<T>) => void) | undefined;
  private failWaiter: ((err: unknown) => void) | undefined;
  private error: unknown;
  private done = false;
  private closed = false;
  /** Per invocation, the progress `seq` this watch expects next. */
  private readonly expected = new Map<string, number>();

  constructor(
    private readonly client: Client,
    private readonly args: Record<string, unknown>,
    after: number,
    private readonly untilDone = false,
  ) {
    this.lastSeq = after;
  }

  /** The `seq` of the last event delivered (or the starting point). */
  get after(): number {
    return this.lastSeq;
  }

  /** (Re)open the watch on the client's current connection, from the last delivered event. */
  async reopen(generation: number, first = false): Promise<void> {
    if (this.done || (!first && this.generation === generation)) return;
    try {
      await this.client.openWatch(this, { ...this.args, after: this.lastSeq });
    } catch (err) {
      if (first) throw err;
      if (err instanceof ConnectionError) return; // the next connection reopens it
      this.fail(err);
    }
  }

  /**
   * An item pushed for this watch. Events already delivered (a replay after a
   * reconnect) are dropped; a progress frame past the one expected, with no marker
   * from the daemon for the frames between (sent while the watch was away), is
   * preceded by a `progress_dropped` marker for them.
   */
  deliver(item: WatchItem): void {
    if (this.done) return;
    if (isProgress(item)) {
      const expected = this.expected.get(item.invocationId);
      this.expected.set(item.invocationId, item.seq + 1);
      if (expected !== undefined && item.seq > expected) {
        const { turnId, invocationId } = item;
        this.push({ kind: "progress_dropped", turnId, invocationId, count: item.seq - expected });
      }
    } else if (isProgressDropped(item)) {
      const expected = this.expected.get(item.invocationId);
      if (expected !== undefined) this.expected.set(item.invocationId, expected + item.count);
    } else {
      if (item.seq <= this.lastSeq) return;
      this.lastSeq = item.seq;
      if (this.untilDone && isTerminal(item.kind as TurnStatus)) {
        this.push(item);
        void this.close();
        return;
      }
    }
    this.push(item);
  }

  private push(item: WatchItem): void {
    if (this.waiter) {
      const w = this.waiter;
      this.waiter = undefined;
      this.failWaiter = undefined;
      w({ value: item as T, done: false });
    } else {
      this.queue.push(item as T);
    }
  }

  /** End the stream with an error (the watch could not be reopened). */
  fail(err: unknown): void {
    if (this.done) return;
    this.error = err;
    this.done = true;
    if (this.failWaiter) {
      const f = this.failWaiter;
      this.waiter = undefined;
      this.failWaiter = undefined;
      f(err);
    }
  }

  /** End the stream without telling the daemon (the client is closing). */
  end(): void {
    this.done = true;
    if (this.waiter) {
      const w = this.waiter;
      this.waiter = undefined;
      this.failWaiter = undefined;
      w({ value: undefined, done: true });
    }
  }

  next(): Promise<IteratorResult<T>> {
    const item = this.queue.shift();
    if (item) return Promise.resolve({ value: item, done: false });
    if (this.error !== undefined) return Promise.reject(this.error);
    if (this.done) return Promise.resolve({ value: undefined, done: true });
    return new Promise((resolve, reject) => {
      this.waiter = resolve;
      this.failWaiter = reject;
    });
  }

  /** Stop watching (`unwatch`); the iterator ends. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.end();
    await this.client.closeWatch(this);
  }

  async return(): Promise<IteratorResult<T>> {
    await this.close();
    return { value: undefined, done: true };
  }

  [Symbol.asyncIterator](): AsyncIterableIterator<T> {
    return this;
  }
}
