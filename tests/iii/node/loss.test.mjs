// The losses turnd exists to reconcile, with unchanged iii-sdk@0.22.1 workers: a
// dropped `invocationresult` (the seed's case), a worker connection closed
// mid-handler, a turnd restart mid-handler, a killed worker, and stops in a fifo
// group whose handler runs on.
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import { createInterface } from 'node:readline'
import { after, before, test } from 'node:test'
import { TriggerAction, registerWorker } from 'iii-sdk'
import { gate, iiiOptions, sleep, startTurnd, until, V1 } from './lib.mjs'

// The steps' deadline: a dropped result is found when it passes, and the steps that
// are not dropped (50 ms handlers in this process) must end within it even when the
// process stalls for a few seconds.
const DEADLINE_MS = 4000
// A worker whose connection ends reattaches within it even after a stall of a few
// seconds; the killed worker's invocation waits it out.
const RECONNECT_GRACE_MS = 5000
const CANCEL_GRACE_MS = 600
// What the time bounds below rule out takes this long: iii workers are never probed
// (a probe would wait for its answer this long), and the slow functions' deadline.
const PROBE_TIMEOUT_MS = 30_000
const SLOW_TIMEOUT_MS = 30_000

// Turn timers go as TURND_* variables: they override the file (and lib's FAST).
const TURNS = { reconnect_grace_ms: RECONNECT_GRACE_MS, cancel_grace_ms: CANCEL_GRACE_MS, probe_timeout_ms: PROBE_TIMEOUT_MS }

const TOML = `
[iii]
concurrency = 4

[[iii.functions]]
id = "alo::slow"
timeout_ms = ${SLOW_TIMEOUT_MS}
delivery = "at_least_once"
max_attempts = 3

[[iii.functions]]
id = "alo::*"
timeout_ms = ${DEADLINE_MS}
delivery = "at_least_once"
max_attempts = 3

[[iii.functions]]
id = "amo::slow"
timeout_ms = ${SLOW_TIMEOUT_MS}

[[iii.functions]]
id = "amo::*"
timeout_ms = ${DEADLINE_MS}
delivery = "at_most_once"
`

let turnd, worker, caller, v1
/** Results held back by the wrapped send, by invocation id. */
const held = new Map()
/** Invocation ids whose result the wrapped send drops (and holds). */
const drop = new Set()
const log = []
const inflight = new Map()
let maxInflight = 0
let send
/** Gates a handler given `input.gate` waits at (instead of sleeping `input.ms`). */
const gates = new Map()

function record(fn) {
  return async (input, metadata) => {
    const g = `${fn}/${input.g}`
    const now = (inflight.get(g) ?? 0) + 1
    inflight.set(g, now)
    maxInflight = Math.max(maxInflight, now)
    log.push({ fn, at: 'start', n: input.n, g: input.g, t: Date.now(), ...metadata.turnd })
    if (input.drop && metadata.turnd.attempt === 1) drop.add(metadata.turnd.invocation_id)
    try {
      if (input.gate) await gates.get(input.gate).wait()
      else await sleep(input.ms ?? 50)
      return { n: input.n, attempt: metadata.turnd.attempt }
    } finally {
      inflight.set(g, inflight.get(g) - 1)
      log.push({ fn, at: 'end', n: input.n, g: input.g, t: Date.now(), ...metadata.turnd })
    }
  }
}

const starts = (fn, g, n) => log.filter((e) => e.fn === fn && e.g === g && e.n === n && e.at === 'start')
const kinds = (events) => events.map((e) => e.kind)

async function enqueue(fn, payload, queue = 'seed') {
  const r = await caller.trigger({ function_id: fn, payload, action: TriggerAction.Enqueue({ queue }) })
  return r.messageReceiptId
}

/** The queue whose deliveries get this deadline (iii's `timeout_ms`). */
const HELD_TIMEOUT_MS = 5000

