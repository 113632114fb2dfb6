// A worker in its own process (so a test can SIGKILL it): serves `alo::slow`, and
// prints one JSON line when a handler starts.
import { registerWorker } from 'iii-sdk'

const worker = registerWorker(process.argv[2], {
  workerName: 'child',
  reconnectionConfig: { initialDelayMs: 100, jitterFactor: 0 },
  otel: { enabled: false },
})
worker.registerFunction('alo::slow', async (input, metadata) => {
  process.stdout.write(`${JSON.stringify({ started: metadata.turnd })}\n`)
  await new Promise((r) => setTimeout(r, input.ms))
  return { by: 'child' }
})
