/**
 * What a handler sees and says: its {@link TurnContext} (with the {@link Previous}
 * turn an interrupting submit stopped), the values it returns or throws to continue
 * ({@link Continue}), wait for input ({@link Suspend}), fail ({@link Fail}) or answer
 * a cancel ({@link Cancelled}), the input of a step after a suspend
 * ({@link resumed}); with the options a function is registered with. Kept apart from
 * the worker's connection handling, which turns these into results.
 */

/** Return `new Continue(state)` from a handler to run another step with `state` as its input. */
export class Continue {
  constructor(readonly state: unknown) {}
}

export interface SuspendOptions {
  /** What is asked (any JSON), shown in the turn's `inputRequest`. */
  prompt?: unknown;
  /** How long to wait for a `resume` (> 0); default: for good. */
  timeoutMs?: number;
  /** At the deadline: fail the turn (`input_timeout`, the default) or run the next step with `input: null`. */
  onTimeout?: "fail" | "continue";
}

/**
 * Return `new Suspend(state, { prompt, timeoutMs, onTimeout })` from a handler to
 * wait for a caller's input without holding a worker: the invocation ends, the turn
 * keeps its session's lock and waits as `awaiting_input` until `client.resume(turnId,
 * input)`; its next step then gets `{ state, input }` (read it with {@link resumed}).
 */
export class Suspend {
  readonly state: unknown;
  readonly options: SuspendOptions;

  constructor(state: unknown = null, options: SuspendOptions = {}) {
    const t = options.timeoutMs;
    if (t !== undefined && !(Number.isInteger(t) && t > 0)) {
      throw new RangeError(`timeoutMs must be a positive integer of milliseconds, not ${t}`);
    }
    if (options.onTimeout !== undefined && options.onTimeout !== "fail" && options.onTimeout !== "continue") {
      throw new RangeError(`onTimeout must be "fail" or "continue", not ${String(options.onTimeout)}`);
    }
    this.state = state;
    this.options = options;
  }

  /** The `suspend` outcome as sent: members left at their default are not. */
  toWire(): Record<string, unknown> {
    const out: Record<string, unknown> = { state: this.state ?? null };
    if (this.options.prompt !== undefined) out.prompt = this.options.prompt;
    if (this.options.timeoutMs !== undefined) out.timeout_ms = this.options.timeoutMs;
    if (this.options.onTimeout === "continue") out.on_timeout = "continue";
    return out;
  }
}

/** The input of the step after a {@link Suspend}. */
export interface Resumed<S = unknown, I = unknown> {
  /** The suspend's `state`. */
  state: S;
  /** What `resume` gave; `null` when the wait timed out with `onTimeout: "continue"`. */
  input: I | null;
}

/**
 * `input` as a {@link Resumed} when it has the shape `{ state, input }` a resumed step
 * gets, else `undefined`. The daemon does not mark a resumed step: a handler that
 * suspends should say in its state that it waits, so that a `Continue` state of the
 * same shape is not taken for an answer.
 */
export function resumed<S = unknown, I = unknown>(input: unknown): Resumed<S, I> | undefined {
  if (input === null || typeof input !== "object" || Array.isArray(input)) return undefined;
  const keys = Object.keys(input);
  if (keys.length !== 2 || !("state" in input) || !("input" in input)) return undefined;
  return input as Resumed<S, I>;
}

/**
 * The turn a submit with `onBusy: "interrupt"` (or `"rollback"`) stopped, as step 0 of
 * the new turn sees it: its status after the stop (`cancelled`) and its last durable
 * state (its last `Continue` or `Suspend` state, the `{ state, input }` of its last
 * resume, or its input when it never left step 0).
 */
export interface Previous {
  turnId: string;
  status: string;
  state: unknown;
}

/** Throw from a handler to fail the step with a code of your own. */
export class Fail extends Error {
  readonly code: string;
  readonly retryable: boolean;

  constructor(code: string, message: string, options: { retryable?: boolean } = {}) {
    super(message);
    this.name = "Fail";
    this.code = code;
    this.retryable = options.retryable ?? false;
  }
}

/**
 * Throw from a handler to answer `cancelled`. A handler whose `ctx.signal` was
 * aborted and that throws anything other than {@link Fail} answers `cancelled` too.
 */
export class Cancelled extends Error {
  constructor(message = "cancelled") {
    super(message);
    this.name = "Cancelled";
  }
}

/** What a handler gets for one invocation. */
export interface TurnContext {
  readonly sessionId: string;
  readonly turnId: string;
  readonly functionId: string;
  /** Step number, from 0; goes up by one per `Continue`. */
  readonly step: number;
  /** Attempt number of this step, from 1. */
  readonly attempt: number;
  readonly invocationId: string;
  /**
   * `<turnId>/<step>`: the same for every attempt and redispatch of this step, so a
   * side effect keyed by it happens once even when the step runs again.
   */
  readonly idempotencyKey: string;
  /** The attempt deadline (Unix ms) as dispatched; heartbeats move it. */
  readonly deadlineMs: number;
  /**
   * Aborted when the daemon sends `cancel` (a stop, or an attempt past its deadline),
   * when a heartbeat learns the invocation is no longer current, or when the worker
   * stops without finishing its drain. The handler should then end; whatever it
   * throws is answered as `cancelled`.
   */
  readonly signal: AbortSignal;
  /**
   * Tell the daemon this invocation is still working (the SDK does this on its own
   * while the handler runs); resolves with the new deadline (Unix ms).
   */
  heartbeat(): Promise<number>;
  /**
   * Stream partial output (a model's tokens) to the turn's watchers
   * (`invocation.progress`). Never blocks and never throws for what the daemon does
   * with the frame: frames go out in call order without waiting for answers; one
   * sent while the worker is disconnected, while the connection's send buffer holds
   * more than `progressBufferBytes`, or after the daemon said the invocation is no
   * longer current is dropped and counted in `worker.stats`. The daemon's
   * `not_found` (no longer current) aborts `signal`, as for a heartbeat. Throws at
   * once for `data` that is not JSON (a `BigInt`, a cycle).
   */
  progress(data: unknown): void;
  /** At step 0 of a turn submitted with `onBusy` `interrupt` or `rollback` that stopped a turn: that turn. */
  readonly previous: Previous | undefined;
}

export type Handler<I = unknown> = (ctx: TurnContext, input: I) => unknown | Promise<unknown>;

export interface FunctionOptions {
  /** Invocations this worker runs at once for this function (default 1). */
  concurrency?: number;
  /** Attempt deadline, renewed by heartbeats; default the daemon's `turns.default_timeout_ms`. */
  timeoutMs?: number;
  delivery?: "at_most_once" | "at_least_once";
  /** Attempts per step; default 1 (`at_most_once`) or 3 (`at_least_once`). */
  maxAttempts?: number;
  /** Send heartbeats on their own while a handler runs (default true). */
  autoHeartbeat?: boolean;
}
