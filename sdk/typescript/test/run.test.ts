/** `Worker.run()` in its own process: SIGTERM drains running handlers before exit. */
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { fileURLToPath } from "node:url";
import { after, before, it } from "node:test";
import type { Client } from "../src/index.js";
import type { Turnd } from "../src/testing.js";
import { client, daemon, sleep, until } from "./helpers.js";

let turnd: Turnd;
let c: Client;
before(async () => {
  turnd = await daemon();
  c = await client(turnd.url);
});
after(async () => {
  await c.close();
  await turnd.stop();
});

it("SIGTERM lets the running handler finish, delivers its result, then exits 0", { timeout: 15_000 }, async () => {
  const script = fileURLToPath(new URL("./fixtures/sigterm-worker.js", import.meta.url));
  const child = spawn(process.execPath, [script], {
    env: { ...process.env, TURND_URL: turnd.url, WORKER_ID: "sigterm-worker" },
    stdio: ["ignore", "pipe", "inherit"],
  });
  let out = "";
  child.stdout.setEncoding("utf8");
  child.stdout.on("data", (s: string) => {
    out += s;
  });
  const exit = new Promise<number | null>((resolve) => child.once("exit", (code) => resolve(code)));
  try {
    await until("the worker to connect", () => out.includes("state connected"));
    const running = await c.submit("sigterm-1", "run.slow", { ms: 600 });
    // Another session: it could run as soon as the worker has a free slot.
    const queued = await c.submit("sigterm-2", "run.slow", { ms: 0 });
    await until("the turn to run", async () => (await c.get(running.turnId)).status === "running");
    child.kill("SIGTERM");
    assert.equal(await exit, 0);
    assert.match(out, /state draining\n(.|\n)*state stopped\ndrained\n/);
    const turn = await c.get(running.turnId);
    assert.equal(turn.status, "completed");
    assert.deepEqual(turn.output, { slept: 600 });
    // The worker unregistered before draining: the next turn was not dispatched to it.
    await sleep(50);
    assert.equal((await c.get(queued.turnId)).status, "queued");
    await c.stop(queued.turnId);
  } finally {
    child.kill("SIGKILL");
  }
});
