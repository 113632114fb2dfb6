/**
 * One WebSocket connection speaking protocol v1: `hello`, requests matched to their
 * answers by id, pushes handed to a callback, and the end of the connection noticed
 * in every way it can end (close frame, socket error, or silence of the server for
 * three of its heartbeat intervals). It also tells a URL that can never work (not a
 * URL, an upgrade refused with an HTTP status) from a daemon that is not there yet,
 * and gives the daemon's refusal of a frame too large or too deep (`id: null`) to
 * the request that caused it.
 */
import type { IncomingMessage } from "node:http";
import type { Socket } from "node:net";
import WebSocket from "ws";
import { BadUrl, ConnectionError, errorFromWire, TurndError } from "./errors.js";
import type { Reconciled } from "./types.js";

export const PROTOCOL_VERSION = 1;
/** Close code of a worker connection superseded by a newer `hello` with the same `worker_id`. */
export const CLOSE_SUPERSEDED = 4001;
/**
 * Close code of a daemon that shuts down (or of a cluster node that drains). Every
 * request it read on the connection was answered before this close frame: one with
 * no answer was never read and changed nothing.
 */
export const CLOSE_GOING_AWAY = 1001;

/** `hello` arguments as sent on the wire. */
export interface HelloArgs {
  protocol: number;
  role: "worker" | "client" | "operator";
  token?: string;
  name?: string;
  worker_id?: string;
  instance_id?: string;
  inflight?: string[];
  finished?: string[];
}

/** The `hello` answer. */
export interface HelloOk {
  server: string;
  version: string;
  bootId: string;
  connectionId: string;
  heartbeatMs: number;
  maxFrameBytes: number;
  reconciled?: Reconciled;
}

/** A push frame: `{"push": "invoke" | "cancel" | "probe" | "event" | "progress" | "progress_dropped", ...}`. */
export type PushFrame = { push: string } & Record<string, unknown>;

export interface ConnectOptions {
  /** Give up on the TCP/WebSocket handshake and `hello` after this long (default 10000). */
  connectTimeoutMs?: number;
  /** Called for every push, in arrival order, with the connection it came on. */
  onPush?: (push: PushFrame, conn: Connection) => void;
  /** Called once when the connection has ended, however it ended. */
  onClose?: (code: number, reason: string) => void;
}

interface Pending {
  op: string;
  /** The frame as sent: the daemon's `id: null` refusals are matched to it by size or depth. */
  text: string;
  size: number;
  resolve: (ok: unknown) => void;
  reject: (err: Error) => void;
  onOk: ((ok: unknown) => void) | undefined;
}

/** `server.max_frame_bytes` when the daemon has not said otherwise. */
export const DEFAULT_MAX_FRAME_BYTES = 1_048_576;

/** How many server heartbeat intervals of silence end the connection. */
const SILENT_INTERVALS = 3;

/** The daemon's close code after a frame over `max_frame_bytes`. */
const CLOSE_TOO_BIG = 1009;

/** How much of the body of a refused upgrade is kept for the error message. */
const REFUSAL_BODY_CHARS = 512;

/**
 * The error for an HTTP answer to the WebSocket upgrade, with the server's own words
 * (turnd's 404 says where protocol v1 is served). A server error, a timeout or a rate
 * limit may pass; any other answer will be the same next time.
 */
function refusal(url: string, status: number, body: string): ConnectionError {
  const words = body.replace(/\s+/g, " ").trim().slice(0, REFUSAL_BODY_CHARS);
  const msg = `${url}: the server answered the WebSocket upgrade with HTTP ${status}${words ? `: ${words}` : ""}`;
  return status >= 500 || status === 408 || status === 429 ? new ConnectionError(msg) : new BadUrl(msg, status);
}

/** Read the start of a refused upgrade's body, then make its error. */
function readRefusal(url: string, res: IncomingMessage): Promise<ConnectionError> {
  return new Promise((resolve) => {
    let body = "";
    const done = () => resolve(refusal(url, res.statusCode ?? 0, body));
    res.setEncoding("utf8");
    res.on("data", (chunk: string) => {
      body += chunk;
      if (body.length >= REFUSAL_BODY_CHARS) done();
    });
    res.once("end", done);
    res.once("error", done);
    res.once("close", done);
  });
}