before(async () => {
  turnd = await startTurnd({ toml: TOML, config: { turns: TURNS } })
  worker = registerWorker(turnd.iiiUrl, iiiOptions({ workerName: 'loss-worker' }))
  // The test's hook: the SDK's own send, wrapped to lose chosen result frames.
  send = worker.sendMessageRaw.bind(worker)
  worker.sendMessageRaw = (data) => {
    const m = JSON.parse(data)
    if (m.type === 'invocationresult' && drop.has(m.invocation_id)) {
      drop.delete(m.invocation_id)
      held.set(m.invocation_id, data)
      return
    }
    send(data)
  }
  for (const fn of ['alo::step', 'amo::step', 'amo::slow']) worker.registerFunction(fn, record(fn))
  caller = registerWorker(turnd.iiiUrl, iiiOptions({ workerName: 'loss-caller' }))
  v1 = await V1.connect(turnd.wsUrl)
  await until('the worker registered', async () => (await v1.call('functions.list')).functions.length >= 3)
  await caller.trigger({ function_id: 'queue::define', payload: { queue: 'seed', config: { type: 'fifo', message_group_field: 'g' } } })
  await caller.trigger({ function_id: 'queue::define', payload: { queue: 'held', config: { type: 'fifo', message_group_field: 'g', timeout_ms: HELD_TIMEOUT_MS } } })
})

after(async () => {
  for (const g of gates.values()) g.open()
  v1?.close()
  await worker?.shutdown()
  await caller?.shutdown()
  await turnd?.stop()
})

test('a dropped invocationresult under at_least_once: redispatched after the deadline, the group moves on, the late result changes nothing', async () => {
  maxInflight = 0
  const first = await enqueue('alo::step', { g: 'a', n: 1, drop: true })
  const second = await enqueue('alo::step', { g: 'a', n: 2 })
  const t1 = await v1.wait(first)
  assert.equal(t1.status, 'completed')
  assert.equal(t1.attempt, 2)
  assert.deepEqual(t1.output, { n: 1, attempt: 2 })
  const t2 = await v1.wait(second)
  assert.equal(t2.status, 'completed')
  assert.equal(maxInflight, 1, 'never two in flight in one group')
  const ev = await v1.events(t1.session_id)
  const mine = ev.filter((e) => e.turn_id === first)
  assert.ok(kinds(mine).includes('outcome_unknown'), kinds(mine).join(','))
  assert.ok(kinds(mine).includes('redispatched'))
  assert.ok(!kinds(mine).includes('probe_sent'), 'an iii worker is never probed')
  // The group moved on at the deadline, by the daemon's clock: the first message went
  // out again once its deadline passed, and the second was dispatched soon after, far
  // sooner than a probe's answer could have been waited for (PROBE_TIMEOUT_MS).
  const deadline = mine.find((e) => e.kind === 'dispatched').detail.deadline_ms
  const again = mine.find((e) => e.kind === 'redispatched').at_ms
  assert.ok(again >= deadline, `dispatched again ${deadline - again} ms before the deadline`)
  const secondAt = ev.find((e) => e.turn_id === second && e.kind === 'dispatched').at_ms
  assert.ok(secondAt - deadline < 10_000, `second message dispatched ${secondAt - deadline} ms after the first's deadline`)
  // The dropped frame arrives after all: a late result, recorded, changing nothing.
  const frame = held.get(starts('alo::step', 'a', 1)[0].invocation_id)
  held.clear()
  send(frame)
  await until('the late result is recorded', async () => kinds(await v1.events(t1.session_id)).includes('late_result'))
  const final = await v1.turn(first)
  assert.equal(final.status, 'completed')
  assert.deepEqual(final.output, { n: 1, attempt: 2 })
})

