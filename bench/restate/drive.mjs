/**
 * The external driver's load against Restate (make bench-restate), for a side-by-side
 * comparison with turnd's (sdk/typescript/bench/throughput.ts, make bench-external).
 *
 *     node drive.mjs [--sessions 1000] [--turns 20] [--warmup 200] [--single 500] [--single-warmup 2000]
 *
 * The same shape on both: a session is a virtual object key (Restate runs one call of
 * a key at a time, as turnd runs one turn of a session), a turn is one call of the
 * object's `echo` handler. A Node service process (the Restate SDK) plays the worker;
 * this process plays the callers over HTTP: every session sends its calls one after
 * another (`/send`, each as soon as the previous send is acknowledged) and waits for
 * each in the background (`/restate/invocation/ID/attach`). Then one session alone
 * runs `--single` calls, each sent once the previous one returned, after
 * `--single-warmup` such calls not counted (as turnd's driver does; the first
 * `--single` of them are reported as the cold p99). The server's CPU
 * is read from /proc before and after the load. Prints one markdown row.
 */
import { spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { loadavg, tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

function arg(name, fallback) {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? Number(process.argv[i + 1]) : fallback;
}

async function freePort() {
  const server = createServer();
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  const { port } = server.address();
  await new Promise((r) => server.close(r));
  return port;
}

/** CPU seconds (user + system) of a process so far, from /proc. */
function cpuOf(pid) {
  const fields = readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1].split(" ");
  return (Number(fields[11]) + Number(fields[12])) / 100;
}

async function runService() {
  // The SDK calls Promise.withResolvers (Node 22); the project's Node is 20.
  Promise.withResolvers ??= () => {
    let resolve;
    let reject;
    const promise = new Promise((res, rej) => {
      resolve = res;
      reject = rej;
    });
    return { promise, resolve, reject };
  };
  const restate = await import("@restatedev/restate-sdk");
  const bench = restate.object({
    name: "bench",
    handlers: { echo: async (_ctx, input) => input },
  });
  await restate.endpoint().bind(bench).listen(Number(process.env.SERVICE_PORT));
  process.stdout.write("ready\n");
  let mark = process.cpuUsage();
  process.stdin.setEncoding("utf8");
  process.stdin.on("data", (text) => {
    if (text.includes("mark")) mark = process.cpuUsage();
    if (text.includes("report")) {
      process.stdout.write(`${JSON.stringify({ cpu: process.cpuUsage(mark), rss: process.memoryUsage().rss })}\n`);
    }
  });
}

async function until(what, check, ms = 60_000) {
  const deadline = Date.now() + ms;
  for (;;) {
    try {
      if (await check()) return;
    } catch {
      // not up yet
    }
    if (Date.now() > deadline) throw new Error(`${what}: not ready within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

async function post(url, body) {
  const res = await fetch(url, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  const text = await res.text();
  if (!res.ok) throw new Error(`${url}: ${res.status} ${text}`);
  return JSON.parse(text);
}

/** One call: sent, then attached to in the background; resolves with its latency (ms). */
async function call(ingress, key, input) {
  const start = performance.now();
  const sent = await post(`${ingress}/bench/${key}/echo/send`, input);
  return async () => {
    const res = await fetch(`${ingress}/restate/invocation/${sent.invocationId}/attach`);
    const out = await res.json();
    if (!res.ok || out.t !== input.t) throw new Error(`call ${sent.invocationId}: ${res.status} ${JSON.stringify(out)}`);
    return performance.now() - start;
  };
}

async function drive(ingress, sessions, turns, tag) {
  const latencies = [];
  await Promise.all(
    Array.from({ length: sessions }, async (_, s) => {
      const waits = [];
      for (let t = 0; t < turns; t++) {
        const attach = await call(ingress, `${tag}-${s}`, { s, t });
        waits.push(attach().then((ms) => latencies.push(ms)));
      }
      await Promise.all(waits);
    }),
  );
  return latencies.sort((a, b) => a - b);
}

/** One session alone: latencies (ms) in order. */
async function alone(ingress, turns) {
  const latencies = [];
  for (let t = 0; t < turns; t++) latencies.push(await (await call(ingress, "alone", { s: 0, t }))());
  return latencies;
}

const ascending = (values) => [...values].sort((a, b) => a - b);

const pct = (sorted, p) => (sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))] ?? 0).toFixed(1);

async function startServer(work) {
  const [ingressPort, adminPort, nodePort, servicePort] = [await freePort(), await freePort(), await freePort(), await freePort()];
  const server = spawn(
    join(fileURLToPath(new URL(".", import.meta.url)), "node_modules/@restatedev/restate-server-linux-x64/bin/restate-server"),
    ["--no-logo", "--listen-mode", "tcp", "--base-dir", work, "--node-name", "bench"],
    {
      env: {
        ...process.env,
        RESTATE_BIND_ADDRESS: `127.0.0.1:${nodePort}`,
        RESTATE_ADVERTISED_ADDRESS: `http://127.0.0.1:${nodePort}/`,
        RESTATE_INGRESS__BIND_ADDRESS: `127.0.0.1:${ingressPort}`,
        RESTATE_ADMIN__BIND_ADDRESS: `127.0.0.1:${adminPort}`,
        RESTATE_LOG_FILTER: "warn",
      },
      stdio: ["ignore", "ignore", "inherit"],
    },
  );
  const admin = `http://127.0.0.1:${adminPort}`;
  await until("restate-server", async () => (await fetch(`${admin}/health`)).ok);
  return { server, admin, ingress: `http://127.0.0.1:${ingressPort}`, servicePort };
}

