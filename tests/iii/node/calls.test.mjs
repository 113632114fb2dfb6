// iii-sdk@0.22.1 callers and workers on turnd, unchanged: sync, failing, void and
// timed-out triggers, calls nobody serves, a handler longer than the turns' default
// deadline, and fifo queues.
import assert from 'node:assert/strict'
import { after, before, test } from 'node:test'
import { TriggerAction, registerWorker } from 'iii-sdk'
import { gate, sleep, startTurnd, until, V1 } from './lib.mjs'

// call_grace_ms: a call that waited for a reattaching worker would wait this long
// (capped at call_dispatch_timeout_ms, 30 s), so the calls answered at once below
// (within AT_ONCE_MS, far above a stall of a loaded machine) did not wait for it.
const TOML = `
[iii]
concurrency = 4
call_grace_ms = 60000
`
const AT_ONCE_MS = 10_000

// turns.default_timeout_ms stands for its 30 s default, scaled down: iii functions
// must not take it as their deadline.
const DEFAULT_TIMEOUT_MS = 300

// Reconnects come fast and at most 400 ms apart (iii-sdk's backoff would grow to 30 s).
const RECONNECT = { initialDelayMs: 100, maxDelayMs: 400, jitterFactor: 0 }

let turnd, worker, caller, v1
const started = []
const calls = { slow: 0 }
// The fifo test's gates: each group's first message waits for the other's to start (so
// the two overlap if, and only if, the daemon runs the groups in parallel), and a's
// also for the test to have read the queue's depth (so work is in flight then).
const fifo = { a: gate(), b: gate(), depthRead: gate() }

before(async () => {
  turnd = await startTurnd({ toml: TOML, config: { turns: { default_timeout_ms: DEFAULT_TIMEOUT_MS } } })
  // Telemetry stays on (the SDK's default): turnd accepts and drops the /otel socket.
  worker = registerWorker(turnd.iiiUrl, { workerName: 'node-worker', reconnectionConfig: RECONNECT })
  worker.registerFunction('demo::echo', async (input, metadata) => ({ echoed: input, metadata }))
  worker.registerFunction('demo::fail', async (_input, metadata) => {
    started.push(metadata.turnd.turn_id)
    throw new Error('boom')
  })
  worker.registerFunction('demo::slow', async (input, metadata) => {
    calls.slow += 1
    started.push(metadata?.turnd?.turn_id)
    await sleep(input.ms)
    return { slept: input.ms }
  })
  const seen = []
  worker.registerFunction('demo::fifo', async (input) => {
    seen.push({ at: 'start', g: input.g, n: input.n, t: Date.now() })
    if (input.n === 1) {
      fifo[input.g].open()
      await fifo[input.g === 'a' ? 'b' : 'a'].wait(10_000)
      if (input.g === 'a') await fifo.depthRead.wait(10_000)
    }
    await sleep(150)
    seen.push({ at: 'end', g: input.g, n: input.n, t: Date.now() })
    return { n: input.n }
  })
  worker.seen = seen
  caller = registerWorker(turnd.iiiUrl, { workerName: 'node-caller', reconnectionConfig: RECONNECT })
  v1 = await V1.connect(turnd.wsUrl)
  await until('the worker registered', async () => {
    const { functions } = await v1.call('functions.list')
    return functions.filter((f) => f.function_id.startsWith('demo::')).length === 4
  })
})

after(async () => {
  for (const g of Object.values(fifo)) g.open()
  v1?.close()
  await worker?.shutdown()
  await caller?.shutdown()
  await turnd?.stop()
})