/** How deep a JSON text nests, counted as the daemon counts it (brackets outside strings). */
function jsonDepth(text: string): number {
  let depth = 0;
  let max = 0;
  let inString = false;
  let escaped = false;
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    if (inString) {
      if (escaped) escaped = false;
      else if (c === 0x5c) escaped = true;
      else if (c === 0x22) inString = false;
    } else if (c === 0x22) inString = true;
    else if (c === 0x7b || c === 0x5b) max = Math.max(max, ++depth);
    else if (c === 0x7d || c === 0x5d) depth = Math.max(0, depth - 1);
  }
  return max;
}

/** A request frame's text, its arguments already written as JSON. */
function frameText(id: number, op: string, argsJson: string): string {
  return `{"id":${id},"op":${JSON.stringify(op)},"args":${argsJson}}`;
}

/** The bytes of a request frame of `op` besides its arguments, at the longest id. */
export function frameOverhead(op: string): number {
  return Buffer.byteLength(frameText(Number.MAX_SAFE_INTEGER, op, ""));
}

export class Connection {
  private readonly ws: WebSocket;
  private readonly pending = new Map<number, Pending>();
  private nextId = 1;
  private lastHeard = Date.now();
  private watchdog: NodeJS.Timeout | undefined;
  private ended = false;
  private endCode: number | undefined;
  private readonly endedPromise: Promise<void>;
  private resolveEnded!: () => void;
  private readonly onPush: ((push: PushFrame, conn: Connection) => void) | undefined;
  private readonly onClose: ((code: number, reason: string) => void) | undefined;
  /** The daemon's frame limit, from `hello` (the protocol default until then). */
  private frameLimit = DEFAULT_MAX_FRAME_BYTES;
  /** The message of the daemon's `id: null` `too_large` that precedes its 1009 close. */
  private refusedFrame: string | undefined;
  /** Whether the socket's writes are held until the next `process.nextTick` run ({@link corkTick}). */
  private corked = false;

  private constructor(ws: WebSocket, opts: ConnectOptions) {
    this.ws = ws;
    this.onPush = opts.onPush;
    this.onClose = opts.onClose;
    this.endedPromise = new Promise((resolve) => {
      this.resolveEnded = resolve;
    });
    ws.on("message", (data, isBinary) => this.onMessage(data, isBinary));
    ws.on("ping", () => this.heard());
    ws.on("pong", () => this.heard());
    ws.on("error", () => {
      // The "close" event follows and does the bookkeeping.
    });
    ws.on("close", (code, reason) => this.finish(code, reason.toString()));
  }

