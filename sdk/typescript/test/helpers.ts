/** Test helpers: a daemon with short timers, and a WebSocket proxy that drops chosen frames. */
import type { AddressInfo } from "node:net";
import WebSocket, { WebSocketServer } from "ws";
import { type Client, connect, type Event, Worker, type WorkerOptions } from "../src/index.js";
import { startTurnd, type Turnd } from "../src/testing.js";

/**
 * Timers short enough for each loss case to play out in a second or two. No test
 * waits for a probe or a cancel to go unanswered, so those two windows are wide
 * enough for an answer delayed by a stall of the disk (a commit's `fdatasync` took
 * over half a second at times on a shared 2-core machine) or of a process (a Node
 * process on a loaded 2-core machine can stall for a few seconds).
 *
 * The heartbeat is the daemon's default: a connection silent for three of them is
 * ended by both sides (the SDK's watchdog, the daemon's reader), so a short one would
 * end healthy connections whenever Node's event loop stalls, and break every test that
 * counts connections. Only a test that waits for silence to be noticed takes
 * `SHORT_HEARTBEAT`, on a daemon of its own.
 */
export const FAST = {
  server: { heartbeat_ms: 5000 },
  turns: {
    probe_timeout_ms: 5000,
    reconnect_grace_ms: 5000,
    cancel_grace_ms: 3000,
    retry_backoff_ms: 50,
    retry_backoff_max_ms: 200,
  },
};

/** FAST with a heartbeat short enough for a silent connection to be noticed in 1.5 s. */
export const SHORT_HEARTBEAT = { ...FAST, server: { heartbeat_ms: 500 } };

export function daemon(config: typeof FAST = FAST): Promise<Turnd> {
  return startTurnd({ config });
}

let workerSeq = 0;

/**
 * A worker with fast reconnect timers. A result unanswered for `resultAckTimeoutMs` is
 * sent again: that window is wide enough for an answer delayed by a stall, so no
 * result is resent but for a loss a test made. A test of that resend passes its own.
 */
export function worker(url: string | readonly string[], opts: Partial<WorkerOptions> = {}): Worker {
  workerSeq += 1;
  return new Worker({
    url,
    workerId: `w-${process.pid}-${workerSeq}`,
    resultAckTimeoutMs: 5000,
    reconnectDelayMs: 50,
    maxReconnectDelayMs: 200,
    drainTimeoutMs: 2000,
    ...opts,
  });
}

export function client(url: string): Promise<Client> {
  return connect({ url, reconnectDelayMs: 50, maxReconnectDelayMs: 200 });
}

export const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

/** Poll `f` until it returns something truthy, or fail after `ms`. */
export async function until<T>(what: string, f: () => T | Promise<T>, ms = 5000): Promise<T> {
  const deadline = Date.now() + ms;
  for (;;) {
    const v = await f();
    if (v) return v;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(20);
  }
}

/** Every event of a session, paging through `session.events`. */
export async function allEvents(c: Client, sessionId: string): Promise<Event[]> {
  const out: Event[] = [];
  let after = 0;
  for (;;) {
    const page = await c.events(sessionId, { after, limit: 1000 });
    out.push(...page.events);
    if (page.events.length === 0) return out;
    after = page.next;
  }
}

type Frame = Record<string, unknown>;
/** Return true to drop the frame. */
export type Filter = (frame: Frame) => boolean;

/**
 * A WebSocket proxy in front of the daemon. Every text frame is parsed, recorded and
 * passed on unless a filter drops it (or, towards the client, `editToClient` gives
 * another frame to pass on instead). `cut()` breaks every proxied connection
 * (without a close frame, or with a given close code); while `refuse` is set, new
 * connections are dropped at once.
 */
export class FrameProxy {
  url = "";
  toServer: Filter = () => false;
  toClient: Filter = () => false;
  editToClient: (frame: Frame) => Frame | undefined = () => undefined;
  refuse = false;
  readonly sentToServer: Frame[] = [];
  readonly sentToClient: Frame[] = [];
  readonly dropped: Frame[] = [];
  private readonly server: WebSocketServer;
  private readonly pairs = new Set<{ a: WebSocket; b: WebSocket; stalled: boolean }>();

