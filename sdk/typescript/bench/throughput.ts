/**
 * Throughput of one Node worker process: S sessions × M one-step echo turns, measured
 * from outside the daemon (`make bench-external`, `make bench-sdk-typescript`).
 *
 *     node build/sdk/typescript/bench/throughput.js [--sessions 100] [--turns 20] [--concurrency 128]
 *                                    [--warmup 200] [--single 500] [--single-warmup 2000]
 *                                    [--connections N] [--binary PATH] [--messages 0]
 *
 * Starts a real daemon (`--binary`, else $TURND_BIN, else `turnd` on the PATH) on
 * free ports with a fresh data directory and the default config (durable commits),
 * runs the worker in a child process of its own (so its CPU is its own), and drives
 * the load from this process over `--connections` caller connections (at least 8, one
 * per 800 turns by default, so that a connection's waits stay within the daemon's
 * `server.max_inflight_per_connection` of 1024): every session submits its
 * turns one after another (each as soon as the previous submit is acknowledged) and
 * waits for each in the background. The daemon's CPU is read from /proc before and
 * after the load, each time once its store has written to sled what the load left
 * waiting (so that the writes a load defers count as its own), the driver's (callers
 * and worker) from the processes themselves.
 * Then one session alone runs `--single` turns, each submitted once the previous one
 * completed: the latency of a turn on an idle daemon. They come after
 * `--single-warmup` such turns of the same session that are not counted: in its first
 * few thousand sequential turns a Node process's p99 is that of V8 compiling and
 * tiering up the SDK's code (3 – 5 ms, against a warm daemon as much as a fresh one;
 * `docs/benchmarks.md`), not the daemon's. The first `--single` of them are reported
 * too, as the cold p99. `--messages N` gives each turn
 * of the load an input like an agent's, a conversation of N chat messages (about
 * 170 bytes of JSON each), which the worker echoes as the output. Prints one markdown row, or with
 * `--json` one JSON object of the same numbers (what `bench/ab.ts` reads).
 */
import { spawn } from "node:child_process";
import { readFileSync } from "node:fs";
import { loadavg } from "node:os";
import { fileURLToPath } from "node:url";
import { type Client, connect, Worker } from "../src/index.js";
import { startTurnd } from "../src/testing.js";

function arg(name: string, fallback: number): number {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? Number(process.argv[i + 1]) : fallback;
}
function argStr(name: string): string | undefined {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? process.argv[i + 1] : undefined;
}

async function runWorker(): Promise<void> {
  const url = process.env.TURND_URL ?? "";
  const concurrency = Number(process.env.CONCURRENCY ?? "128");
  const worker = new Worker({ url, workerId: "bench-node-worker", drainTimeoutMs: 5000 });
  worker.function("bench.echo", { concurrency }, async (_ctx, input) => input);
  await worker.start();
  process.stdout.write("ready\n");
  process.stdin.resume();
  process.stdin.setEncoding("utf8");
  let mark = process.cpuUsage();
  process.stdin.on("data", async (text: string) => {
    if (text.includes("mark")) mark = process.cpuUsage();
    if (text.includes("report")) {
      const cpu = process.cpuUsage(mark);
      const rss = process.memoryUsage().rss;
      process.stdout.write(`${JSON.stringify({ cpu, rss, stats: worker.stats })}\n`);
    }
    if (!text.includes("stop")) return;
    await worker.stop(1000);
    process.exit(0);
  });
}

/** A conversation of `n` chat messages, as an agent's turn carries it. */
function conversation(n: number): { role: string; content: string }[] {
  return Array.from({ length: n }, (_, i) => ({
    role: i % 2 === 0 ? "user" : "assistant",
    content: `Message ${i} of the conversation: the quick brown fox jumps over the lazy dog, and a few more words to give it the length of a short chat turn.`,
  }));
}

async function drive(
  clients: Client[],
  sessions: number,
  turns: number,
  tag: string,
  messages: { role: string; content: string }[] = [],
): Promise<number[]> {
  const latencies: number[] = [];
  await Promise.all(
    Array.from({ length: sessions }, async (_, s) => {
      const c = clients[s % clients.length] as Client;
      const waits: Promise<void>[] = [];
      for (let t = 0; t < turns; t++) {
        const start = performance.now();
        const input = messages.length > 0 ? { s, t, messages } : { s, t };
        const turn = await c.submit(`${tag}-${s}`, "bench.echo", input);
        waits.push(
          c.wait(turn.turnId).then((done) => {
            if (done.status !== "completed") throw new Error(`turn ${done.turnId} ${done.status}`);
            latencies.push(performance.now() - start);
          }),
        );
      }
      await Promise.all(waits);
    }),
  );
  return latencies;
}

