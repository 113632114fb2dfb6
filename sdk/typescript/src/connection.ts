/**
 * One WebSocket connection speaking protocol v1: `hello`, requests matched to their
 * answers by id, pushes handed to a callback, and the end of the connection noticed
 * in every way it can end (close frame, socket error, or silence of the server for
 * three of its heartbeat intervals).
 */
import WebSocket from "ws";
import { ConnectionError, TurndError } from "./errors.js";
import type { Reconciled } from "./types.js";

export const PROTOCOL_VERSION = 1;
/** Close code of a worker connection superseded by a newer `hello` with the same `worker_id`. */
export const CLOSE_SUPERSEDED = 4001;

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

/** A push frame: `{"push": "invoke" | "cancel" | "probe" | "event", ...}`. */
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
  resolve: (ok: unknown) => void;
  reject: (err: Error) => void;
  onOk: ((ok: unknown) => void) | undefined;
}

/** `server.max_frame_bytes` when the daemon has not said otherwise. */
export const DEFAULT_MAX_FRAME_BYTES = 1_048_576;

/** How many server heartbeat intervals of silence end the connection. */
const SILENT_INTERVALS = 3;

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
   * Open a connection to `url` and say `hello`. Rejects with {@link ConnectionError}
   * when the daemon cannot be reached, or with {@link TurndError} when it refuses
   * the `hello` (the socket is closed then).
   */
  static open(
    url: string,
    hello: HelloArgs,
    opts: ConnectOptions = {},
  ): Promise<{ conn: Connection; hello: HelloOk }> {
    const timeoutMs = opts.connectTimeoutMs ?? 10_000;
    return new Promise((resolve, reject) => {
      let settled = false;
      const ws = new WebSocket(url, {
        handshakeTimeout: timeoutMs,
        perMessageDeflate: false,
        maxPayload: 256 * 1024 * 1024,
      });
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
      ws.once("error", (err) => {
        fail(new ConnectionError(`cannot connect to ${url}: ${err.message}`, { cause: err }));
      });
      ws.once("close", (code) => {
        fail(new ConnectionError(`connection to ${url} closed during hello (code ${code})`));
      });
      ws.once("open", () => {
        conn
          .request("hello", hello)
          .then((ok) => {
            if (settled) return;
            settled = true;
            clearTimeout(timer);
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
            if (helloOk.maxFrameBytes > 0) conn.frameLimit = helloOk.maxFrameBytes;
            conn.startWatchdog(helloOk.heartbeatMs);
            resolve({ conn, hello: helloOk });
          })
          .catch((err: Error) => fail(err));
      });
    });
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
    if (this.ended || this.ws.readyState !== WebSocket.OPEN) {
      return Promise.reject(new ConnectionError(`not connected (${op})`));
    }
    const id = this.nextId++;
    const text = JSON.stringify({ id, op, args });
    const size = Buffer.byteLength(text);
    if (size > this.frameLimit) {
      // The daemon would answer too_large and close the connection (1009); refusing
      // here keeps the connection and makes the error the caller's, not a reconnect.
      return Promise.reject(
        new TurndError("too_large", `request of ${size} bytes exceeds max_frame_bytes ${this.frameLimit}`, false, op),
      );
    }
    return new Promise((resolve, reject) => {
      this.pending.set(id, { op, resolve, reject, onOk });
      this.ws.send(text, (err) => {
        if (err && this.pending.delete(id)) {
          reject(new ConnectionError(`send failed (${op}): ${err.message}`, { cause: err }));
        }
      });
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
    if (typeof frame.id !== "number") return; // `id: null` errors precede a close.
    const p = this.pending.get(frame.id);
    if (!p) return;
    this.pending.delete(frame.id);
    if ("error" in frame && frame.error && typeof frame.error === "object") {
      const e = frame.error as Record<string, unknown>;
      p.reject(
        new TurndError(
          String(e.code ?? "internal"),
          String(e.message ?? ""),
          e.retryable === true,
          p.op,
        ),
      );
      return;
    }
    const ok = frame.ok ?? {};
    try {
      p.onOk?.(ok);
    } finally {
      p.resolve(ok);
    }
  }

  private finish(code: number, reason: string): void {
    if (this.ended) return;
    this.ended = true;
    this.endCode = code;
    if (this.watchdog) clearInterval(this.watchdog);
    const err = new ConnectionError(`connection closed (code ${code}${reason ? `: ${reason}` : ""})`);
    for (const p of this.pending.values()) p.reject(err);
    this.pending.clear();
    this.resolveEnded();
    this.onClose?.(code, reason);
  }
}