test('a dropped invocationresult under at_most_once: outcome_unknown, the group moves on, the late result amends', async () => {
  maxInflight = 0
  const first = await enqueue('amo::step', { g: 'b', n: 1, drop: true })
  const second = await enqueue('amo::step', { g: 'b', n: 2 })
  const t1 = await v1.wait(first)
  assert.equal(t1.status, 'failed')
  assert.equal(t1.error.cause, 'outcome_unknown')
  assert.equal(starts('amo::step', 'b', 1).length, 1, 'never dispatched again')
  const t2 = await v1.wait(second)
  assert.equal(t2.status, 'completed')
  assert.equal(maxInflight, 1)
  const frame = held.get(starts('amo::step', 'b', 1)[0].invocation_id)
  held.clear()
  send(frame)
  const amended = await until('the late result amends the turn', async () => {
    const t = await v1.turn(first)
    return t.status === 'completed' && t
  })
  assert.equal(amended.recovered, true)
  assert.deepEqual(amended.output, { n: 1, attempt: 1 })
})

test('a worker connection closed mid-handler reattaches and its result is applied', async () => {
  // The handler ends only after its connection did.
  const running = gate()
  gates.set('x', running)
  const n = log.length
  const call = caller.trigger({ function_id: 'amo::slow', payload: { g: 'x', n: 1, gate: 'x' } })
  await until('the handler started', () => log.length > n)
  worker.ws.terminate()
  running.open()
  const r = await call
  assert.deepEqual(r, { n: 1, attempt: 1 })
  assert.equal(starts('amo::slow', 'x', 1).length, 1, 'the handler ran once')
  const ev = await v1.events(log[n].session_id)
  assert.ok(!kinds(ev).includes('outcome_unknown'), kinds(ev).join(','))
  assert.ok(!kinds(ev).includes('redispatched'))
})

test('turn.stop on a running iii invocation ends it cancelled after the cancel grace; the group waits for its result', async () => {
  // The stopped handler runs on until the test opens its gate, after the checks of
  // what happens while it runs.
  const running = gate()
  gates.set('c', running)
  const id = await enqueue('amo::slow', { g: 'c', n: 1, gate: 'c' })
  const next = await enqueue('amo::slow', { g: 'c', n: 2, ms: 10 })
  await until('the handler started', () => starts('amo::slow', 'c', 1).length === 1)
  const t0 = Date.now()
  await v1.call('turn.stop', { turn_id: id, reason: 'test stop' })
  const t = await v1.wait(id)
  assert.equal(t.status, 'cancelled')
  assert.equal(t.stop.reason, 'test stop')
  assert.equal(log.filter((e) => e.fn === 'amo::slow' && e.g === 'c' && e.at === 'end').length, 0, 'cancelled while the handler ran')
  // Cancelled once the cancel grace passed (by the daemon's clock), and without waiting
  // for anything longer: the handler's end (not before its gate opens) or the
  // attempt's deadline (SLOW_TIMEOUT_MS).
  const mine = (await v1.events(t.session_id)).filter((e) => e.turn_id === id)
  const graceFor = mine.find((e) => e.kind === 'cancelled').at_ms - mine.find((e) => e.kind === 'stop_requested').at_ms
  assert.ok(graceFor >= CANCEL_GRACE_MS, `cancelled ${graceFor} ms after the stop`)
  assert.ok(Date.now() - t0 < CANCEL_GRACE_MS + 5000, `cancelled ${Date.now() - t0} ms after the stop`)
  // The next message waits, visibly, for the stopped handler's result.
  const waiting = await v1.turn(next)
  assert.equal(waiting.wait.state, 'held', JSON.stringify(waiting.wait))
  assert.equal(waiting.wait.invocation_id, starts('amo::slow', 'c', 1)[0].invocation_id)
  assert.equal(waiting.wait.on_deadline, 'dispatch')
  const { sessions } = await v1.call('sessions.list', { state: 'held' })
  assert.deepEqual(sessions.map((s) => s.session_id), ['seed:c'])
  running.open()
  assert.equal((await v1.wait(next)).status, 'completed')
  const firstEnd = log.find((e) => e.fn === 'amo::slow' && e.g === 'c' && e.n === 1 && e.at === 'end').t
  const secondStart = starts('amo::slow', 'c', 2)[0].t
  assert.ok(secondStart >= firstEnd, `the next message started ${firstEnd - secondStart} ms before the stopped one ended`)
  await until('the late result is recorded', async () => kinds(await v1.events(t.session_id)).includes('late_result'))
  assert.equal((await v1.turn(id)).status, 'cancelled')
})

