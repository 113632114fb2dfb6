/**
 * Typed objects of protocol v1 (docs/protocol.md, "Objects"), with camelCase names.
 * Opaque values (`input`, `output`, event `detail`) are passed through unchanged.
 */

/** A JSON value as the daemon stores it. */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

export type TurnStatus = "queued" | "running" | "completed" | "failed" | "cancelled";

export type WaitState =
  | "queued_behind"
  | "awaiting_worker"
  | "awaiting_result"
  | "awaiting_reconnect"
  | "backing_off"
  | "cancelling"
  | "finalizing"
  | "held"
  | "awaiting_input";

export type OnDeadline = "probe" | "redispatch" | "fail" | "cancel" | "retry" | "dispatch" | "continue";

/** Why a turn is not finished yet, and what happens at `deadlineMs`. */
export interface Wait {
  state: WaitState;
  reason: string;
  sinceMs: number;
  deadlineMs: number | null;
  onDeadline: OnDeadline | null;
  invocationId?: string;
  workerId?: string;
  ahead?: number;
  lastError?: string;
}

/** The error of a failed turn. */
export interface TurnError {
  /**
   * `handler_failed`, `outcome_unknown`, `timed_out`, `no_worker`, `attempts_exhausted`,
   * `step_limit`, `invalid_result`, `input_timeout` (a suspended turn not resumed in time).
   */
  cause: string;
  code: string;
  message: string;
  step: number;
  invocationId?: string;
}

/** The stop record of a stopped or cancelled turn. */
export interface TurnStop {
  requestedAtMs: number;
  reason: string;
}

/** The last progress frame of a turn's live invocation; in the daemon's memory only. */
export interface TurnProgress {
  invocationId: string;
  step: number;
  attempt: number;
  /** Counts the invocation's accepted frames from 1. */
  seq: number;
  data: unknown;
  atMs: number;
}

/** What a turn awaiting input asks; answer it with `Client.resume`. */
export interface InputRequest {
  /** The suspend's `prompt` (`undefined` when it gave none). */
  prompt?: unknown;
  sinceMs: number;
  deadlineMs: number | null;
  onTimeout: "fail" | "continue";
}

export interface Turn {
  turnId: string;
  sessionId: string;
  seq: number;
  functionId: string;
  status: TurnStatus;
  step: number;
  attempt: number;
  input: unknown;
  /** Present when `completed`. */
  output?: unknown;
  /** Present when `failed`. */
  error?: TurnError;
  stop?: TurnStop;
  /** `true` when a late result completed a turn that had failed as outcome unknown. */
  recovered: boolean;
  createdAtMs: number;
  updatedAtMs: number;
  finishedAtMs?: number;
  /** Present while the turn is not terminal. */
  wait?: Wait;
  /** The live invocation's last progress frame, while there is one. */
  progress?: TurnProgress;
  /** Present while the turn is awaiting input. */
  inputRequest?: InputRequest;
  /** `true` when a submit with `onBusy: "rollback"` stopped the turn. */
  superseded: boolean;
}

/** `turn.submit`'s answer: the turn, and whether an earlier submit with the same idempotency key made it. */
export interface SubmittedTurn extends Turn {
  deduplicated: boolean;
}

export interface QueuedTurn {
  turnId: string;
  seq: number;
  functionId: string;
  createdAtMs: number;
}

export interface Session {
  sessionId: string;
  lock: { turnId: string; sinceMs: number; wait: Wait } | null;
  queued: QueuedTurn[];
  turns: Record<TurnStatus, number>;
  lastEvent: number;
}

export type EventKind =
  | "admitted"
  | "dispatched"
  | "redispatched"
  | "result"
  | "retry_scheduled"
  | "outcome_unknown"
  | "probe_sent"
  | "stop_requested"
  | "cancel_sent"
  | "completed"
  | "failed"
  | "cancelled"
  | "late_result"
  | "amended"
  | "suspended"
  | "resumed";

/** One entry of a session's event log. `seq` counts per session, from 1. */
export interface Event {
  seq: number;
  sessionId: string;
  turnId: string;
  atMs: number;
  kind: EventKind | (string & {});
  detail: Record<string, unknown>;
}

