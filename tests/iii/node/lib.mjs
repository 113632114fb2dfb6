// Helpers for the iii-sdk tests: a turnd daemon with its iii endpoint on, and a small
// protocol-v1 client to look at (and stop) the turns the iii callers made.
import { spawn } from 'node:child_process'
import { mkdtemp, readFile, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join, resolve } from 'node:path'
import WebSocket from 'ws'

const BIN = process.env.TURND_BIN || resolve(import.meta.dirname, '../../../target/debug/turnd')

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

/**
 * A gate a handler waits at until the test opens it: what the handler does then
 * happens after what the test checked meanwhile, however slow the machine. `wait`
 * gives up after `ms` (then the check that needed the gate fails instead of hanging).
 */
export function gate() {
  let open
  const opened = new Promise((r) => {
    open = r
  })
  return {
    open: () => open(),
    wait(ms = 20_000) {
      let timer
      const late = new Promise((r) => {
        timer = setTimeout(r, ms)
      })
      return Promise.race([opened, late]).finally(() => clearTimeout(timer))
    },
  }
}

/** Poll `f` until it returns something truthy, or throw after `ms` (generous: only a failing test waits it out). */
export async function until(what, f, ms = 20_000) {
  const deadline = Date.now() + ms
  for (;;) {
    const v = await f()
    if (v) return v
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`)
    await sleep(20)
  }
}

/**
 * Short turn timers so each loss case plays out in a second or two. The heartbeat is
 * the daemon's default: a connection silent for three of them is ended, so a short
 * one would end healthy connections whenever the test process (whose iii-sdk workers
 * answer the pings) stalls for a second or two on a loaded machine. No iii test waits
 * for silence to be noticed: a killed worker's socket is closed by its kernel.
 */
export const FAST = {
  server: { heartbeat_ms: 5000 },
  storage: { sync: 'never' },
  turns: { probe_timeout_ms: 300, reconnect_grace_ms: 3000, cancel_grace_ms: 600, retry_backoff_ms: 50, retry_backoff_max_ms: 200 },
}

function configEnv(config) {
  const env = {}
  for (const [section, keys] of Object.entries(config)) {
    for (const [key, v] of Object.entries(keys)) env[`TURND_${section.toUpperCase()}__${key.toUpperCase()}`] = String(v)
  }
  return env
}

function merge(a, b) {
  const out = { ...a }
  for (const [k, v] of Object.entries(b ?? {})) out[k] = { ...(a[k] ?? {}), ...v }
  return out
}

/**
 * turnd with the iii endpoint on a free port. `config` is merged over FAST and passed
 * as TURND_* variables; `toml` (optional) is written as the config file (for
 * `[[iii.functions]]`, which no variable can express).
 */
export async function startTurnd({ config = {}, toml } = {}) {
  const work = await mkdtemp(join(tmpdir(), 'turnd-iii-'))
  const d = new Turnd(work, configEnv(merge(FAST, config)), toml)
  await d.launch()
  return d
}

export class Turnd {
  constructor(work, env, toml) {
    this.work = work
    this.env = env
    this.toml = toml
    this.listen = '127.0.0.1:0'
    this.adminListen = '127.0.0.1:0'
    this.iiiListen = '127.0.0.1:0'
    this.generation = 0
    this.stderr = ''
  }

  async launch() {
    this.generation += 1
    const readyFile = join(this.work, `ready-${this.generation}.json`)
    const args = ['serve', '--listen', this.listen, '--admin-listen', this.adminListen, '--data-dir', join(this.work, 'data'), '--ready-file', readyFile]
    if (this.toml !== undefined) {
      const path = join(this.work, 'turnd.toml')
      const { writeFile } = await import('node:fs/promises')
      await writeFile(path, this.toml)
      args.push('--config', path)
    }
    const child = spawn(BIN, args, {
      env: { ...process.env, RUST_LOG: 'info', ...this.env, TURND_III__LISTEN: this.iiiListen },
      stdio: ['ignore', 'ignore', 'pipe'],
    })
    this.child = child
    child.stderr.setEncoding('utf8')
    child.stderr.on('data', (c) => {
      this.stderr += c
    })
    const deadline = Date.now() + 15000
    for (;;) {
      await sleep(20)
      if (child.exitCode !== null || child.signalCode !== null) throw new Error(`turnd exited before it was ready:\n${this.stderr}`)
      let text
      try {
        text = await readFile(readyFile, 'utf8')
      } catch {
        text = undefined
      }
      if (text) {
        const ready = JSON.parse(text)
        this.wsUrl = ready.ws
        this.iiiUrl = ready.iii
        this.listen = new URL(ready.ws).host
        this.adminListen = new URL(ready.admin).host
        this.iiiListen = new URL(ready.iii).host
        return
      }
      if (Date.now() > deadline) {
        child.kill('SIGKILL')
        throw new Error(`turnd not ready:\n${this.stderr}`)
      }
    }
  }

  async kill(signal = 'SIGKILL') {
    const child = this.child
    if (!child || child.exitCode !== null || child.signalCode !== null) return
    const done = new Promise((r) => child.once('exit', r))
    child.kill(signal)
    await done
  }

  /** Kill and start again on the same ports and data directory. */
  async restart() {
    await this.kill('SIGKILL')
    for (let i = 0; ; i++) {
      try {
        return await this.launch()
      } catch (e) {
        if (i >= 10) throw e
        await sleep(100)
      }
    }
  }

  async stop() {
    await this.kill('SIGTERM')
    await rm(this.work, { recursive: true, force: true })
  }
}

/** A protocol-v1 client (operator role when tokens are off). */
export class V1 {
  static async connect(url, role = 'operator', token) {
    const c = new V1()
    c.ws = new WebSocket(url)
    c.next = 1
    c.waiting = new Map()
    c.ws.on('message', (d) => {
      const f = JSON.parse(d.toString())
      const w = c.waiting.get(f.id)
      if (!w) return
      c.waiting.delete(f.id)
      if (f.error) w.reject(Object.assign(new Error(`${f.error.code}: ${f.error.message}`), { code: f.error.code }))
      else w.resolve(f.ok)
    })
    await new Promise((resolve, reject) => {
      c.ws.once('open', resolve)
      c.ws.once('error', reject)
    })
    await c.call('hello', { protocol: 1, role, ...(token ? { token } : {}) })
    return c
  }

  call(op, args = {}) {
    const id = this.next++
    return new Promise((resolve, reject) => {
      this.waiting.set(id, { resolve, reject })
      this.ws.send(JSON.stringify({ id, op, args }))
    })
  }

  async turn(turnId) {
    return (await this.call('turn.get', { turn_id: turnId })).turn
  }

  async wait(turnId, timeoutMs = 10000) {
    return (await this.call('turn.wait', { turn_id: turnId, timeout_ms: timeoutMs })).turn
  }

  async events(sessionId) {
    const out = []
    let after = 0
    for (;;) {
      const page = await this.call('session.events', { session_id: sessionId, after, limit: 1000 })
      out.push(...page.events)
      if (page.events.length === 0) return out
      after = page.next
    }
  }

  close() {
    this.ws.terminate()
  }
}

/** Options for an iii-sdk worker that reconnects fast and sends no telemetry. */
export const iiiOptions = (extra = {}) => ({
  reconnectionConfig: { initialDelayMs: 100, maxDelayMs: 400, jitterFactor: 0 },
  otel: { enabled: false },
  ...extra,
})
