/**
 * `turnd/testing`: run a real `turnd serve` for a test.
 *
 *     const turnd = await startTurnd({ config: { turns: { probe_timeout_ms: 300 } } });
 *     // turnd.url = "ws://127.0.0.1:<port>/v1"
 *     await turnd.stop();
 *
 * The binary is `options.binary`, else `$TURND_BIN`, else `turnd` on the PATH. It
 * listens on free loopback ports, keeps its store in a fresh temporary directory
 * and reports readiness through `--ready-file`.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";

/** Config keys by section, e.g. `{ turns: { probe_timeout_ms: 300 } }`. */
export type TurndConfig = Record<string, Record<string, string | number | boolean>>;

export interface StartOptions {
  /** Path of the `turnd` binary; default `$TURND_BIN` or `turnd` on the PATH. */
  binary?: string;
  /** Config keys, passed as `TURND_<SECTION>__<KEY>` environment variables. */
  config?: TurndConfig;
  /** More environment variables for the daemon. */
  env?: Record<string, string>;
  /** Give up when the daemon is not ready within this long (default 15000). */
  readyTimeoutMs?: number;
  /** Print the daemon's stderr (default: only when it fails to start). */
  inheritStderr?: boolean;
}

export interface Turnd {
  /** WebSocket URL, `ws://127.0.0.1:<port>/v1`. */
  readonly url: string;
  /** Admin HTTP URL (`/healthz`, `/readyz`, `/metrics`). */
  readonly adminUrl: string;
  /** The daemon's process id. */
  readonly pid: number;
  /** The temporary data directory (removed by `stop()`). */
  readonly dataDir: string;
  /**
   * Kill the daemon (`SIGKILL` by default, `SIGTERM` for a graceful stop) and start it
   * again on the same ports and data directory; resolves once it is ready.
   */
  restart(signal?: "SIGKILL" | "SIGTERM"): Promise<void>;
  /** Stop the daemon (SIGTERM, then SIGKILL after 5 s) and remove its data directory. */
  stop(): Promise<void>;
  /** The daemon's stderr so far (logs). */
  logs(): string;
}

function configEnv(config: TurndConfig | undefined): Record<string, string> {
  const env: Record<string, string> = {};
  for (const [section, keys] of Object.entries(config ?? {})) {
    for (const [key, value] of Object.entries(keys)) {
      env[`TURND_${section.toUpperCase()}__${key.toUpperCase()}`] =
        typeof value === "string" ? JSON.stringify(value) : String(value);
    }
  }
  return env;
}

/** Every daemon still running, killed if the test process exits without stopping it. */
const live = new Set<ChildProcess>();
let exitHook = false;

function track(child: ChildProcess): void {
  live.add(child);
  child.once("exit", () => live.delete(child));
  if (!exitHook) {
    exitHook = true;
    const killAll = () => {
      for (const c of live) c.kill("SIGKILL");
    };
    process.once("exit", killAll);
    // A test runner ends a test file that ran too long with a signal, which skips
    // "exit": kill the daemons, then let the signal do what it would have done.
    for (const signal of ["SIGTERM", "SIGINT", "SIGHUP"] as const) {
      process.once(signal, () => {
        killAll();
        if (process.listenerCount(signal) === 0) process.kill(process.pid, signal);
      });
    }
  }
}

function exited(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve();
  return new Promise((resolve) => child.once("exit", () => resolve()));
}

class RunningTurnd implements Turnd {
  url = "";
  adminUrl = "";
  pid = 0;
  private child: ChildProcess | undefined;
  private stderr = "";
  private listen = "127.0.0.1:0";
  private adminListen = "127.0.0.1:0";
  private generation = 0;

  constructor(
    readonly dataDir: string,
    private readonly work: string,
    private readonly binary: string,
    private readonly env: Record<string, string>,
    private readonly readyTimeoutMs: number,
    private readonly inheritStderr: boolean,
  ) {}

  async launch(): Promise<void> {
    this.generation += 1;
    const readyFile = join(this.work, `ready-${this.generation}.json`);
    const child = spawn(
      this.binary,
      [
        "serve",
        "--listen",
        this.listen,
        "--admin-listen",
        this.adminListen,
        "--data-dir",
        this.dataDir,
        "--ready-file",
        readyFile,
      ],
      { env: { ...process.env, ...this.env }, stdio: ["ignore", "ignore", "pipe"] },
    );
    this.child = child;
    track(child);
    child.stderr?.setEncoding("utf8");
    child.stderr?.on("data", (chunk: string) => {
      this.stderr += chunk;
      if (this.inheritStderr) process.stderr.write(chunk);
    });
    const spawnError = new Promise<Error>((resolve) => child.once("error", resolve));
    const deadline = Date.now() + this.readyTimeoutMs;
    for (;;) {
      const failed = await Promise.race([spawnError, new Promise<undefined>((r) => setTimeout(() => r(undefined), 20))]);
      if (failed) throw new Error(`cannot start ${this.binary}: ${failed.message}`);
      if (child.exitCode !== null || child.signalCode !== null) {
        throw new Error(`turnd exited before it was ready (${child.exitCode ?? child.signalCode}):\n${this.stderr}`);
      }
      let text: string | undefined;
      try {
        text = await readFile(readyFile, "utf8");
      } catch {
        text = undefined;
      }
      if (text !== undefined) {
        const ready = JSON.parse(text) as { ws: string; admin: string; pid: number };
        this.url = ready.ws;
        this.adminUrl = ready.admin;
        this.pid = ready.pid;
        // Restarts keep the ports, so connected clients find the daemon again.
        this.listen = new URL(ready.ws).host;
        this.adminListen = new URL(ready.admin).host;
        return;
      }
      if (Date.now() > deadline) {
        child.kill("SIGKILL");
        throw new Error(`turnd was not ready within ${this.readyTimeoutMs} ms:\n${this.stderr}`);
      }
    }
  }

  async restart(signal: "SIGKILL" | "SIGTERM" = "SIGKILL"): Promise<void> {
    await this.kill(signal);
    // The port was just released; retry briefly if the bind races its release.
    for (let i = 0; ; i++) {
      try {
        await this.launch();
        return;
      } catch (err) {
        if (i >= 10) throw err;
        await new Promise((r) => setTimeout(r, 100));
      }
    }
  }

  private async kill(signal: NodeJS.Signals): Promise<void> {
    const child = this.child;
    if (!child) return;
    const done = exited(child);
    child.kill(signal);
    const timer = setTimeout(() => child.kill("SIGKILL"), 5000);
    await done;
    clearTimeout(timer);
  }

  async stop(): Promise<void> {
    await this.kill("SIGTERM");
    this.child = undefined;
    await rm(this.work, { recursive: true, force: true });
  }

  logs(): string {
    return this.stderr;
  }
}

/** Start a real daemon on free loopback ports with a temporary data directory. */
export async function startTurnd(options: StartOptions = {}): Promise<Turnd> {
  const binary = options.binary ?? process.env.TURND_BIN ?? "turnd";
  const work = await mkdtemp(join(tmpdir(), "turnd-test-"));
  const env = { TURND_LOG: "warn", ...configEnv(options.config), ...options.env };
  const turnd = new RunningTurnd(
    join(work, "data"),
    work,
    binary,
    env,
    options.readyTimeoutMs ?? 15_000,
    options.inheritStderr ?? false,
  );
  try {
    await turnd.launch();
  } catch (err) {
    await rm(work, { recursive: true, force: true });
    throw err;
  }
  return turnd;
}