/**
 * A progress frame pushed to a watch that asked for progress: partial output of the
 * invocation `invocationId`, whose frames `seq` counts from 1.
 */
export interface Progress {
  kind: "progress";
  turnId: string;
  invocationId: string;
  step: number;
  attempt: number;
  seq: number;
  data: unknown;
}

/** `count` progress frames of `invocationId` the watch did not get (it read too slowly, replayed, or reconnected). */
export interface ProgressDropped {
  kind: "progress_dropped";
  turnId: string;
  invocationId: string;
  count: number;
}

/** What a watch that asked for progress yields; tell them apart with {@link isEvent}, {@link isProgress}, {@link isProgressDropped}. */
export type WatchItem = Event | Progress | ProgressDropped;

/** Whether a watch item is an event (of the session's log). */
export function isEvent(item: WatchItem): item is Event {
  return "sessionId" in item;
}

/** Whether a watch item is a progress frame. */
export function isProgress(item: WatchItem): item is Progress {
  return !isEvent(item) && item.kind === "progress";
}

/** Whether a watch item is a `progress_dropped` marker. */
export function isProgressDropped(item: WatchItem): item is ProgressDropped {
  return !isEvent(item) && item.kind === "progress_dropped";
}

export interface TurnPage {
  turns: Turn[];
  /** Pass as `beforeSeq` for the next (older) page; `null` when there is none. */
  nextBeforeSeq: number | null;
}

export interface EventPage {
  events: Event[];
  /** Pass as `after` for the next page. */
  next: number;
}

export interface WorkerInfo {
  workerId: string;
  name: string;
  connected: boolean;
  instanceId: string;
  sinceMs: number;
  functions: string[];
  inflight: number;
}

export interface FunctionInfo {
  functionId: string;
  concurrency: number;
  timeoutMs: number;
  delivery: "at_most_once" | "at_least_once";
  maxAttempts: number;
  /** Connected workers serving it now. */
  workers: number;
  /** Sessions waiting for a worker of it (not turns). */
  queued: number;
  /**
   * `false` for a function no worker has registered since the daemon started, listed
   * only because turns wait for it: `concurrency`, `timeoutMs`, `delivery` and
   * `maxAttempts` are then placeholders (0, 0, `at_most_once`, 1), not settings.
   */
  registered: boolean;
}

/** Counts by wait state; only the states with a non-zero count are present. */
export type WaitCounts = Partial<Record<WaitState, number>>;

/** `stats`: the daemon's counters at one moment. */
export interface Stats {
  sessions: {
    /** Sessions with an unfinished turn. */
    active: number;
    /** Those sessions by the wait state of their lock holder. */
    blocked: WaitCounts;
  };
  turns: Record<TurnStatus, number>;
  /** Sessions with a live invocation. */
  invocationsInflight: number;
  workersConnected: number;
  /** Age of the oldest lock holder's wait; `null` when no session is active. */
  oldestWaitMs: number | null;
  storage: { writable: boolean; lastError: string | null };
}

/** `sessions.list` filters and paging. */
export interface SessionsListOptions {
  /** Only sessions whose lock holder waits in this state (a holder is never `queued_behind`). */
  state?: WaitState;
  /** Only sessions whose lock holder runs this function. */
  functionId?: string;
  /**
   * `true`: only sessions that look stuck (the wait's deadline has passed, it waits
   * for a worker of a function no connected worker serves, or its invocation has had
   * no dispatch or heartbeat for more than half its `timeout_ms`).
   */
  stuck?: boolean;
  /** `wait` (default): oldest wait first; `id`: by session id. */
  order?: "wait" | "id";
  /** Rows per page, 1–1000 (default 100). */
  limit?: number;
  /** The `next` of the previous page (taken with the same `order`). */
  after?: string;
}

/** One session with an unfinished turn, described by its lock holder. */
export interface SessionRow {
  sessionId: string;
  /** The lock holder. */
  turnId: string;
  functionId: string;
  step: number;
  attempt: number;
  /** When the holder took the session's lock. */
  lockedSinceMs: number;
  /** Unfinished turns behind the holder. */
  queued: number;
  stuck: boolean;
  wait: Wait;
}

