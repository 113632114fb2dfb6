// Throughput of one Node iii-sdk worker through turnd: `--calls` sync triggers
// (`bench::echo`, each a one-step turn in a session of its own), `--concurrency` of
// them in flight at once from one caller connection, after `--warmup` calls.
//
//   node bench/throughput.mjs [--calls 2000] [--concurrency 64] [--warmup 200]
//   (TURND_BIN names the daemon, default target/debug/turnd)
import { spawn } from 'node:child_process'
import { readFileSync } from 'node:fs'
import { createInterface } from 'node:readline'
import { registerWorker } from 'iii-sdk'
import { startTurnd, until, V1 } from '../lib.mjs'

const arg = (name, dflt) => {
  const i = process.argv.indexOf(`--${name}`)
  return i > 0 ? Number(process.argv[i + 1]) : dflt
}
const CALLS = arg('calls', 2000)
const CONC = arg('concurrency', 64)
const WARMUP = arg('warmup', 200)

// Durable commits (storage.sync = always), normal timers; 128 invocations at once.
const turnd = await startTurnd({ config: { storage: { sync: 'always' }, server: { heartbeat_ms: 5000 } }, toml: '[iii]\nconcurrency = 128\n' })
const daemonCpu = () => {
  const f = readFileSync(`/proc/${turnd.child.pid}/stat`, 'utf8').split(') ')[1].split(' ')
  return (Number(f[11]) + Number(f[12])) / 100
}
const child = spawn(process.execPath, [new URL('./worker.mjs', import.meta.url).pathname, turnd.iiiUrl], { stdio: ['pipe', 'pipe', 'ignore'] })
const lines = createInterface({ input: child.stdout })
const replies = []
lines.on('line', (l) => l.startsWith('{') && replies.push(JSON.parse(l)))
const v1 = await V1.connect(turnd.wsUrl)
await until('the worker registered', async () => (await v1.call('functions.list')).functions.some((f) => f.function_id === 'bench::echo' && f.workers > 0), 15000)
const caller = registerWorker(turnd.iiiUrl, { workerName: 'bench-caller', otel: { enabled: false } })

async function run(n) {
  const lat = []
  let next = 0
  const one = async () => {
    while (next < n) {
      const i = next++
      const t = performance.now()
      const r = await caller.trigger({ function_id: 'bench::echo', payload: { i } })
      if (r.i !== i) throw new Error(`wrong answer ${JSON.stringify(r)} for ${i}`)
      lat.push(performance.now() - t)
    }
  }
  await Promise.all(Array.from({ length: CONC }, one))
  return lat
}

await run(WARMUP)
child.stdin.write('mark\n')
await until('the worker marked', () => replies.length === 1)
const cpu0 = daemonCpu()
const t0 = performance.now()
const lat = await run(CALLS)
const wall = (performance.now() - t0) / 1000
const daemon = daemonCpu() - cpu0
child.stdin.write('stop\n')
await until('the worker reported', () => replies.length === 2)
const w = replies[1]
lat.sort((a, b) => a - b)
const pct = (p) => lat[Math.min(lat.length - 1, Math.floor(p * lat.length))].toFixed(1)
const us = (s) => Math.round((s * 1e6) / CALLS)
console.log(
  JSON.stringify({
    calls: CALLS,
    concurrency: CONC,
    wall_s: Number(wall.toFixed(2)),
    calls_per_s: Math.round(CALLS / wall),
    latency_ms: { p50: Number(pct(0.5)), p99: Number(pct(0.99)) },
    worker: { cpu_s: Number(w.cpu_s.toFixed(2)), us_per_call: us(w.cpu_s), rss_mb: Math.round(w.rss_mb) },
    daemon: { cpu_s: Number(daemon.toFixed(2)), us_per_call: us(daemon) },
  }),
)
await caller.shutdown()
v1.close()
await turnd.stop()
process.exit(0)