/** One session alone: each turn submitted once the previous one completed; latencies (ms), in order. */
async function sequential(client: Client, turns: number): Promise<number[]> {
  const latencies: number[] = [];
  for (let t = 0; t < turns; t++) {
    const start = performance.now();
    const turn = await client.submit("alone", "bench.echo", { t });
    const done = await client.wait(turn.turnId);
    if (done.status !== "completed") throw new Error(`turn ${done.turnId} ${done.status}`);
    latencies.push(performance.now() - start);
  }
  return latencies;
}

/** Sorted ascending, for [`pct`]. */
function ascending(values: number[]): number[] {
  return [...values].sort((a, b) => a - b);
}

/** What one run measured, as `--json` prints it. */
export interface RunResult {
  sessions: number;
  turns: number;
  wallS: number;
  turnsPerS: number;
  /** A turn's latency under the load, submit to completion. */
  p50Ms: number;
  p99Ms: number;
  /** The daemon's CPU (user + system, /proc) over the load, until its store settled. */
  daemonCpuS: number;
  daemonUsPerTurn: number;
  /** How long after the last turn the store settled (null: it did not within 30 s). */
  settledS: number | null;
  workerUsPerTurn: number;
  callersUsPerTurn: number;
  /** One session alone, each turn submitted once the previous one completed, after
   * `--single-warmup` such turns not counted. */
  aloneP50Ms: number;
  aloneP99Ms: number;
  /** The p99 of the first `--single` of the warm-up turns (null without a warm-up). */
  aloneColdP99Ms: number | null;
  /** The one-minute load average before and after the load. */
  load: [number, number];
}

/** The `p`th percentile of `sorted`, to 0.1. */
function pct(sorted: number[], p: number): number {
  const v = sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))] ?? 0;
  return Number(v.toFixed(1));
}

/** CPU seconds (user + system) of a process so far, from /proc (Linux; 0 elsewhere). */
function cpuOf(pid: number): number {
  try {
    const fields = readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1]?.split(" ") ?? [];
    return (Number(fields[11]) + Number(fields[12])) / 100;
  } catch {
    return 0;
  }
}

/**
 * Wait until the daemon's store has written everything committed to sled
 * (`turnd_storage_unapplied_keys` 0 on its metrics), at most `limitMs`; the seconds
 * waited, or undefined when it had not. The writes a load leaves waiting their delay
 * (`storage.apply_delay_ms`) are part of what it cost, and a phase that begins with
 * them still waiting would count another's. Polled every 100 ms: each poll costs the
 * daemon a metrics page.
 */
async function settled(adminUrl: string, limitMs = 30000): Promise<number | undefined> {
  const t0 = performance.now();
  while (performance.now() - t0 < limitMs) {
    const text = await (await fetch(`${adminUrl}/metrics`)).text();
    const m = /^turnd_storage_unapplied_keys (\d+)$/m.exec(text);
    if (m && Number(m[1]) === 0) return (performance.now() - t0) / 1000;
    await new Promise((r) => setTimeout(r, 100));
  }
  return undefined;
}

