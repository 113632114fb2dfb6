/**
 * What a running invocation tells the daemon while its handler works: heartbeats
 * (`invocation.heartbeat`, sent on their own and on request) and progress frames
 * (`invocation.progress`, the partial output a handler streams to watchers).
 *
 * Both are answered `not_found` once the invocation is no longer current (a stop, a
 * reconcile, a retry); this module owns what the worker does then: the handler's
 * `signal` is aborted and no more progress is sent for it. Only the daemon that
 * dispatched the invocation can say so: with several URLs, a `not_found` on another
 * connection (a daemon that never stored it, while the invocation's own connection
 * is down) ends nothing. Kept apart from the worker's connection and result handling
 * (`worker.ts`, `links.ts`), which start the heartbeats and hand out the connection.
 */
import type { Connection } from "./connection.js";
import { ConnectionError, TurndError } from "./errors.js";
import { Cancelled } from "./handler.js";

/** A handler that runs, as the worker tracks it. */
export interface Running {
  controller: AbortController;
  autoHeartbeat: boolean;
  /** The daemon answered `not_found` for this invocation: no more progress is sent. */
  stale: boolean;
  /** The index of the URL whose daemon last pushed about the invocation. */
  home: number;
}

/** The connection an invocation's requests go on, and whether it is its home's. */
export interface Route {
  conn: Connection;
  atHome: boolean;
}

/** The counters this module keeps (part of the worker's stats). */
export interface LiveCounters {
  heartbeats: number;
  /** Progress frames the daemon accepted. */
  progressSent: number;
  /** Progress frames not sent (disconnected, no longer current, a full send buffer) or lost with the connection. */
  progressDropped: number;
  /** Progress frames the daemon refused (`not_found`, `too_large`). */
  progressRefused: number;
}

export interface LiveHost {
  /** The connection an invocation's requests go on now, when one is up. */
  route(invocationId: string): Route | undefined;
  running: ReadonlyMap<string, Running>;
  counters: LiveCounters;
  log(level: "debug" | "info" | "warn" | "error", message: string): void;
  /** Drop progress while the connection's send buffer holds more than this. */
  progressBufferBytes: number;
}

function message(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
}

export class Live {
  constructor(private readonly host: LiveHost) {}

  /** The daemon answered `not_found` for `invocationId`: abort its handler. */
  noLongerCurrent(invocationId: string): void {
    const r = this.host.running.get(invocationId);
    if (!r || r.stale) return;
    r.stale = true;
    if (!r.controller.signal.aborted) {
      this.host.log("info", `${invocationId} is no longer current; aborting its handler`);
      r.controller.abort(new Cancelled("the invocation is no longer current"));
    }
  }

  /** Heartbeats every third of `timeoutMs` while the handler runs; returns the stopper. */
  heartbeatLoop(invocationId: string, timeoutMs: number, signal: AbortSignal): () => void {
    const every = Math.max(50, Math.floor(timeoutMs / 3));
    const timer = setInterval(() => {
      const route = this.host.route(invocationId);
      if (!route || signal.aborted) return;
      this.heartbeat(route, invocationId).catch(() => {});
    }, every);
    return () => clearInterval(timer);
  }

  async heartbeat({ conn, atHome }: Route, invocationId: string): Promise<number> {
    try {
      const ok = (await conn.request("invocation.heartbeat", { invocation_id: invocationId })) as {
        deadline_ms: number;
      };
      this.host.counters.heartbeats += 1;
      return ok.deadline_ms;
    } catch (err) {
      if (err instanceof TurndError && err.code === "not_found") {
        if (!atHome) throw new ConnectionError(`the daemon that dispatched ${invocationId} is not connected`);
        this.noLongerCurrent(invocationId);
      }
      throw err;
    }
  }

  /** Send one progress frame now (in call order); its answer is taken when it comes. */
  progress(invocationId: string, data: unknown): void {
    const counters = this.host.counters;
    const args = { invocation_id: invocationId, data: data === undefined ? null : data };
    const route = this.host.route(invocationId);
    const conn = route?.conn;
    const r = this.host.running.get(invocationId);
    if (!conn?.isOpen || !r || r.stale || conn.bufferedAmount > this.host.progressBufferBytes) {
      JSON.stringify(args); // data that is not JSON is the caller's error, always
      counters.progressDropped += 1;
      return;
    }
    // Throws at once for data that is not JSON; sends synchronously, so in order.
    conn.request("invocation.progress", args).then(
      () => {
        counters.progressSent += 1;
      },
      (err: unknown) => {
        if (!(err instanceof TurndError) || (err.code === "not_found" && !route?.atHome)) {
          counters.progressDropped += 1; // the connection ended first, or reached another daemon
          return;
        }
        counters.progressRefused += 1;
        if (err.code === "not_found") this.noLongerCurrent(invocationId);
        else this.host.log("warn", `${invocationId}: progress refused: ${message(err)}`);
      },
    );
  }
}
