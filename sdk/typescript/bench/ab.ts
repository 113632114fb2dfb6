/**
 * Builds of the daemon (or one build under different settings, or the SDK's driver of
 * another build) measured against each other by the external driver, interleaved:
 * `make bench-external-ab`.
 *
 *     node build/sdk/typescript/bench/ab.js --build old=/tmp/old/turnd --build new=target/release/turnd
 *                                           [--env new:TURND_STORAGE__SYNC=never] [--rounds 6] [--base DIR]
 *                                           [--driver old:/tmp/sdk/build/sdk/typescript/bench/throughput.js]
 *                                           [--sessions 1000] [--turns 20] [--single 500] [--messages 0]
 *
 * Each round runs `bench/throughput.js --json` once per build, in a fresh daemon and
 * data directory, the builds' order reversed every other round so that neither always
 * runs first (a relative PATH is taken from `--base`, else the current directory);
 * `--env LABEL:KEY=VALUE` sets a variable for that build's daemon only
 * (the daemon takes its settings from `TURND_*` variables), and `--driver LABEL:PATH`
 * runs that build with the `throughput.js` at PATH (the SDK's callers and worker of
 * another build of it) in place of this one's. On a shared machine one
 * run's CPU per turn varies by ±10 %: only many interleaved rounds tell a change of a
 * few per cent, so the summary gives each build's mean, its range and, against the
 * first build, the rounds it was lower in. Prints a line per run, then a markdown table.
 */
import { spawn } from "node:child_process";
import { resolve } from "node:path";
import { fileURLToPath } from "node:url";
import type { RunResult } from "./throughput.js";

interface Build {
  label: string;
  binary: string;
  env: Record<string, string>;
  /** The driver script this build runs with (`--driver`), else this build's own. */
  driver?: string;
}

function args(name: string): string[] {
  const out: string[] = [];
  process.argv.forEach((a, i) => {
    const v = process.argv[i + 1];
    if (a === `--${name}` && v !== undefined) out.push(v);
  });
  return out;
}

function num(name: string, fallback: number, min = 1): number {
  const v = args(name).at(-1);
  if (v === undefined) return fallback;
  const n = Number(v);
  if (!Number.isInteger(n) || n < min) throw new Error(`--${name} takes a whole number of at least ${min}, not ${v}`);
  return n;
}

function builds(): Build[] {
  const list = args("build").map((b): Build => {
    const eq = b.indexOf("=");
    if (eq < 1 || eq === b.length - 1) throw new Error(`--build takes LABEL=PATH, not ${b}`);
    const binary = resolve(base(), b.slice(eq + 1));
    return { label: b.slice(0, eq), binary, env: {} };
  });
  if (list.length < 2) throw new Error("name at least two builds: --build LABEL=PATH --build LABEL=PATH");
  if (new Set(list.map((b) => b.label)).size !== list.length) throw new Error("each --build needs a label of its own");
  for (const e of args("env")) {
    const m = /^([^:]+):([A-Za-z_][A-Za-z0-9_]*)=(.*)$/.exec(e);
    const build = m ? list.find((b) => b.label === m[1]) : undefined;
    if (!m || !build) throw new Error(`--env takes LABEL:KEY=VALUE for a named build, not ${e}`);
    build.env[m[2] as string] = m[3] as string;
  }
  for (const d of args("driver")) {
    const m = /^([^:]+):(.+)$/.exec(d);
    const build = m ? list.find((b) => b.label === m[1]) : undefined;
    if (!m || !build) throw new Error(`--driver takes LABEL:PATH for a named build, not ${d}`);
    build.driver = resolve(base(), m[2] as string);
  }
  return list;
}

/** Where relative paths are taken from. */
function base(): string {
  return args("base").at(-1) ?? process.cwd();
}

