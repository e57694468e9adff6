// A scripted session through the real E2B SDK (2.51.0) whose every step
// the daemon's audit trail must record; audit_test.go then reads the trail
// (GET /audit with the same key, and `cage audit verify` on the store) and
// checks each kind of entry is there with what the SDK did.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { sdk, TEMPLATE, waitFor } from './helpers.mjs'

const { Sandbox, CommandExitError } = sdk
const T = { timeout: 240_000 }

test('an audited session: commands, files, network, lifecycle', T, async () => {
  let sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 120_000, metadata: { audit: 'session' } })
  const made = [sbx.sandboxId]
  try {
    // process.start and process.end (exit 3, as the agent reports it)
    await assert.rejects(sbx.commands.run('echo audit-marker-sdk; exit 3'), CommandExitError)
    // process.signal: a background command killed
    const bg = await sbx.commands.run('sleep 60', { background: true })
    assert.equal(await bg.kill(), true)
    // files: write (hashed as it passes), read, mkdir, move, remove
    await sbx.files.write('/tmp/audit-a.txt', 'audited contents\n')
    assert.equal(await sbx.files.read('/tmp/audit-a.txt'), 'audited contents\n')
    await sbx.files.makeDir('/tmp/audit-dir')
    await sbx.files.rename('/tmp/audit-a.txt', '/tmp/audit-dir/b.txt')
    await sbx.files.remove('/tmp/audit-dir/b.txt')
    // net.dns and net.connect: a name asked, a metadata address refused
    await sbx.commands.run('getent hosts allowed.example.com; python3 -c "import socket; s=socket.socket(); s.settimeout(2); s.connect_ex((\'169.254.169.254\', 80))"')
    // sandbox.network
    await sbx.updateNetwork({ allowOut: ['allowed.example.com'], denyOut: ['0.0.0.0/0'] })
    await sbx.setTimeout(90_000)
    // sandbox.pause and sandbox.resume
    assert.equal(await sbx.pause(), true)
    sbx = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 120_000 })
    // sandbox.snapshot, and sandbox.fork (a snapshot of its own)
    const snap = await sbx.createSnapshot()
    const forks = await sbx.fork({ count: 1, timeoutMs: 60_000 })
    for (const f of forks) {
      made.push(f.sandboxId)
      await f.kill()
    }
    await Sandbox.deleteSnapshot(snap.snapshotId).catch(() => {})
  } finally {
    for (const id of made) await Sandbox.kill(id).catch(() => {})
  }
  // sandbox.timeout: one that lives a second
  const short = await Sandbox.create(TEMPLATE, { timeoutMs: 1_000 })
  const gone = async () => {
    try {
      await Sandbox.getInfo(short.sandboxId)
      return false
    } catch (e) {
      if (e instanceof sdk.NotFoundError) return true
      throw e
    }
  }
  await waitFor(gone, 30_000, () => 'the short sandbox to time out')
  console.log(`AUDIT-SANDBOXES ${made.join(' ')} ${short.sandboxId}`)
})
