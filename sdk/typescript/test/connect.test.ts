/**
 * What can never work fails at once with the daemon's words, and only that: a URL
 * that is not one, a path the daemon does not serve, an upgrade a proxy refuses, a
 * `hello` or a request over the daemon's limits. A daemon that is not there yet, or
 * a proxy's 5xx, stays retryable.
 */
import assert from "node:assert/strict";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { after, before, describe, it } from "node:test";
import { BadUrl, type Client, ConnectionError, connect, TurndError, Worker } from "../src/index.js";
import { startTurnd, type Turnd } from "../src/testing.js";
import { client, daemon, worker } from "./helpers.js";

/** The time `f` took to settle, and what it rejected with (or `undefined`). */
async function timed(f: () => Promise<unknown>): Promise<{ ms: number; err: unknown }> {
  const start = Date.now();
  const err = await f().then(
    () => undefined,
    (e: unknown) => e,
  );
  return { ms: Date.now() - start, err };
}

/** Reject after `ms`: a request the daemon never answers must not pass for a slow one. */
function within<T>(ms: number, p: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const limit = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`no answer within ${ms} ms`)), ms);
  });
  return Promise.race([p, limit]).finally(() => clearTimeout(timer));
}

/**
 * "At once" is measured against a retry made long on purpose: a connect that retried
 * would wait at least 15 s before its second try (half of `reconnectDelayMs`, the
 * rest random) and go on for a minute, so a rejection within `AT_ONCE_MS` was not
 * retried, even when a loaded machine stalls the test for a few seconds.
 */
const NO_QUICK_RETRY = { reconnectDelayMs: 30_000, reconnectTimeoutMs: 60_000 };
const AT_ONCE_MS = 10_000;
/** A bound for `within`: a retrying connect is cut off there, well before its minute. */
const RETRY_CUT_MS = 20_000;

/** Nested arrays `depth` deep. */
function nested(depth: number): unknown {
  let v: unknown = "leaf";
  for (let i = 0; i < depth; i++) v = [v];
  return v;
}