  /**
   * Open a connection to `url` and say `hello`. Rejects with {@link BadUrl} at once
   * when the URL can never work, with {@link ConnectionError} when the daemon cannot
   * be reached, or with {@link TurndError} when it refuses the `hello` (the socket is
   * closed then).
   */
  static open(
    url: string,
    hello: HelloArgs,
    opts: ConnectOptions = {},
  ): Promise<{ conn: Connection; hello: HelloOk }> {
    const timeoutMs = opts.connectTimeoutMs ?? 10_000;
    let ws: WebSocket;
    try {
      ws = new WebSocket(url, {
        handshakeTimeout: timeoutMs,
        perMessageDeflate: false,
        maxPayload: 256 * 1024 * 1024,
      });
    } catch (err) {
      const why = err instanceof Error ? err.message : String(err);
      return Promise.reject(new BadUrl(`not a daemon URL: ${JSON.stringify(url)} (${why})`, undefined, { cause: err }));
    }
    return new Promise((resolve, reject) => {
      let settled = false;
      let opened = false;
      const conn = new Connection(ws, opts);
      const timer = setTimeout(() => {
        fail(new ConnectionError(`no hello answer from ${url} within ${timeoutMs} ms`));
      }, timeoutMs);
      const fail = (err: Error) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        conn.terminate();
        reject(err);
      };
      ws.once("unexpected-response", (_req, res) => {
        void readRefusal(url, res).then(fail);
      });
      // Once open, the end of the connection rejects the pending `hello` with the
      // error that fits (a `hello` over the daemon's frame limit is `too_large`).
      ws.once("error", (err) => {
        if (!opened) fail(new ConnectionError(`cannot connect to ${url}: ${err.message}`, { cause: err }));
      });
      ws.once("close", (code) => {
        if (!opened) fail(new ConnectionError(`connection to ${url} closed before the handshake ended (code ${code})`));
      });
      ws.once("open", () => {
        opened = true;
        conn
          .request("hello", hello)
          .then((ok) => {
            if (settled) return;
            settled = true;
            clearTimeout(timer);
            const helloOk = helloFromWire(ok);
            if (helloOk.maxFrameBytes > 0) conn.frameLimit = helloOk.maxFrameBytes;
            conn.startWatchdog(helloOk.heartbeatMs);
            resolve({ conn, hello: helloOk });
          })
          .catch((err: Error) => fail(err));
      });
    });
  }

  /** Bytes queued by `send` and not yet written to the socket. */
  get bufferedAmount(): number {
    return this.ws.bufferedAmount;
  }

  /** Whether the connection is still usable. */
  get isOpen(): boolean {
    return !this.ended && this.ws.readyState === WebSocket.OPEN;
  }

  /** The close code once the connection has ended (1006 when it broke without one). */
  get closeCode(): number | undefined {
    return this.endCode;
  }

  /** The largest frame the daemon accepts (`hello.max_frame_bytes`). */
  get maxFrameBytes(): number {
    return this.frameLimit;
  }

  /** Resolves once the connection has ended. */
  get closed(): Promise<void> {
    return this.endedPromise;
  }

  /**
   * Send a request and resolve with its `ok` value. Rejects with {@link TurndError}
   * for an `error` answer and {@link ConnectionError} when the connection ends
   * first. `onOk` runs synchronously when the answer is read, before any later
   * frame is handled (used to route the pushes of a new watch).
   */
  request(op: string, args: unknown, onOk?: (ok: unknown) => void): Promise<unknown> {
    return this.send(op, (id) => JSON.stringify({ id, op, args }), onOk);
  }

  /**
   * {@link request} with its arguments already written as JSON (`argsJson`, one
   * JSON value): a request sent again, or whose size was measured before, is not
   * written out again each time.
   */
  requestWithArgs(op: string, argsJson: string): Promise<unknown> {
    return this.send(op, (id) => frameText(id, op, argsJson));
  }

  private send(op: string, frame: (id: number) => string, onOk?: (ok: unknown) => void): Promise<unknown> {
    if (this.ended || this.ws.readyState !== WebSocket.OPEN) {
      return Promise.reject(new ConnectionError(`not connected (${op})`));
    }
    const id = this.nextId++;
    const text = frame(id);
    const size = Buffer.byteLength(text);
    if (size > this.frameLimit) {
      // The daemon would answer too_large and close the connection (1009); refusing
      // here keeps the connection and makes the error the caller's, not a reconnect.
      return Promise.reject(
        new TurndError("too_large", `request of ${size} bytes exceeds max_frame_bytes ${this.frameLimit}`, false, op),
      );
    }
    return new Promise((resolve, reject) => {
      this.pending.set(id, { op, text, size, resolve, reject, onOk });
      this.corkTick();
      this.ws.send(text, (err) => {
        if (err && this.pending.delete(id)) {
          reject(new ConnectionError(`send failed (${op}): ${err.message}`, { cause: err }));
        }
      });
    });
  }

  /**
   * Hold the socket's writes until Node next runs its `process.nextTick` queue, so
   * that the frames sent by one piece of synchronous code, or by the promise
   * continuations that run together in one microtask drain (a worker's handlers
   * answering the invocations of one read, callers submitting for many sessions),
   * leave in one write (one `writev`, usually one TCP segment) rather than one
   * each: they made a system call per frame, and the daemon a read per segment.
   * `ws` writes each frame within a cork of its own, which nests in this one. Only
   * an optimisation: where `ws` keeps no socket to reach, every frame is written
   * as it is sent.
   */
  private corkTick(): void {
    if (this.corked) return;
    const socket = (this.ws as unknown as { _socket?: Partial<Pick<Socket, "cork" | "uncork">> | null })._socket;
    const { cork, uncork } = socket ?? {};
    if (!socket || typeof cork !== "function" || typeof uncork !== "function") return;
    this.corked = true;
    cork.call(socket);
    process.nextTick(() => {
      this.corked = false;
      uncork.call(socket);
    });
  }

  /** Close with a close frame; resolves when the connection has ended. */
  async close(code = 1000, reason = ""): Promise<void> {
    if (!this.ended) {
      try {
        this.ws.close(code, reason);
      } catch {
        this.ws.terminate();
      }
      const timer = setTimeout(() => this.ws.terminate(), 1000);
      await this.endedPromise;
      clearTimeout(timer);
    }
  }

  /** Drop the socket at once, without a close frame. */
  terminate(): void {
    this.ws.terminate();
  }

  private heard(): void {
    this.lastHeard = Date.now();
  }

  private startWatchdog(heartbeatMs: number): void {
    const limit = SILENT_INTERVALS * heartbeatMs;
    this.lastHeard = Date.now();
    this.watchdog = setInterval(
      () => {
        if (Date.now() - this.lastHeard > limit) {
          // The server pings every heartbeatMs: this long without any frame means the
          // connection is dead even if the socket has not noticed.
          this.ws.terminate();
        }
      },
      Math.max(10, Math.floor(heartbeatMs / 2)),
    );
    this.watchdog.unref();
  }

  private onMessage(data: WebSocket.RawData, isBinary: boolean): void {
    this.heard();
    if (isBinary) return;
    let frame: Record<string, unknown>;
    try {
      frame = JSON.parse(data.toString()) as Record<string, unknown>;
    } catch {
      return;
    }
    if (frame === null || typeof frame !== "object") return;
    if (typeof frame.push === "string") {
      this.onPush?.(frame as PushFrame, this);
      return;
    }
    if (frame.id === null && frame.error && typeof frame.error === "object") {
      this.onRefusedFrame(frame.error as Record<string, unknown>);
      return;
    }
    if (typeof frame.id !== "number") return;
    const p = this.pending.get(frame.id);
    if (!p) return;
    this.pending.delete(frame.id);
    if ("error" in frame && frame.error && typeof frame.error === "object") {
      const e = frame.error as Record<string, unknown>;
      p.reject(errorFromWire(e, p.op));
      return;
    }
    const ok = frame.ok ?? {};
    try {
      p.onOk?.(ok);
    } finally {
      p.resolve(ok);
    }
  }

  /**
   * An error the daemon could not answer with an id: it did not read the frame. Of
   * the frames this client sends, only one too deep (answered at once, the
   * connection kept) or too large (the connection is then closed with 1009) is
   * refused so. The deepest request in flight, the oldest of equals, is over the
   * daemon's depth limit as surely as the refused frame is: it gets the refusal,
   * so that every request refused gets exactly one answer and none waits for good.
   */
  private onRefusedFrame(e: Record<string, unknown>): void {
    if (e.code !== "too_large") return;
    const message = String(e.message ?? "");
    const limit = /max_json_depth \((\d+)\)/.exec(message);
    if (!limit) {
      this.refusedFrame = message; // for the 1009 close that follows
      return;
    }
    let culprit: [number, Pending] | undefined;
    let deepest = Number(limit[1]);
    for (const [id, p] of this.pending) {
      const depth = jsonDepth(p.text);
      if (depth > deepest) {
        deepest = depth;
        culprit = [id, p];
      }
    }
    if (!culprit) return;
    this.pending.delete(culprit[0]);
    culprit[1].reject(new TurndError("too_large", message, false, culprit[1].op));
  }

  /**
   * The request a 1009 close refused: the daemon closes at the first frame over its
   * limit and reads no further, so the largest request in flight is over it too.
   */
  private largestPending(): number | undefined {
    let largest: number | undefined;
    let size = -1;
    for (const [id, p] of this.pending) {
      if (p.size > size) {
        size = p.size;
        largest = id;
      }
    }
    return largest;
  }

  private finish(code: number, reason: string): void {
    if (this.ended) return;
    this.ended = true;
    this.endCode = code;
    if (this.watchdog) clearInterval(this.watchdog);
    const err = new ConnectionError(`connection closed (code ${code}${reason ? `: ${reason}` : ""})`);
    const refused = code === CLOSE_TOO_BIG ? this.largestPending() : undefined;
    for (const [id, p] of this.pending) {
      if (id !== refused) {
        p.reject(err);
        continue;
      }
      // Sending it again would be refused again: the request fails, not the connection.
      const why = this.refusedFrame ?? `the daemon closed the connection with ${code} (a frame over its max_frame_bytes)`;
      p.reject(new TurndError("too_large", `${why}; this request's frame has ${p.size} bytes`, false, p.op));
    }
    this.pending.clear();
    this.resolveEnded();
    this.onClose?.(code, reason);
  }
}

/** The `hello` answer with camelCase names. */
function helloFromWire(ok: unknown): HelloOk {
  const o = ok as Record<string, unknown>;
  const helloOk: HelloOk = {
    server: o.server as string,
    version: o.version as string,
    bootId: o.boot_id as string,
    connectionId: o.connection_id as string,
    heartbeatMs: o.heartbeat_ms as number,
    maxFrameBytes: o.max_frame_bytes as number,
  };
  if (o.reconciled && typeof o.reconciled === "object") {
    const r = o.reconciled as Record<string, string[] | undefined>;
    helloOk.reconciled = {
      kept: r.kept ?? [],
      redispatched: r.redispatched ?? [],
      unknown: r.unknown ?? [],
    };
  }
  return helloOk;
}