test("a stopped handler whose result is lost holds its group until the queue's timeout_ms", async () => {
  const id = await enqueue('amo::slow', { g: 'h', n: 1, ms: 300, drop: true }, 'held')
  const next = await enqueue('amo::slow', { g: 'h', n: 2, ms: 10 }, 'held')
  await until('the handler started', () => starts('amo::slow', 'h', 1).length === 1)
  const first = starts('amo::slow', 'h', 1)[0]
  // The queue's timeout_ms, not the function's (SLOW_TIMEOUT_MS), is the delivery's
  // deadline: the dispatch time, by the daemon's clock, plus HELD_TIMEOUT_MS.
  const dispatched = (await v1.events(first.session_id)).find((e) => e.turn_id === id && e.kind === 'dispatched')
  assert.equal(first.deadline_ms, dispatched.detail.deadline_ms)
  assert.equal(first.deadline_ms - dispatched.at_ms, HELD_TIMEOUT_MS)
  await v1.call('turn.stop', { turn_id: id, reason: 'lost' })
  assert.equal((await v1.wait(id)).status, 'cancelled')
  assert.equal((await v1.wait(next)).status, 'completed')
  const secondStart = starts('amo::slow', 'h', 2)[0].t
  assert.ok(secondStart >= first.deadline_ms - 50, `the next message started ${first.deadline_ms - secondStart} ms before the deadline`)
  held.clear()
})

test('a killed worker: its invocation goes to a second worker after the reconnect grace', async () => {
  const child = spawn(process.execPath, [new URL('./child-worker.mjs', import.meta.url).pathname, turnd.iiiUrl], { stdio: ['ignore', 'pipe', 'ignore'] })
  const lines = createInterface({ input: child.stdout })
  // The SDK writes its own debug lines to stdout too.
  const started = new Promise((resolve) => lines.on('line', (l) => l.startsWith('{') && resolve(JSON.parse(l).started)))
  try {
    await until('the child registered', async () => (await v1.call('functions.list')).functions.some((f) => f.function_id === 'alo::slow' && f.workers > 0), 30_000)
    // The child's handler would run a minute: only the second worker can end it.
    const id = await enqueue('alo::slow', { g: 'k', n: 1, ms: 60_000 })
    const first = await started
    assert.equal(first.turn_id, id)
    const second = registerWorker(turnd.iiiUrl, iiiOptions({ workerName: 'second' }))
    second.registerFunction('alo::slow', async (_input, metadata) => ({ by: 'second', attempt: metadata.turnd.attempt }))
    try {
      // Taken before the kill: the grace starts when the daemon sees the socket close.
      const t0 = Date.now()
      child.kill('SIGKILL')
      const t = await v1.wait(id, 30_000)
      assert.equal(t.status, 'completed')
      assert.deepEqual(t.output, { by: 'second', attempt: 2 })
      assert.ok(Date.now() - t0 >= RECONNECT_GRACE_MS, `completed ${Date.now() - t0} ms after the kill, before the grace`)
    } finally {
      await second.shutdown()
    }
  } finally {
    child.kill('SIGKILL')
  }
})

test('a turnd restart mid-handler: the worker reattaches with its token and the result is applied', async () => {
  // The handler ends only after the restart.
  const running = gate()
  gates.set('r', running)
  const id = await enqueue('amo::slow', { g: 'r', n: 1, gate: 'r' })
  await until('the handler started', () => starts('amo::slow', 'r', 1).length === 1)
  v1.close()
  await turnd.restart()
  running.open()
  v1 = await V1.connect(turnd.wsUrl)
  const t = await v1.wait(id, 30_000)
  assert.equal(t.status, 'completed', JSON.stringify(t))
  assert.equal(t.recovered, false)
  assert.deepEqual(t.output, { n: 1, attempt: 1 })
  assert.equal(starts('amo::slow', 'r', 1).length, 1)
  const ev = await v1.events(t.session_id)
  assert.ok(!kinds(ev).includes('outcome_unknown'), kinds(ev).join(','))
})
