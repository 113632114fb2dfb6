/** The examples in examples/typescript run against the real daemon as documented. */
import assert from "node:assert/strict";
import { execFile, spawn } from "node:child_process";
import { type AddressInfo, createServer } from "node:net";
import { after, before, it } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { connect } from "../src/index.js";
import type { Turnd } from "../src/testing.js";
import { daemon, until } from "./helpers.js";

const run = promisify(execFile);
const example = (name: string) =>
  fileURLToPath(new URL(`../../../examples/typescript/${name}.js`, import.meta.url));

/** A URL nobody listens on (a port bound, then released). */
async function deadUrl(): Promise<string> {
  const s = createServer();
  await new Promise<void>((resolve) => s.listen(0, "127.0.0.1", resolve));
  const { port } = s.address() as AddressInfo;
  await new Promise<void>((resolve) => s.close(() => resolve()));
  return `ws://127.0.0.1:${port}/v1`;
}

let turnd: Turnd;
before(async () => {
  turnd = await daemon();
});
after(async () => {
  await turnd.stop();
});

it("the agent worker answers the caller in several steps, and drains on SIGTERM", { timeout: 20_000 }, async () => {
  const worker = spawn(process.execPath, [example("agent-worker")], {
    env: { ...process.env, TURND_URL: turnd.url, WORKER_ID: "example-agent" },
    stdio: ["ignore", "ignore", "pipe"],
  });
  let log = "";
  worker.stderr.setEncoding("utf8");
  worker.stderr.on("data", (s: string) => {
    log += s;
  });
  const exited = new Promise<number | null>((resolve) => worker.once("exit", (code) => resolve(code)));
  try {
    await until("the worker to connect", () => log.includes("[worker] connected"));
    // A cluster's list whose first node is down: the caller connects to the next.
    const env = { ...process.env, TURND_URL: `${await deadUrl()},${turnd.url}`, SESSION_ID: "example-1" };
    const { stdout } = await run(process.execPath, [example("caller"), "what is 6 * 7 and the date?"], { env });
    assert.match(stdout, /^turn t_\S+ \(new\), running\n/);
    assert.match(stdout, /calculator\(6 \* 7\) = 42/);
    assert.match(stdout, /clock\(\) = \d{4}-/);
    assert.match(stdout, /#\d+ completed step 2\n/);
    // The same question again: the idempotency key returns the same turn.
    const again = await run(process.execPath, [example("caller"), "what is 6 * 7 and the date?"], { env });
    assert.match(again.stdout, /\(already submitted\), completed/);
    worker.kill("SIGTERM");
    assert.equal(await exited, 0);
    assert.match(log, /\[worker\] stopped/);
  } finally {
    worker.kill("SIGKILL");
  }
});

/** Start an example's worker (`node EXAMPLE.js worker`) and wait until it is connected. */
async function exampleWorker(name: string): Promise<{ log: () => string; stop: () => Promise<number | null> }> {
  const child = spawn(process.execPath, [example(name), "worker"], {
    env: { ...process.env, TURND_URL: turnd.url },
    stdio: ["ignore", "ignore", "pipe"],
  });
  let log = "";
  child.stderr.setEncoding("utf8");
  child.stderr.on("data", (s: string) => {
    log += s;
  });
  const exited = new Promise<number | null>((resolve) => child.once("exit", (code) => resolve(code)));
  try {
    await until(`the ${name} worker to connect`, () => log.includes("[worker] connected"));
  } catch (err) {
    child.kill("SIGKILL");
    throw err;
  }
  return {
    log: () => log,
    stop: async () => {
      child.kill("SIGTERM");
      const timer = setTimeout(() => child.kill("SIGKILL"), 10_000);
      const code = await exited;
      clearTimeout(timer);
      return code;
    },
  };
}

const env = (sessionId: string) => ({ ...process.env, TURND_URL: turnd.url, SESSION_ID: sessionId });

it("the streaming echo prints the tokens as they come, then the answer", { timeout: 20_000 }, async () => {
  const worker = await exampleWorker("streaming-echo");
  try {
    const { stdout } = await run(process.execPath, [example("streaming-echo"), "ask", "the quick brown fox"], {
      env: env("echo-1"),
    });
    assert.equal(stdout, "the quick brown fox\nanswer: the quick brown fox\n");
  } finally {
    assert.equal(await worker.stop(), 0);
  }
});

it("the approval step waits for the answer and acts on it", { timeout: 20_000 }, async () => {
  const worker = await exampleWorker("approval");
  try {
    const asked = await run(process.execPath, [example("approval"), "request", "billing"], { env: env("deploys") });
    const m = /^(t_\S+) asks: Deploy billing latest to production\? \(yes\/no\)\n$/.exec(asked.stdout);
    assert.ok(m, asked.stdout);
    const turnId = m[1] as string;
    const answered = await run(process.execPath, [example("approval"), "answer", turnId, "yes"], { env: env("deploys") });
    const prefix = `${turnId} completed: `;
    assert.ok(answered.stdout.startsWith(prefix), answered.stdout);
    assert.deepEqual(JSON.parse(answered.stdout.slice(prefix.length)), {
      deployed: true,
      plan: { service: "billing", version: "latest" },
      by: "cli",
    });
    assert.match(worker.log(), /deploying billing latest/);
  } finally {
    assert.equal(await worker.stop(), 0);
  }
});

it("a second chat message interrupts the first, which the new reply mentions", { timeout: 30_000 }, async () => {
  const worker = await exampleWorker("chat");
  try {
    const first = run(process.execPath, [example("chat"), "say", "tell me a story"], { env: env("chat-1") });
    // Interrupt once the first reply has finished its first sentence (and streams the next).
    const watcher = await connect({ url: turnd.url });
    try {
      await until("the first reply's second sentence", async () =>
        (await watcher.list("chat-1")).turns.some((t) => t.step >= 2),
      );
    } finally {
      await watcher.close();
    }
    const second = await run(process.execPath, [example("chat"), "say", "a short one"], { env: env("chat-1") });
    const stopped = await first;
    assert.match(stopped.stdout, /^ You said: tell me a story\./);
    assert.match(stopped.stdout, /\n\[interrupted\]\n$/);
    assert.match(second.stdout, /\[completed\]\nreply: \(You cut me off after: 'You said: tell me a story\./);
    assert.match(second.stdout, /You said: a short one\. That is worth a long answer\./);
  } finally {
    assert.equal(await worker.stop(), 0);
  }
});
