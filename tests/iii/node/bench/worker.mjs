// The benchmark's worker: one iii-sdk@0.22.1 worker in a process of its own, serving
// `bench::echo` (returns its input). Prints its CPU time and RSS when told to stop.
import { registerWorker } from 'iii-sdk'

const worker = registerWorker(process.argv[2], { workerName: 'bench-worker', otel: { enabled: false } })
worker.registerFunction('bench::echo', async (input) => input)
let cpu = process.cpuUsage()
process.stdin.setEncoding('utf8')
process.stdin.on('data', async (line) => {
  if (line.startsWith('mark')) {
    cpu = process.cpuUsage()
    process.stdout.write('{"marked":true}\n')
  } else if (line.startsWith('stop')) {
    const used = process.cpuUsage(cpu)
    process.stdout.write(`${JSON.stringify({ cpu_s: (used.user + used.system) / 1e6, rss_mb: process.memoryUsage().rss / 2 ** 20 })}\n`)
    await worker.shutdown()
    process.exit(0)
  }
})
