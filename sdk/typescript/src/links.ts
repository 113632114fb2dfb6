/**
 * A worker's connections: one per URL (a cluster's nodes each get one), and which of
 * them an invocation's own requests go on.
 *
 * A cluster node dispatches only the turns of the partitions it leads, to the workers
 * attached to it, so a worker keeps a connection to every node with one `workerId` and
 * one `instanceId`. Each URL's loop connects (the worker says `hello` listing every
 * invocation it runs or holds a result of: its tables are one), serves until the
 * connection ends and reconnects with capped, jittered backoff until the worker halts.
 *
 * An invocation's requests (its result, heartbeats, progress) go on the connection of
 * its home, the URL whose daemon last pushed about it, while that connection is up,
 * else on any live one (a cluster node forwards them to the partition's leader).
 */
import { CLOSE_SUPERSEDED, type Connection } from "./connection.js";
import { BadUrl, ConnectionError, TurndError } from "./errors.js";

/** A connection the worker serves on (hello and registrations done). */
export interface Link {
  /** The index of its URL in the worker's URLs. */
  index: number;
  /** Unique among all the worker's connections. */
  generation: number;
  conn: Connection;
}

type LogLevel = "debug" | "info" | "warn" | "error";

/** What the connection loops need of their worker. */
export interface LinksHost {
  readonly urls: readonly string[];
  /** Aborted at the hard stop (and by a loop that cannot go on): every loop ends. */
  readonly halt: AbortController;
  readonly reconnectDelayMs: number;
  readonly maxReconnectDelayMs: number;
  /** Connect to `url`, say hello and register every function. */
  open(index: number, url: string): Promise<Connection>;
  /** A connection is up (already among the live ones). */
  up(link: Link): void;
  /** A connection is not up: being tried (`trying`) or lost. */
  down(trying: boolean): void;
  log(level: LogLevel, message: string): void;
}

/** Refusals of `hello` or `function.register` that no retry can fix. */
const FATAL: ReadonlySet<string> = new Set([
  "not_authenticated",
  "unsupported_protocol",
  "bad_request",
  "forbidden",
  "too_large",
]);

/** Whether a failed connect (or registration) would fail the same way every time. */
function fatal(err: unknown): boolean {
  return err instanceof BadUrl || (err instanceof TurndError && FATAL.has(err.code));
}

/**
 * A promise of `value` once `signal` aborts, and `cancel`, which takes its listener
 * off the signal again: a race against a promise that settles only at the stop (a
 * `then` on it per race) would leave a reaction on that promise, and through it
 * everything the racing function holds, for as long as the worker runs.
 */
function whenAborted<T>(signal: AbortSignal, value: T): { promise: Promise<T>; cancel: () => void } {
  let cancel = () => {};
  const promise = new Promise<T>((resolve) => {
    if (signal.aborted) return resolve(value);
    const onAbort = () => resolve(value);
    signal.addEventListener("abort", onAbort, { once: true });
    cancel = () => signal.removeEventListener("abort", onAbort);
  });
  return { promise, cancel };
}

export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve();
    const onAbort = () => {
      clearTimeout(timer);
      resolve();
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

export function message(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
}

/** The live connections of one worker, by the index of their URL, and their loops. */
export class Links {
  readonly live = new Map<number, Link>();
  private waiters: Array<() => void> = [];
  private generation = 0;

  constructor(private readonly host: LinksHost) {}

  /** Whether every URL's connection is up. */
  get allUp(): boolean {
    return this.live.size === this.host.urls.length;
  }

  /** `home`'s connection when it is up, else any live one; none whose generation is in `skip`. */
  pick(home: number | undefined, skip: ReadonlySet<number> = new Set()): Link | undefined {
    const usable = (l: Link | undefined): l is Link => l?.conn.isOpen === true && !skip.has(l.generation);
    const own = home === undefined ? undefined : this.live.get(home);
    if (usable(own)) return own;
    return [...this.live.values()].find(usable);
  }

  /** Wait for a connection {@link pick} would give; `null` after the hard stop. */
  async wait(home: () => number | undefined, skip: ReadonlySet<number>): Promise<Link | null> {
    for (;;) {
      if (this.host.halt.signal.aborted) return null;
      const link = this.pick(home(), skip);
      if (link) return link;
      await new Promise<void>((resolve) => this.waiters.push(resolve));
    }
  }

  /** Wake every {@link wait}er to look again. */
  wake(): void {
    const waiters = this.waiters;
    this.waiters = [];
    for (const w of waiters) w();
  }

  /** Every URL's loop until the halt; rejects with the error that made one stop (the others stop too). */
  async supervise(): Promise<void> {
    let failure: unknown;
    await Promise.all(
      this.host.urls.map((url, index) =>
        this.loop(index, url).catch((err: unknown) => {
          failure ??= err;
          this.host.halt.abort();
          this.wake();
        }),
      ),
    );
    if (failure !== undefined) throw failure;
  }

  /** One URL's connection: connect, serve, reconnect with backoff, until the halt. */
  private async loop(index: number, url: string): Promise<void> {
    const h = this.host;
    const base = h.reconnectDelayMs;
    const cap = Math.max(base, h.maxReconnectDelayMs);
    let delay = base;
    const backOff = async () => {
      await sleep(delay / 2 + (Math.random() * delay) / 2, h.halt.signal);
      delay = Math.min(delay * 2, cap);
    };
    while (!h.halt.signal.aborted) {
      h.down(true);
      let conn: Connection;
      try {
        const attempt = h.open(index, url);
        const stopped = whenAborted(h.halt.signal, null);
        const first = await Promise.race([attempt, stopped.promise]).finally(stopped.cancel);
        if (first === null) {
          // Stopped while connecting: drop that connection when it comes.
          attempt.then((c) => c.terminate(), () => {});
          return;
        }
        conn = first;
      } catch (err) {
        if (fatal(err)) {
          // A URL that can never work, a hello or registration refused for its
          // arguments: the same again fails again, so stop instead of retrying forever.
          h.log("error", `cannot serve: ${message(err)}; this worker stops`);
          throw err;
        }
        h.log("warn", `connect to ${url} failed: ${message(err)}`);
        h.down(false);
        await backOff();
        continue;
      }
      delay = base;
      this.generation += 1;
      const link = { index, generation: this.generation, conn };
      this.live.set(index, link);
      this.wake();
      h.up(link);
      const stopped = whenAborted(h.halt.signal, undefined);
      await Promise.race([conn.closed, stopped.promise]);
      stopped.cancel();
      this.live.delete(index);
      this.wake();
      if (h.halt.signal.aborted) {
        await conn.close(1000, "worker stopping");
        return;
      }
      if (conn.closeCode === CLOSE_SUPERSEDED) {
        const err = new ConnectionError(`superseded: another connection took this worker_id at ${url}; this worker stops`);
        h.log("error", err.message);
        throw err;
      }
      h.log("warn", `connection to ${url} lost (code ${conn.closeCode}); reconnecting`);
      h.down(false);
      await backOff();
    }
  }
}