/** One page of `sessions.list`. */
export interface SessionPage {
  sessions: SessionRow[];
  /** Pass as `after` for the next page; `null` on the last page. */
  next: string | null;
  /** Sessions matching every filter, when the page was taken. */
  total: number;
  /** Sessions matching `functionId` and `stuck`, by wait state, when the page was taken. */
  counts: WaitCounts;
}

/** What the daemon did with a reconnecting worker's invocations (`hello.reconciled`). */
export interface Reconciled {
  kept: string[];
  redispatched: string[];
  unknown: string[];
}

const TERMINAL: ReadonlySet<string> = new Set(["completed", "failed", "cancelled"]);

/** Whether a turn status is final. */
export function isTerminal(status: TurnStatus): boolean {
  return TERMINAL.has(status);
}

// ---- conversion from the wire (snake_case) --------------------------------------

type Wire = Record<string, unknown>;

function obj(v: unknown, what: string): Wire {
  if (v === null || typeof v !== "object" || Array.isArray(v)) {
    throw new TypeError(`expected an object for ${what}`);
  }
  return v as Wire;
}

function optional<T>(v: unknown, f: (v: unknown) => T): T | undefined {
  return v === undefined || v === null ? undefined : f(v);
}

export function waitFromWire(v: unknown): Wait {
  const w = obj(v, "wait");
  const out: Wait = {
    state: w.state as WaitState,
    reason: w.reason as string,
    sinceMs: w.since_ms as number,
    deadlineMs: (w.deadline_ms ?? null) as number | null,
    onDeadline: (w.on_deadline ?? null) as OnDeadline | null,
  };
  if (typeof w.invocation_id === "string") out.invocationId = w.invocation_id;
  if (typeof w.worker_id === "string") out.workerId = w.worker_id;
  if (typeof w.ahead === "number") out.ahead = w.ahead;
  if (typeof w.last_error === "string") out.lastError = w.last_error;
  return out;
}

export function turnFromWire(v: unknown): Turn {
  const t = obj(v, "turn");
  const turn: Turn = {
    turnId: t.turn_id as string,
    sessionId: t.session_id as string,
    seq: t.seq as number,
    functionId: t.function_id as string,
    status: t.status as TurnStatus,
    step: t.step as number,
    attempt: t.attempt as number,
    input: t.input,
    recovered: t.recovered === true,
    superseded: t.superseded === true,
    createdAtMs: t.created_at_ms as number,
    updatedAtMs: t.updated_at_ms as number,
  };
  if ("output" in t) turn.output = t.output;
  const error = optional(t.error, (e) => {
    const w = obj(e, "turn.error");
    const out: TurnError = {
      cause: w.cause as string,
      code: w.code as string,
      message: w.message as string,
      step: w.step as number,
    };
    if (typeof w.invocation_id === "string") out.invocationId = w.invocation_id;
    return out;
  });
  if (error) turn.error = error;
  const stop = optional(t.stop, (s) => {
    const w = obj(s, "turn.stop");
    return { requestedAtMs: w.requested_at_ms as number, reason: w.reason as string };
  });
  if (stop) turn.stop = stop;
  if (typeof t.finished_at_ms === "number") turn.finishedAtMs = t.finished_at_ms;
  const wait = optional(t.wait, waitFromWire);
  if (wait) turn.wait = wait;
  const progress = optional(t.progress, (p) => {
    const w = obj(p, "turn.progress");
    return {
      invocationId: w.invocation_id as string,
      step: w.step as number,
      attempt: w.attempt as number,
      seq: w.seq as number,
      data: w.data,
      atMs: w.at_ms as number,
    };
  });
  if (progress) turn.progress = progress;
  const asked = optional(t.input_request, (r) => {
    const w = obj(r, "turn.input_request");
    const out: InputRequest = {
      sinceMs: w.since_ms as number,
      deadlineMs: (w.deadline_ms ?? null) as number | null,
      onTimeout: w.on_timeout === "continue" ? "continue" : "fail",
    };
    if ("prompt" in w) out.prompt = w.prompt;
    return out;
  });
  if (asked) turn.inputRequest = asked;
  return turn;
}

