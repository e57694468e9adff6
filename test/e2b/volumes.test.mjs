// The real E2B SDK (2.51.0) against cage's volumes and metrics over time:
// Volume create, write, read, list, metadata, remove and destroy through
// the content API (E2B_VOLUME_API_URL: the daemon's API address); a volume
// mounted in two sandboxes one after the other; getMetrics over a range.
// volumes_test.go runs it on the process wall and the others present.
import { test } from 'node:test'
import assert from 'node:assert/strict'

import { sdk, TEMPLATE, withSandbox, errText } from './helpers.mjs'

const { Sandbox, Volume } = sdk
const T = { timeout: 180_000 }
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

const volumeURL = process.env.E2B_VOLUME_API_URL
if (!volumeURL || !['127.0.0.1', 'localhost'].includes(new URL(volumeURL).hostname)) {
  throw new Error(`E2B_VOLUME_API_URL=${volumeURL} is not a loopback cage`)
}

/** Creates a volume, runs fn, and always destroys it. */
async function withVolume(name, fn) {
  const vol = await Volume.create(name)
  try {
    return await fn(vol)
  } finally {
    await Volume.destroy(vol.volumeId).catch((err) => console.error(`# destroy ${vol.volumeId}: ${errText(err)}`))
  }
}

test('Volume: create, write, read, list, metadata, remove, destroy', T, async () => {
  const name = `vol-${Date.now()}`
  const vol = await Volume.create(name)
  assert.ok(vol.volumeId && vol.token, 'create gives an id and a token')
  assert.equal(vol.name, name)
  await assert.rejects(Volume.create(name), (err) => /already/.test(err.message), 'a second volume of the name is refused')
  await assert.rejects(Volume.create('not a name'), 'a name with a space is refused')
  assert.ok((await Volume.list()).some((v) => v.volumeId === vol.volumeId && v.name === name), 'Volume.list has it')
  const info = await Volume.getInfo(vol.volumeId)
  assert.equal(info.name, name)

  const written = await vol.writeFile('/docs/readme.txt', 'hello volume\n', { force: true })
  assert.equal(written.type, 'file')
  assert.equal(written.size, 13)
  assert.ok(written.mtime instanceof Date && !isNaN(written.mtime), 'mtime is a date')
  assert.equal(await vol.readFile('/docs/readme.txt'), 'hello volume\n')
  const bytes = await vol.readFile('/docs/readme.txt', { format: 'bytes' })
  assert.equal(bytes.length, 13)
  // A streamed upload of 3 MiB, read back the same.
  const big = new Uint8Array(3 << 20).map((_, i) => i % 251)
  await vol.writeFile('/big.bin', new Blob([big]).stream())
  assert.deepEqual(await vol.readFile('/big.bin', { format: 'bytes' }), big)

  const dir = await vol.makeDir('/a/b/c', { force: true })
  assert.equal(dir.type, 'directory')
  const entries = await vol.list('/', { depth: 2 })
  assert.deepEqual(entries.map((e) => e.path), ['/a', '/a/b', '/big.bin', '/docs', '/docs/readme.txt'])
  assert.equal(await vol.exists('/docs/readme.txt'), true)
  assert.equal(await vol.exists('/nope'), false)
  await assert.rejects(vol.readFile('/nope'), sdk.VolumePathNotFoundError ?? Error)

  const meta = await vol.updateMetadata('/docs/readme.txt', { mode: 0o600, uid: 0 })
  assert.equal(meta.mode, 0o600)
  assert.equal(meta.uid, 0)
  const stat = await vol.getInfo('/docs/readme.txt')
  assert.equal(stat.mode, 0o600)

  await vol.remove('/a')
  assert.equal(await vol.exists('/a/b'), false)

  // Another volume's token opens nothing here.
  await withVolume(`${name}-other`, async (other) => {
    const wrong = new Volume(vol.volumeId, vol.name, other.token)
    await assert.rejects(wrong.readFile('/docs/readme.txt'), (err) => err.name === 'AuthenticationError' || /401|token/i.test(err.message))
  })

  assert.equal(await Volume.destroy(vol.volumeId), true)
  assert.equal(await Volume.destroy(vol.volumeId), false, 'a second destroy is 404: false')
  await assert.rejects(Volume.getInfo(vol.volumeId), sdk.VolumeNotFoundError ?? Error)
})

