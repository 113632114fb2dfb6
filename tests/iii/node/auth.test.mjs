// Tokens on the iii endpoint: `Authorization: Bearer` (the SDK's `headers`) and
// `?token=` are accepted when the token serves both worker and client; any other
// token is refused before the WebSocket opens (the SDK then retries forever).
import assert from 'node:assert/strict'
import { after, before, test } from 'node:test'
import { registerWorker } from 'iii-sdk'
import { iiiOptions, sleep, startTurnd, until, V1 } from './lib.mjs'

const TOKEN = 'iii-token-both-roles'
const TOML = `
[auth]
tokens = [
  { role = "worker", token = "${TOKEN}" },
  { role = "client", token = "${TOKEN}" },
  { role = "worker", token = "worker-only-token" },
  { role = "operator", token = "operator-token-1" },
]
`

let turnd, v1
const sdks = []
const open = (url, opts) => {
  const w = registerWorker(url, iiiOptions(opts))
  sdks.push(w)
  return w
}

before(async () => {
  turnd = await startTurnd({ toml: TOML })
  v1 = await V1.connect(turnd.wsUrl, 'operator', 'operator-token-1')
})

after(async () => {
  v1?.close()
  for (const w of sdks) await w.shutdown()
  await turnd?.stop()
})

test('a bearer header and a ?token= query are accepted', async () => {
  const worker = open(turnd.iiiUrl, { headers: { Authorization: `Bearer ${TOKEN}` } })
  worker.registerFunction('auth::echo', async (x) => x)
  const caller = open(`${turnd.iiiUrl}/?token=${TOKEN}`)
  await until('the worker registered', async () => (await v1.call('functions.list')).functions.some((f) => f.function_id === 'auth::echo' && f.workers > 0))
  assert.deepEqual(await caller.trigger({ function_id: 'auth::echo', payload: { ok: 1 } }), { ok: 1 })
})

test('a wrong token, a token of one role only, and no token are refused', async () => {
  const before = (turnd.stderr.match(/iii connection refused/g) ?? []).length
  const wrong = open(turnd.iiiUrl, { headers: { Authorization: 'Bearer nope-nope-nope' } })
  wrong.registerFunction('auth::wrong', async () => 1)
  const oneRole = open(`${turnd.iiiUrl}/?token=worker-only-token`)
  oneRole.registerFunction('auth::one-role', async () => 1)
  const none = open(turnd.iiiUrl)
  none.registerFunction('auth::none', async () => 1)
  await until('three refusals in the log', () => (turnd.stderr.match(/iii connection refused/g) ?? []).length >= before + 3)
  await sleep(300)
  const { functions } = await v1.call('functions.list')
  assert.deepEqual(
    functions.filter((f) => ['auth::wrong', 'auth::one-role', 'auth::none'].includes(f.function_id)),
    [],
  )
})
