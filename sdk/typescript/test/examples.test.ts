/** The examples in examples/typescript run against the real daemon as documented. */
import assert from "node:assert/strict";
import { execFile, spawn } from "node:child_process";
import { after, before, it } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import type { Turnd } from "../src/testing.js";
import { daemon, until } from "./helpers.js";

const run = promisify(execFile);
const example = (name: string) =>
  fileURLToPath(new URL(`../../../examples/typescript/${name}.js`, import.meta.url));

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
    const env = { ...process.env, TURND_URL: turnd.url, SESSION_ID: "example-1" };
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