/** One run of the driver against `build`: its JSON result. */
function run(build: Build, load: string[]): Promise<RunResult> {
  const script = build.driver ?? fileURLToPath(new URL("./throughput.js", import.meta.url));
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [script, "--json", "--binary", build.binary, ...load], {
      env: { ...process.env, ...build.env },
      stdio: ["ignore", "pipe", "pipe"],
    });
    let out = "";
    let err = "";
    child.stdout.setEncoding("utf8").on("data", (s: string) => {
      out += s;
    });
    child.stderr.setEncoding("utf8").on("data", (s: string) => {
      err += s;
    });
    child.once("error", reject);
    child.once("close", (code) => {
      const line = out.trim().split("\n").at(-1) ?? "";
      if (code !== 0 || !line.startsWith("{")) {
        reject(new Error(`the driver against ${build.label} ended with ${code}: ${err.trim().slice(-2000)}`));
        return;
      }
      resolve(JSON.parse(line) as RunResult);
    });
  });
}

/** The driver's CPU per turn: its worker's and its callers'. */
function driverUs(x: RunResult): number {
  return x.workerUsPerTurn + x.callersUsPerTurn;
}

function mean(xs: number[]): number {
  return xs.reduce((a, b) => a + b, 0) / xs.length;
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  const mid = Math.floor(s.length / 2);
  return s.length % 2 ? (s[mid] as number) : ((s[mid - 1] as number) + (s[mid] as number)) / 2;
}

async function main(): Promise<void> {
  const list = builds();
  const rounds = num("rounds", 6);
  const load = ["sessions", "turns", "single", "warmup", "messages"].flatMap((k) =>
    args(k).length === 0 ? [] : [`--${k}`, String(num(k, 1, k === "warmup" || k === "messages" ? 0 : 1))],
  );
  const results = new Map<string, RunResult[]>(list.map((b) => [b.label, []]));
  for (let r = 1; r <= rounds; r++) {
    const order = r % 2 === 1 ? list : [...list].reverse();
    for (const b of order) {
      const res = await run(b, load);
      results.get(b.label)?.push(res);
      console.log(
        `round ${r} ${b.label}: ${res.turnsPerS.toFixed(0)} turns/s, daemon ${res.daemonUsPerTurn.toFixed(1)} µs/turn, ` +
          `driver ${driverUs(res).toFixed(1)} µs/turn, ` +
          `alone p50/p99 ${res.aloneP50Ms} / ${res.aloneP99Ms} ms (cold p99 ${res.aloneColdP99Ms ?? "–"}), load ${res.load[0].toFixed(1)} → ${res.load[1].toFixed(1)}` +
          (res.settledS === null ? ", store NOT settled" : ""),
      );
    }
  }
  const first = results.get((list[0] as Build).label) ?? [];
  const env = (b: Build) =>
    Object.entries(b.env)
      .map(([k, v]) => `${k}=${v}`)
      .join(" ");
  console.log(
    "\n| build | daemon CPU per turn, mean (range) | lower than the first build | turns/s, mean | driver CPU per turn, mean (worker + callers) | driver lower than the first build | one session alone, median p50 / p99 |",
  );
  console.log("|---|---|---|---|---|---|---|");
  for (const b of list) {
    const rs = results.get(b.label) ?? [];
    const us = rs.map((x) => x.daemonUsPerTurn);
    const lower = (of: (x: RunResult) => number) =>
      b === list[0] ? "" : `${rs.filter((x, i) => of(x) < (first[i] ? of(first[i]) : 0)).length} of ${rs.length}`;
    const label = [env(b), b.driver ? `driver ${b.driver}` : ""].filter((x) => x).join(", ");
    console.log(
      `| ${b.label}${label ? ` (${label})` : ""} | ${mean(us).toFixed(1)} µs (${Math.min(...us).toFixed(0)} – ${Math.max(...us).toFixed(0)}) | ${lower((x) => x.daemonUsPerTurn)} | ` +
        `${mean(rs.map((x) => x.turnsPerS)).toFixed(0)} | ${mean(rs.map(driverUs)).toFixed(1)} µs (${mean(rs.map((x) => x.workerUsPerTurn)).toFixed(1)} + ${mean(rs.map((x) => x.callersUsPerTurn)).toFixed(1)}) | ` +
        `${lower(driverUs)} | ${median(rs.map((x) => x.aloneP50Ms)).toFixed(1)} / ${median(rs.map((x) => x.aloneP99Ms)).toFixed(1)} ms |`,
    );
  }
}

await main();