  private constructor(
    private readonly upstream: string,
    server: WebSocketServer,
  ) {
    this.server = server;
    server.on("connection", (downstream, req) => this.pair(downstream, req.url ?? "/v1"));
  }

  static async start(upstreamUrl: string): Promise<FrameProxy> {
    const server = new WebSocketServer({ host: "127.0.0.1", port: 0 });
    await new Promise<void>((resolve) => server.once("listening", () => resolve()));
    const proxy = new FrameProxy(new URL(upstreamUrl).origin.replace(/^http/, "ws"), server);
    proxy.url = `ws://127.0.0.1:${(server.address() as AddressInfo).port}/v1`;
    return proxy;
  }

  private pair(down: WebSocket, path: string): void {
    if (this.refuse) {
      down.terminate();
      return;
    }
    const up = new WebSocket(this.upstream + path, { perMessageDeflate: false, autoPong: false });
    const pair = { a: down, b: up, stalled: false };
    this.pairs.add(pair);
    const early: string[] = [];
    const end = () => {
      this.pairs.delete(pair);
      down.terminate();
      up.terminate();
    };
    // A stalled pair keeps the worker's side open when the daemon's side ends: the
    // worker must find out by itself.
    const upEnded = () => {
      if (pair.stalled) up.terminate();
      else end();
    };
    down.on("close", end);
    up.on("close", upEnded);
    down.on("error", end);
    up.on("error", upEnded);
    // The daemon's pings go through to the worker and its pongs come back (the proxy
    // does not answer them itself), so a stalled pair is silent both ways.
    up.on("ping", (data) => {
      if (!pair.stalled && down.readyState === WebSocket.OPEN) down.ping(data);
    });
    down.on("pong", (data) => {
      if (!pair.stalled && up.readyState === WebSocket.OPEN) up.pong(data);
    });
    up.on("open", () => {
      for (const m of early) up.send(m);
      early.length = 0;
    });
    down.on("message", (data) => {
      if (pair.stalled) return;
      const text = data.toString();
      const frame = JSON.parse(text) as Frame;
      if (this.toServer(frame)) {
        this.dropped.push(frame);
        return;
      }
      this.sentToServer.push(frame);
      if (up.readyState === WebSocket.OPEN) up.send(text);
      else early.push(text);
    });
    up.on("message", (data) => {
      if (pair.stalled) return;
      let text = data.toString();
      let frame = JSON.parse(text) as Frame;
      if (this.toClient(frame)) {
        this.dropped.push(frame);
        return;
      }
      const edited = this.editToClient(frame);
      if (edited !== undefined) {
        frame = edited;
        text = JSON.stringify(edited);
      }
      this.sentToClient.push(frame);
      if (down.readyState === WebSocket.OPEN) down.send(text);
    });
  }

  /**
   * Break every proxied connection at once: with no close frame, or, given `code`,
   * with a close frame of that code to the client (the daemon's side is dropped).
   */
  cut(code?: number): void {
    for (const { a, b } of this.pairs) {
      if (code === undefined) a.terminate();
      else a.close(code, "proxy going away");
      b.terminate();
    }
    this.pairs.clear();
  }

  /**
   * Stop passing anything on the current connections, pings included, without
   * closing them: a half-open connection, which only silence can reveal.
   */
  stall(): void {
    for (const pair of this.pairs) pair.stalled = true;
  }

  /** `hello` frames sent to the daemon, in order. */
  hellos(): Frame[] {
    return this.sentToServer.filter((f) => f.op === "hello");
  }

  async close(): Promise<void> {
    this.cut();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }
}

/** Only the first frame that matches `match` is dropped. */
export function dropFirst(match: Filter): Filter {
  let done = false;
  return (frame) => {
    if (done || !match(frame)) return false;
    done = true;
    return true;
  };
}