/** An HTTP server that answers every request, upgrades included, with `status` and `body`. */
async function httpServer(status: number, body: string): Promise<{ url: string; server: Server; hits: () => number }> {
  let hits = 0;
  const server = createServer((_req, res) => {
    hits += 1;
    res.writeHead(status, { "content-type": "text/plain" }).end(body);
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  return {
    url: `ws://127.0.0.1:${(server.address() as AddressInfo).port}/v1`,
    server,
    hits: () => hits,
  };
}

describe("URLs that can never work", () => {
  let turnd: Turnd;

  before(async () => {
    turnd = await daemon();
  });
  after(async () => {
    await turnd.stop();
  });

  it("a URL that is not one, or not ws(s), fails connect() at once with BadUrl", async () => {
    for (const url of ["not a url at all", "ftp://127.0.0.1/v1"]) {
      const { ms, err } = await timed(() => within(RETRY_CUT_MS, connect({ url, ...NO_QUICK_RETRY })));
      assert.ok(err instanceof BadUrl, `expected BadUrl for ${url}, got ${String(err)}`);
      assert.ok(err instanceof ConnectionError);
      assert.equal(err.retryable, false);
      assert.equal(err.status, undefined);
      assert.ok(err.message.includes(JSON.stringify(url)), err.message);
      assert.ok(ms < AT_ONCE_MS, `${url}: rejected after ${ms} ms`);
    }
  });

  it("a path other than /v1 fails connect() at once with the daemon's 404 and its words", async () => {
    const url = turnd.url.replace(/\/v1$/, "");
    const { ms, err } = await timed(() => within(RETRY_CUT_MS, connect({ url, ...NO_QUICK_RETRY })));
    assert.ok(err instanceof BadUrl, String(err));
    assert.equal(err.status, 404);
    assert.equal(err.retryable, false);
    assert.match(err.message, /HTTP 404: no such path; protocol v1 is served at \/v1$/);
    assert.ok(ms < AT_ONCE_MS, `rejected after ${ms} ms`);
  });

  it("an upgrade refused for good is BadUrl at once; a 503 is retried until reconnectTimeoutMs", async () => {
    const forbidden = await httpServer(403, "forbidden by the proxy");
    const down = await httpServer(503, "upstream restarting");
    try {
      const refused = await timed(() => within(RETRY_CUT_MS, connect({ url: forbidden.url, ...NO_QUICK_RETRY })));
      assert.ok(refused.err instanceof BadUrl, String(refused.err));
      assert.equal(refused.err.status, 403);
      assert.match(refused.err.message, /HTTP 403: forbidden by the proxy$/);
      assert.ok(refused.ms < AT_ONCE_MS, `rejected after ${refused.ms} ms`);
      assert.equal(forbidden.hits(), 1);

      const passing = await timed(() => connect({ url: down.url, reconnectDelayMs: 20, reconnectTimeoutMs: 400 }));
      assert.ok(passing.err instanceof ConnectionError && !(passing.err instanceof BadUrl), String(passing.err));
      assert.equal(passing.err.retryable, true);
      assert.match(passing.err.message, /HTTP 503: upstream restarting$/);
      assert.ok(passing.ms >= 400, `gave up after ${passing.ms} ms`);
      assert.ok(down.hits() >= 2, `${down.hits()} attempts`);
    } finally {
      forbidden.server.close();
      down.server.close();
    }
  });

  it("a refused TCP connection stays retryable within reconnectTimeoutMs", async () => {
    const { ms, err } = await timed(() => connect({ url: "ws://127.0.0.1:1/v1", reconnectTimeoutMs: 300 }));
    assert.ok(err instanceof ConnectionError && !(err instanceof BadUrl), String(err));
    assert.equal(err.retryable, true);
    assert.ok(ms >= 300, `gave up after ${ms} ms`);
  });

  it("Worker.start() and run() reject at once on such a URL, and say why on stderr by default", async (t) => {
    const logged = t.mock.method(console, "error", () => {});
    const w = new Worker({
      url: turnd.url.replace(/\/v1$/, "/v2"),
      workerId: "w-bad-path",
      reconnectDelayMs: NO_QUICK_RETRY.reconnectDelayMs,
    });
    w.function("never", async () => null);
    const { ms, err } = await timed(() => within(RETRY_CUT_MS, w.start()));
    assert.ok(err instanceof BadUrl && err.status === 404, String(err));
    assert.ok(ms < AT_ONCE_MS, `rejected after ${ms} ms`);
    assert.equal(w.state, "stopped");
    const lines = logged.mock.calls.map((c) => String(c.arguments[0]));
    assert.ok(
      lines.some((l) => l.includes("w-bad-path") && l.includes("protocol v1 is served at /v1")),
      lines.join("\n"),
    );

    const ran = await timed(() =>
      within(
        RETRY_CUT_MS,
        new Worker({
          url: "not a url at all",
          workerId: "w-no-url",
          log: () => {},
          reconnectDelayMs: NO_QUICK_RETRY.reconnectDelayMs,
        }).run(),
      ),
    );
    assert.ok(ran.err instanceof BadUrl, String(ran.err));
    assert.ok(ran.ms < AT_ONCE_MS, `rejected after ${ran.ms} ms`);
  });
});

describe("requests over the daemon's limits", () => {
  let turnd: Turnd;
  let c: Client;

  before(async () => {
    turnd = await startTurnd({ config: { server: { max_frame_bytes: 1024, max_json_depth: 16 } } });
    c = await client(turnd.url);
  });
  after(async () => {
    await c.close();
    await turnd.stop();
  });

  it("a hello over max_frame_bytes fails at once with too_large, for a client and a worker", async () => {
    const token = "t".repeat(2000);
    const { ms, err } = await timed(() => within(RETRY_CUT_MS, connect({ url: turnd.url, token, ...NO_QUICK_RETRY })));
    assert.ok(err instanceof TurndError, String(err));
    assert.equal(err.code, "too_large");
    assert.equal(err.retryable, false);
    assert.equal(err.op, "hello");
    assert.match(err.message, /frame over max_frame_bytes \(1024\)/);
    assert.ok(ms < AT_ONCE_MS, `rejected after ${ms} ms`);

    const w = worker(turnd.url, { token, log: () => {}, reconnectDelayMs: NO_QUICK_RETRY.reconnectDelayMs });
    w.function("never", async () => null);
    const started = await timed(() => within(RETRY_CUT_MS, w.start()));
    assert.ok(started.err instanceof TurndError && started.err.code === "too_large", String(started.err));
    assert.equal(w.state, "stopped");
  });

  it("a request nested deeper than max_json_depth gets too_large; the others and the connection go on", async () => {
    const connection = c.hello?.connectionId;
    const [deep, deeper, fine] = await within(
      5000,
      Promise.allSettled([
        c.submit("deep-1", "f", nested(20), { idempotencyKey: "d1" }),
        c.submit("deep-2", "f", nested(30), { idempotencyKey: "d2" }),
        c.submit("deep-3", "f", nested(3)),
      ]),
    );
    for (const refused of [deep, deeper]) {
      assert.equal(refused?.status, "rejected");
      const err = refused?.status === "rejected" ? refused.reason : undefined;
      assert.ok(err instanceof TurndError && err.code === "too_large" && !err.retryable, String(err));
      assert.equal(err.op, "turn.submit");
      assert.match(err.message, /max_json_depth \(16\)/);
    }
    assert.equal(fine?.status, "fulfilled");
    await c.ping();
    assert.equal(c.hello?.connectionId, connection);
    // Neither refused turn was admitted.
    for (const s of ["deep-1", "deep-2"]) {
      const err = await c.inspect(s).catch((e: unknown) => e);
      assert.ok(err instanceof TurndError && err.code === "not_found", String(err));
    }
  });
});