/** The item of an `event`, `progress` or `progress_dropped` push; `undefined` for others. */
export function watchItemFromWire(push: Record<string, unknown>): WatchItem | undefined {
  switch (push.push) {
    case "event":
      return eventFromWire(push.event);
    case "progress":
      return {
        kind: "progress",
        turnId: push.turn_id as string,
        invocationId: push.invocation_id as string,
        step: push.step as number,
        attempt: push.attempt as number,
        seq: push.seq as number,
        data: push.data,
      };
    case "progress_dropped":
      return {
        kind: "progress_dropped",
        turnId: push.turn_id as string,
        invocationId: push.invocation_id as string,
        count: push.count as number,
      };
    default:
      return undefined;
  }
}

export function sessionFromWire(v: unknown): Session {
  const s = obj(v, "session");
  const lock = optional(s.lock, (l) => {
    const w = obj(l, "session.lock");
    return {
      turnId: w.turn_id as string,
      sinceMs: w.since_ms as number,
      wait: waitFromWire(w.wait),
    };
  });
  const queued = (s.queued as unknown[]).map((q) => {
    const w = obj(q, "session.queued");
    return {
      turnId: w.turn_id as string,
      seq: w.seq as number,
      functionId: w.function_id as string,
      createdAtMs: w.created_at_ms as number,
    };
  });
  return {
    sessionId: s.session_id as string,
    lock: lock ?? null,
    queued,
    turns: s.turns as Record<TurnStatus, number>,
    lastEvent: s.last_event as number,
  };
}

export function eventFromWire(v: unknown): Event {
  const e = obj(v, "event");
  return {
    seq: e.seq as number,
    sessionId: e.session_id as string,
    turnId: e.turn_id as string,
    atMs: e.at_ms as number,
    kind: e.kind as string,
    detail: (e.detail ?? {}) as Record<string, unknown>,
  };
}

export function workerFromWire(v: unknown): WorkerInfo {
  const w = obj(v, "worker");
  return {
    workerId: w.worker_id as string,
    name: w.name as string,
    connected: w.connected as boolean,
    instanceId: w.instance_id as string,
    sinceMs: w.since_ms as number,
    functions: w.functions as string[],
    inflight: w.inflight as number,
  };
}

export function functionFromWire(v: unknown): FunctionInfo {
  const f = obj(v, "function");
  return {
    functionId: f.function_id as string,
    concurrency: f.concurrency as number,
    timeoutMs: f.timeout_ms as number,
    delivery: f.delivery as FunctionInfo["delivery"],
    maxAttempts: f.max_attempts as number,
    workers: f.workers as number,
    queued: f.queued as number,
    // Older daemons listed registered functions only, without the field.
    registered: f.registered !== false,
  };
}

export function statsFromWire(v: unknown): Stats {
  const s = obj(v, "stats");
  const sessions = obj(s.sessions, "stats.sessions");
  const storage = obj(s.storage, "stats.storage");
  return {
    sessions: { active: sessions.active as number, blocked: sessions.blocked as WaitCounts },
    turns: s.turns as Record<TurnStatus, number>,
    invocationsInflight: s.invocations_inflight as number,
    workersConnected: s.workers_connected as number,
    oldestWaitMs: (s.oldest_wait_ms ?? null) as number | null,
    storage: { writable: storage.writable as boolean, lastError: (storage.last_error ?? null) as string | null },
  };
}

export function sessionRowFromWire(v: unknown): SessionRow {
  const r = obj(v, "session row");
  return {
    sessionId: r.session_id as string,
    turnId: r.turn_id as string,
    functionId: r.function_id as string,
    step: r.step as number,
    attempt: r.attempt as number,
    lockedSinceMs: r.locked_since_ms as number,
    queued: r.queued as number,
    stuck: r.stuck === true,
    wait: waitFromWire(r.wait),
  };
}

export function sessionPageFromWire(v: unknown): SessionPage {
  const p = obj(v, "sessions.list");
  return {
    sessions: (p.sessions as unknown[]).map(sessionRowFromWire),
    next: (p.next ?? null) as string | null,
    total: p.total as number,
    counts: p.counts as WaitCounts,
  };
}