async function main() {
  if (process.argv.includes("--role-service")) return runService();
  const sessions = arg("sessions", 1000);
  const turns = arg("turns", 20);
  const warmup = arg("warmup", 200);
  const single = arg("single", 500);
  const singleWarmup = arg("single-warmup", 2000);
  const work = mkdtempSync(join(tmpdir(), "restate-bench-"));
  const { server, admin, ingress, servicePort } = await startServer(work);
  const service = spawn(process.execPath, [fileURLToPath(import.meta.url), "--role-service"], {
    env: { ...process.env, SERVICE_PORT: String(servicePort) },
    stdio: ["pipe", "pipe", "inherit"],
  });
  let out = "";
  service.stdout.setEncoding("utf8");
  service.stdout.on("data", (s) => {
    out += s;
  });
  // The SDK logs to stdout too: the service's own lines are "ready" and one JSON object.
  const line = async (test) => {
    for (;;) {
      const found = out.split("\n").find(test);
      if (found !== undefined) return found;
      await new Promise((r) => setTimeout(r, 10));
    }
  };
  try {
    await line((l) => l === "ready");
    await post(`${admin}/deployments`, { uri: `http://127.0.0.1:${servicePort}` });
    await until("ingress", async () => (await fetch(`${ingress}/bench/probe/echo`, { method: "POST", headers: { "content-type": "application/json" }, body: '{"t":0}' })).ok);
    if (warmup > 0) await drive(ingress, Math.min(sessions, warmup), 1, "warmup");
    service.stdin.write("mark\n");
    await new Promise((r) => setTimeout(r, 50));
    const load0 = loadavg()[0];
    const serverCpu0 = cpuOf(server.pid);
    const callerCpu0 = process.cpuUsage();
    const t0 = performance.now();
    const latencies = await drive(ingress, sessions, turns, "bench");
    const wall = (performance.now() - t0) / 1000;
    const callerCpu = process.cpuUsage(callerCpu0);
    const load1 = loadavg()[0];
    const serverCpu = cpuOf(server.pid) - serverCpu0;
    service.stdin.write("report\n");
    const report = JSON.parse(await line((l) => l.startsWith("{")));
    const run = await alone(ingress, singleWarmup + single);
    const solo = ascending(run.slice(singleWarmup));
    const cold = singleWarmup > 0 ? ascending(run.slice(0, Math.min(single, singleWarmup))) : null;
    const coldText = cold ? ` after ${singleWarmup} not counted (the first ${cold.length}: p99 ${pct(cold, 99)} ms)` : "";
    const total = sessions * turns;
    const perTurn = (s) => ((s / total) * 1e6).toFixed(0);
    const serviceS = (report.cpu.user + report.cpu.system) / 1e6;
    const callerS = (callerCpu.user + callerCpu.system) / 1e6;
    console.log(
      `| Restate 1.7.12 \`node drive.mjs --sessions ${sessions} --turns ${turns}\` | ${sessions} × ${turns} | ` +
        `${wall.toFixed(2)} s | ${Math.round(total / wall)} turns/s | ${pct(latencies, 50)} / ${pct(latencies, 99)} ms | ` +
        `server CPU ${serverCpu.toFixed(2)} s (${perTurn(serverCpu)} µs per turn) | ` +
        `driver CPU ${(serviceS + callerS).toFixed(2)} s (${perTurn(serviceS + callerS)} µs per turn: ` +
        `service ${perTurn(serviceS)}, callers ${perTurn(callerS)}) | ` +
        `one session alone, ${single} turns${coldText}: ${pct(solo, 50)} / ${pct(solo, 99)} ms | ` +
        `load ${load0.toFixed(1)} → ${load1.toFixed(1)} |`,
    );
  } finally {
    service.kill("SIGKILL");
    server.kill("SIGKILL");
    await new Promise((r) => server.once("exit", r));
    rmSync(work, { recursive: true, force: true });
  }
}

await main();
