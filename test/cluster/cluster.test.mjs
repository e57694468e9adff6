// The real E2B SDK against one front of a cage cluster (cluster_test.go
// runs it once through node A's API and proxy, once through node C's):
// sandboxes made here land on every node, and each is used through this
// front whatever node holds it: commands (streamed), files, getInfo,
// setTimeout, connect, list (pages, metadata), kill, and a timeout's end.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { createRequire } from 'node:module'

for (const name of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY', 'E2B_DIR', 'CLUSTER_RUN']) {
  if (!process.env[name]) throw new Error(`${name} is not set: run through cluster_test.go`)
}
// Only the test's own cluster: its nodes are on a 10.197.x.0/24 bridge.
for (const name of ['E2B_API_URL', 'E2B_SANDBOX_URL']) {
  const host = new URL(process.env[name]).hostname
  if (!/^10\.197\.\d+\.\d+$/.test(host)) throw new Error(`${name}=${process.env[name]} is not the test cluster`)
}
const require = createRequire(process.env.E2B_DIR + '/package.json')
const { Sandbox, NotFoundError } = require(process.env.E2B_SDK_MODULE || 'e2b')
const TEMPLATE = process.env.CAGE_TEST_TEMPLATE || 'host'
const RUN = process.env.CLUSTER_RUN
const N = Number(process.env.CLUSTER_SANDBOXES || '6')
const T = { timeout: 180_000 }

test('sandboxes on every node, used through one front', T, async () => {
  const sbxs = []
  try {
    for (let i = 0; i < N; i++) {
      // One at a time: the scheduler spreads each over the nodes by what
      // they already run.
      sbxs.push(await Sandbox.create(TEMPLATE, { timeoutMs: 120_000, metadata: { run: RUN, i: String(i) } }))
    }
    console.log('# sandboxes ' + JSON.stringify(sbxs.map((s) => s.sandboxId)))
    await Promise.all(sbxs.map(async (s, i) => {
      const r = await s.commands.run(`echo hello-${i}`)
      assert.equal(r.stdout, `hello-${i}\n`)
      const chunks = []
      const streamed = await s.commands.run('for n in 1 2 3; do echo $n; sleep 0.2; done', {
        onStdout: (d) => chunks.push(d),
      })
      assert.equal(chunks.join(''), '1\n2\n3\n', 'onStdout chunks')
      assert.equal(streamed.exitCode, 0)
      await s.files.write('/tmp/x.txt', `data-${i}`)
      assert.equal(await s.files.read('/tmp/x.txt'), `data-${i}`)
      const before = (await s.getInfo()).endAt
      await s.setTimeout(300_000)
      const info = await s.getInfo()
      assert.equal(info.sandboxId, s.sandboxId)
      assert.equal(info.metadata.run, RUN)
      assert.ok(info.endAt > before, `setTimeout moved endAt: ${before} -> ${info.endAt}`)
      const again = await Sandbox.connect(s.sandboxId)
      assert.equal((await again.commands.run('cat /tmp/x.txt')).stdout, `data-${i}`)
      assert.equal(await s.isRunning(), true)
    }))
    // The list of this front holds all of them, page by page.
    const seen = []
    const pages = Sandbox.list({ query: { metadata: { run: RUN } }, limit: 2 })
    for (let i = 0; pages.hasNext && i < 20; i++) seen.push(...(await pages.nextItems()))
    assert.deepEqual(seen.map((l) => l.sandboxId).sort(), sbxs.map((s) => s.sandboxId).sort(), 'listed')
    const one = seen.find((l) => l.metadata.i === '0')
    assert.equal(one.state, 'running')
  } finally {
    await Promise.all(sbxs.map((s) => s.kill().catch((e) => console.error(`# kill ${s.sandboxId}: ${e}`))))
  }
  for (const s of sbxs) {
    await assert.rejects(Sandbox.getInfo(s.sandboxId), (e) => e instanceof NotFoundError, 'getInfo after kill')
  }
  const left = await Sandbox.list({ query: { metadata: { run: RUN } } }).nextItems()
  assert.deepEqual(left, [], 'listed after kill')
})

test('a timeout ends a sandbox wherever it is', T, async () => {
  const s = await Sandbox.create(TEMPLATE, { timeoutMs: 3_000, metadata: { run: RUN, kind: 'timeout' } })
  const deadline = Date.now() + 30_000
  while (await s.isRunning()) {
    assert.ok(Date.now() < deadline, 'still running 30 s after a 3 s timeout')
    await new Promise((r) => setTimeout(r, 250))
  }
  // Its record goes a moment after its processes.
  for (;;) {
    try {
      await Sandbox.getInfo(s.sandboxId)
    } catch (e) {
      assert.ok(e instanceof NotFoundError, `getInfo after the timeout: ${e}`)
      break
    }
    assert.ok(Date.now() < deadline, 'still known 30 s after a 3 s timeout')
    await new Promise((r) => setTimeout(r, 250))
  }
})