test('a sync trigger answers with the result and turnd ids in the handler metadata', async () => {
  const r = await caller.trigger({ function_id: 'demo::echo', payload: { n: 1 } })
  assert.deepEqual(r.echoed, { n: 1 })
  const ids = r.metadata.turnd
  assert.match(ids.session_id, /^call\//)
  assert.equal(ids.attempt, 1)
  const t = await v1.turn(ids.turn_id)
  assert.equal(t.status, 'completed')
  assert.deepEqual(t.output, r)
})

test('a failing handler rejects the caller with invocation_failed and fails the turn', async () => {
  const n = started.length
  await assert.rejects(caller.trigger({ function_id: 'demo::fail', payload: {} }), (e) => {
    assert.equal(e.name, 'InvocationError')
    assert.equal(e.code, 'invocation_failed')
    assert.match(e.message, /boom/)
    return true
  })
  const t = await v1.turn(started[n])
  assert.equal(t.status, 'failed')
  assert.equal(t.error.code, 'invocation_failed')
  assert.equal(t.error.cause, 'handler_failed')
})

test('a void trigger runs the function and answers nothing', async () => {
  const before = calls.slow
  const r = await caller.trigger({ function_id: 'demo::slow', payload: { ms: 10 }, action: TriggerAction.Void() })
  assert.equal(r, undefined)
  await until('the void call ran', () => calls.slow === before + 1)
  const id = started[started.length - 1]
  assert.equal((await v1.wait(id)).status, 'completed')
})

test('a caller timeout leaves the turn to complete', async () => {
  const n = started.length
  await assert.rejects(caller.trigger({ function_id: 'demo::slow', payload: { ms: 600 }, timeoutMs: 150 }), (e) => {
    assert.equal(e.code, 'TIMEOUT')
    return true
  })
  const id = await until('the handler started', () => started[n])
  const t = await v1.wait(id)
  assert.equal(t.status, 'completed')
  assert.deepEqual(t.output, { slept: 600 })
})

test('a call nobody serves is answered function_not_found at once and never runs later', async () => {
  const t0 = Date.now()
  await assert.rejects(caller.trigger({ function_id: 'nobody::home', payload: { stale: true }, timeoutMs: 20_000 }), (e) => {
    assert.equal(e.code, 'function_not_found')
    assert.match(e.message, /Function nobody::home not found$/)
    return true
  })
  assert.ok(Date.now() - t0 < AT_ONCE_MS, `answered after ${Date.now() - t0} ms`)
  await caller.trigger({ function_id: 'nobody::home', payload: { stale: 'void' }, action: TriggerAction.Void() })
  const { sessions } = await v1.call('sessions.list', {})
  assert.deepEqual(sessions, [], 'no session waits')
  // A worker that registers it afterwards never runs the abandoned calls.
  const ran = []
  worker.registerFunction('nobody::home', async (input) => {
    ran.push(input)
    return { fresh: input }
  })
  await until('nobody::home registered', async () => (await v1.call('functions.list')).functions.some((f) => f.function_id === 'nobody::home' && f.workers > 0))
  await sleep(300)
  assert.deepEqual(ran, [])
  assert.deepEqual(await caller.trigger({ function_id: 'nobody::home', payload: 1 }), { fresh: 1 })
})

test("iii's own functions and HTTP-invoked ones are answered at once, naming what turnd does not serve", async () => {
  worker.registerFunction('web::hook', { url: 'http://127.0.0.1:9/hook' })
  // The worker's frames are read in order: once this answers, the registration was read.
  await worker.trigger({ function_id: 'engine::workers::register', payload: {} })
  for (const [fn, says] of [
    ['state::set', /state functions/],
    ['stream::set', /stream functions/],
    ['publish', /pub\/sub/],
    ['web::hook', /HTTP-invoked/],
  ]) {
    const t0 = Date.now()
    await assert.rejects(caller.trigger({ function_id: fn, payload: { key: 'k', value: 1 }, timeoutMs: 20_000 }), (e) => {
      assert.equal(e.code, 'function_not_found', fn)
      assert.match(e.message, says)
      return true
    })
    assert.ok(Date.now() - t0 < AT_ONCE_MS, `${fn} answered after ${Date.now() - t0} ms`)
  }
})

test('a handler longer than the default turn deadline runs to its end', async () => {
  const ms = DEFAULT_TIMEOUT_MS * 3
  const r = await caller.trigger({ function_id: 'demo::slow', payload: { ms }, timeoutMs: 10000 })
  assert.deepEqual(r, { slept: ms })
})

test('an unknown engine function answers function_not_found', async () => {
  await assert.rejects(caller.trigger({ function_id: 'engine::nope', payload: {} }), (e) => e.code === 'function_not_found')
})

test('a fifo queue runs serial within a group and parallel across groups', async () => {
  const define = (config) => caller.trigger({ function_id: 'queue::define', payload: { queue: 'orders', config } })
  await assert.rejects(caller.trigger({ function_id: 'demo::fifo', payload: { g: 'a', n: 0 }, action: TriggerAction.Enqueue({ queue: 'orders' }) }), (e) => {
    assert.equal(e.code, 'enqueue_error')
    return true
  })
  await assert.rejects(define({ type: 'fifo' }), /message_group_field/)
  await assert.rejects(define({ type: 'fifo', message_group_field: 'g', bogus: 1 }), /unknown field/)
  assert.deepEqual(await define({ type: 'fifo', message_group_field: 'g' }), { queue: 'orders', changed: true })
  assert.deepEqual(await define({ type: 'fifo', message_group_field: 'g' }), { queue: 'orders', changed: false })
  await assert.rejects(caller.trigger({ function_id: 'demo::fifo', payload: { n: 9 }, action: TriggerAction.Enqueue({ queue: 'orders' }) }), (e) => e.code === 'enqueue_error')

  const receipts = []
  for (let n = 1; n <= 3; n++) {
    for (const g of ['a', 'b']) {
      const r = await caller.trigger({ function_id: 'demo::fifo', payload: { g, n }, action: TriggerAction.Enqueue({ queue: 'orders' }) })
      receipts.push({ g, n, id: r.messageReceiptId })
    }
  }
  // Live depth counts the work in flight (group a's first message waits for this).
  const stats = await caller.trigger({ function_id: 'engine::queue::topic_stats', payload: { topic: 'orders' } })
  fifo.depthRead.open()
  assert.ok(stats.depth > 0, `depth ${stats.depth} with work in flight`)
  assert.equal(stats.config.message_group_field, 'g')
  for (const r of receipts) {
    const t = await v1.wait(r.id, 30_000)
    assert.equal(t.status, 'completed', JSON.stringify(t))
    assert.equal(t.session_id, `orders:${r.g}`)
    assert.deepEqual(t.output, { n: r.n })
  }
  const after = await caller.trigger({ function_id: 'engine::queue::topic_stats', payload: { queue: 'orders' } })
  assert.equal(after.depth, 0)
  const seen = worker.seen
  for (const g of ['a', 'b']) {
    const mine = seen.filter((e) => e.g === g)
    // start/end strictly alternate, in enqueue order: one at a time within a group.
    assert.deepEqual(
      mine.map((e) => `${e.at}${e.n}`),
      ['start1', 'end1', 'start2', 'end2', 'start3', 'end3'],
    )
  }
  // Across groups, handlers overlapped (each first one waited up to 10 s for the other's
  // start: run one group after the other, they would not have).
  const a1 = seen.find((e) => e.g === 'a' && e.n === 1 && e.at === 'start')
  const b1 = seen.find((e) => e.g === 'b' && e.n === 1 && e.at === 'start')
  const a1end = seen.find((e) => e.g === 'a' && e.n === 1 && e.at === 'end')
  assert.ok(b1.t < a1end.t && a1.t < seen.find((e) => e.g === 'b' && e.n === 1 && e.at === 'end').t, 'groups a and b ran in parallel')
})

test('topic_stats of a queue named call counts no calls', async () => {
  assert.equal((await caller.trigger({ function_id: 'queue::define', payload: { queue: 'call', config: { type: 'standard' } } })).changed, true)
  const n = started.length
  const running = caller.trigger({ function_id: 'demo::slow', payload: { ms: 600 } })
  await until('the call started', () => started.length > n)
  const stats = await caller.trigger({ function_id: 'engine::queue::topic_stats', payload: { queue: 'call' } })
  assert.equal(stats.depth, 0)
  assert.equal(stats.in_flight, 0)
  await running
})

test('queue::define refuses what turnd does not honour, naming it', async () => {
  for (const field of ['concurrency', 'poll_interval_ms', 'max_priority']) {
    await assert.rejects(caller.trigger({ function_id: 'queue::define', payload: { queue: 'refused', config: { type: 'standard', [field]: 1 } } }), (e) => {
      assert.equal(e.code, 'invalid_queue_config')
      assert.match(e.message, new RegExp(`\`${field}\``))
      return true
    })
  }
})

test('a queue definition survives a restart of turnd', async () => {
  await turnd.restart()
  await until(
    'the caller is back',
    async () => {
      try {
        return await caller.trigger({ function_id: 'queue::define', payload: { queue: 'orders', config: { type: 'fifo', message_group_field: 'g' } }, timeoutMs: 2000 })
      } catch {
        return false
      }
    },
    30_000,
  ).then((r) => assert.equal(r.changed, false))
  v1.close()
  v1 = await V1.connect(turnd.wsUrl)
})