async function main(): Promise<void> {
  if (process.argv.includes("--role-worker")) return runWorker();
  const sessions = arg("sessions", 100);
  const turns = arg("turns", 20);
  const concurrency = arg("concurrency", 128);
  const warmup = arg("warmup", 200);
  const single = arg("single", 500);
  const singleWarmup = arg("single-warmup", 2000);
  const messages = conversation(arg("messages", 0));
  const connections = arg("connections", Math.max(8, Math.ceil((sessions * turns) / 800)));
  const binary = argStr("binary");
  const turnd = await startTurnd(binary ? { binary } : {});
  const script = fileURLToPath(import.meta.url);
  const child = spawn(process.execPath, [script, "--role-worker"], {
    env: { ...process.env, TURND_URL: turnd.url, CONCURRENCY: String(concurrency) },
    stdio: ["pipe", "pipe", "inherit"],
  });
  let out = "";
  child.stdout.setEncoding("utf8");
  child.stdout.on("data", (s: string) => {
    out += s;
  });
  const lines = async (n: number) => {
    while (out.split("\n").length <= n) await new Promise((r) => setTimeout(r, 10));
    return out.split("\n");
  };
  try {
    await lines(1);
    const clients = await Promise.all(Array.from({ length: connections }, () => connect({ url: turnd.url })));
    if (warmup > 0) await drive(clients, Math.min(sessions, warmup), 1, "warmup");
    child.stdin.write("mark\n");
    await new Promise((r) => setTimeout(r, 50));
    if ((await settled(turnd.adminUrl)) === undefined) throw new Error("the store did not settle after the warm-up");
    const load0 = loadavg()[0] ?? 0;
    const daemonCpu0 = cpuOf(turnd.pid);
    const callerCpu0 = process.cpuUsage();
    const t0 = performance.now();
    const latencies = await drive(clients, sessions, turns, "bench", messages);
    const wall = (performance.now() - t0) / 1000;
    const callerCpu = process.cpuUsage(callerCpu0);
    const load1 = loadavg()[0] ?? 0;
    const settle = await settled(turnd.adminUrl);
    const daemonCpu = cpuOf(turnd.pid) - daemonCpu0;
    child.stdin.write("report\n");
    const report = JSON.parse((await lines(2))[1] ?? "{}") as {
      cpu: { user: number; system: number };
      rss: number;
      stats: { invocationsStarted: number };
    };
    const run = await sequential(clients[0] as Client, singleWarmup + single);
    const alone = ascending(run.slice(singleWarmup));
    const cold = singleWarmup > 0 ? ascending(run.slice(0, Math.min(single, singleWarmup))) : null;
    child.stdin.write("stop\n");
    await Promise.all(clients.map((c) => c.close()));
    latencies.sort((a, b) => a - b);
    const total = sessions * turns;
    const cpuS = (report.cpu.user + report.cpu.system) / 1e6;
    const callerS = (callerCpu.user + callerCpu.system) / 1e6;
    const result: RunResult = {
      sessions,
      turns,
      wallS: wall,
      turnsPerS: total / wall,
      p50Ms: pct(latencies, 50),
      p99Ms: pct(latencies, 99),
      daemonCpuS: daemonCpu,
      daemonUsPerTurn: (daemonCpu / total) * 1e6,
      settledS: settle ?? null,
      workerUsPerTurn: (cpuS / total) * 1e6,
      callersUsPerTurn: (callerS / total) * 1e6,
      aloneP50Ms: pct(alone, 50),
      aloneP99Ms: pct(alone, 99),
      aloneColdP99Ms: cold ? pct(cold, 99) : null,
      load: [load0, load1],
    };
    if (process.argv.includes("--json")) {
      console.log(JSON.stringify(result));
      return;
    }
    const driverUs = result.workerUsPerTurn + result.callersUsPerTurn;
    const more = messages.length > 0 ? ` --messages ${messages.length}` : "";
    const cmd = `node build/sdk/typescript/bench/throughput.js --sessions ${sessions} --turns ${turns} --concurrency ${concurrency}${more}`;
    const coldText = cold ? ` after ${singleWarmup} not counted (the first ${cold.length}: p99 ${pct(cold, 99).toFixed(1)} ms)` : "";
    console.log(
      `| \`${cmd}\` | ${sessions} × ${turns} | ${result.wallS.toFixed(2)} s | ${Math.round(result.turnsPerS)} turns/s | ` +
        `${result.p50Ms.toFixed(1)} / ${result.p99Ms.toFixed(1)} ms | ` +
        `daemon CPU ${daemonCpu.toFixed(2)} s (${result.daemonUsPerTurn.toFixed(0)} µs per turn, ` +
        `${settle === undefined ? "store NOT settled" : `until the store settled ${settle.toFixed(2)} s after the last turn`}) | ` +
        `driver CPU ${(cpuS + callerS).toFixed(2)} s (${driverUs.toFixed(0)} µs per turn: ` +
        `worker ${result.workerUsPerTurn.toFixed(0)}, callers ${result.callersUsPerTurn.toFixed(0)}), worker RSS ${(report.rss / 2 ** 20).toFixed(0)} MB | ` +
        `one session alone, ${single} turns${coldText}: ${result.aloneP50Ms.toFixed(1)} / ${result.aloneP99Ms.toFixed(1)} ms | ` +
        `load ${load0.toFixed(1)} → ${load1.toFixed(1)} |`,
    );
  } finally {
    child.kill("SIGKILL");
    await turnd.stop();
  }
}

await main();