test('a volume mounted in two sandboxes one after the other', T, async () => {
  await withVolume(`shared-${Date.now()}`, async (vol) => {
    await vol.writeFile('/from-api.txt', 'written through the API\n')
    await withSandbox({ volumeMounts: { '/mnt/shared': vol } }, async (sbx) => {
      const info = await Sandbox.getInfo(sbx.sandboxId)
      assert.deepEqual(info.volumeMounts, [{ name: vol.name, path: '/mnt/shared' }])
      const r = await sbx.commands.run('cat /mnt/shared/from-api.txt && echo first > /mnt/shared/note && mkdir /mnt/shared/made && stat -c %U /mnt/shared/note')
      assert.equal(r.stdout, 'written through the API\nuser\n')
    })
    // By name, in a second sandbox, once the first is gone.
    await withSandbox({ volumeMounts: { '/home/user/data': vol.name } }, async (sbx) => {
      const r = await sbx.commands.run('cat /home/user/data/note && stat -c %U /home/user/data/made && echo second >> /home/user/data/note')
      assert.equal(r.stdout, 'first\nuser\n')
    })
    assert.equal(await vol.readFile('/note'), 'first\nsecond\n')
    const note = await vol.getInfo('/note')
    assert.equal(note.uid, 1000, 'what user wrote inside is uid 1000 in the volume')
  })
})

test('a volume a sandbox mounts is not destroyed under it', T, async () => {
  await withVolume(`busy-${Date.now()}`, async (vol) => {
    await withSandbox({ volumeMounts: { '/mnt/busy': vol } }, async () => {
      await assert.rejects(Volume.destroy(vol.volumeId), /mounted by sandbox/)
    })
  })
})

test('getMetrics over a range: samples every 5 s, none outside it', T, async () => {
  await withSandbox({}, async (sbx) => {
    const t0 = new Date()
    assert.deepEqual(await sbx.getMetrics(), [], 'no sample right after create, as on E2B')
    await sbx.commands.run('end=$(($(date +%s)+3)); while [ "$(date +%s)" -lt "$end" ]; do :; done')
    await sleep(9_000)
    const all = await sbx.getMetrics({ start: new Date(t0.getTime() - 60_000), end: new Date(Date.now() + 60_000) })
    assert.ok(all.length >= 2, `two samples or more after 12 s: ${JSON.stringify(all)}`)
    for (const m of all) {
      assert.ok(m.timestamp instanceof Date && !isNaN(m.timestamp), 'timestamp is a date')
      assert.ok(m.memUsed > 0 && m.memTotal > 0 && m.diskTotal > 0 && m.cpuCount > 0, JSON.stringify(m))
    }
    for (let i = 1; i < all.length; i++) {
      const step = all[i].timestamp - all[i - 1].timestamp
      assert.ok(step >= 4_000 && step <= 7_000, `samples ${step} ms apart, want about 5 s`)
    }
    assert.ok(all.some((m) => m.cpuUsedPct > 0), 'the busy seconds show')
    const first = all[0].timestamp
    const later = await sbx.getMetrics({ start: new Date(first.getTime() + 1000) })
    assert.equal(later.length, all.length - 1, 'start excludes the first sample')
    assert.deepEqual(await sbx.getMetrics({ start: new Date(Date.now() + 3_600_000) }), [], 'a range in the future holds none')
    await assert.rejects(sbx.getMetrics({ start: new Date(), end: new Date(Date.now() - 3_600_000) }), 'end before start is refused')
  })
})
