// E2B parity (issue 15): what an existing E2B project's own code does
// without thinking, run through the real SDK against cage serve. parity_test.go
// starts the daemon (on the process wall, and on others) and runs this file
// once per SDK release named by E2B_SDK_MODULE. Every test kills what it
// makes.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { request } from 'node:http'

import { moduleName, sdk, sdkVersion, TEMPLATE, withSandbox, errText } from './helpers.mjs'

const { Sandbox, InvalidArgumentError } = sdk

console.log(`# parity: E2B SDK ${moduleName} ${sdkVersion}, template ${TEMPLATE}`)

const T = { timeout: 90_000 }
const HOME = '/home/user'

/** All items of a paginator (at most 50 pages). */
async function all(paginator) {
  const out = []
  for (let i = 0; paginator.hasNext && i < 50; i++) out.push(...(await paginator.nextItems()))
  return out
}

const ids = (items) => items.map((s) => s.sandboxId)

test('Sandbox.list: order, startedAfter and template, with metadata, state and pages', { timeout: 120_000 }, async () => {
  const suite = randomBytes(6).toString('hex')
  const made = []
  try {
    for (let i = 0; i < 3; i++) {
      made.push(await Sandbox.create(TEMPLATE, { timeoutMs: 120_000, metadata: { suite, n: String(i) } }))
      await new Promise((r) => setTimeout(r, 20))
    }
    made.push(await Sandbox.create('cage-test', { timeoutMs: 120_000, metadata: { suite, n: '3' } }))
    const created = ids(made)
    const q = { metadata: { suite } }

    assert.deepEqual(ids(await all(Sandbox.list({ query: q, order: 'asc' }))), created, 'order asc: oldest first')
    assert.deepEqual(ids(await all(Sandbox.list({ query: q, order: 'desc' }))), [...created].reverse(), 'order desc')
    assert.deepEqual(ids(await all(Sandbox.list({ query: q }))), [...created].reverse(), 'no order: newest first, as on E2B')
    for (const order of ['asc', 'desc']) {
      const want = order === 'asc' ? created : [...created].reverse()
      const pages = Sandbox.list({ query: q, order, limit: 1 })
      const seen = []
      let n = 0
      while (pages.hasNext) {
        assert.ok(++n <= 10, `order ${order}, limit 1: more than 10 pages`)
        const page = await pages.nextItems()
        assert.ok(page.length <= 1, `order ${order}: a page of ${page.length} with limit 1`)
        seen.push(...ids(page))
      }
      assert.deepEqual(seen, want, `order ${order} across pages of one: the whole list's order, each once`)
    }

    // startedAfter is inclusive: the second one's own start time.
    const second = (await all(Sandbox.list({ query: q, order: 'asc' })))[1]
    assert.ok(second.startedAt instanceof Date)
    const after = await all(Sandbox.list({ query: { ...q, startedAfter: second.startedAt }, order: 'asc' }))
    assert.deepEqual(ids(after), created.slice(1), `startedAfter ${second.startedAt.toISOString()}`)
    const future = await all(Sandbox.list({ query: { ...q, startedAfter: new Date(Date.now() + 3_600_000) } }))
    assert.deepEqual(ids(future), [], 'startedAfter an hour ahead')

    // template: by the name a sandbox was made from; one nobody used lists nothing.
    assert.deepEqual(ids(await all(Sandbox.list({ query: { ...q, template: 'cage-test' } }))), [created[3]], 'template cage-test')
    assert.deepEqual(ids(await all(Sandbox.list({ query: { ...q, template: TEMPLATE }, order: 'asc' }))), created.slice(0, 3), `template ${TEMPLATE}`)
    assert.deepEqual(await all(Sandbox.list({ query: { ...q, template: 'no-such-template-' + suite } })), [], 'an unknown template: nothing, no error')

    // All of them at once.
    const combined = await all(Sandbox.list({
      query: { metadata: { suite, n: '2' }, state: ['running'], template: TEMPLATE, startedAfter: second.startedAt },
      order: 'asc',
      limit: 1,
    }))
    assert.deepEqual(ids(combined), [created[2]], 'metadata, state, template, startedAfter and pages together')
    assert.deepEqual(await all(Sandbox.list({ query: { ...q, state: ['paused'], template: TEMPLATE } })), [], 'state paused')
  } finally {
    await Promise.all(made.map((s) => s.kill().catch((e) => console.error(`# kill ${s.sandboxId}: ${e}`))))
  }
})

test('files: write with metadata; getInfo and list return it; octet-stream and multipart; bounds', T, async () => {
  await withSandbox({}, async (sbx) => {
    const dir = `${HOME}/md`
    const md = { owner: 'alice', purpose: 'test run=1&x' }
    const w = await sbx.files.write(`${dir}/a.txt`, 'alpha', { metadata: md })
    assert.deepEqual(w.metadata, md, 'the write answers with the metadata kept')
    assert.deepEqual((await sbx.files.getInfo(`${dir}/a.txt`)).metadata, md, 'getInfo')

    // E2B keeps keys as HTTP header names: lowercased.
    const o = await sbx.files.write(`${dir}/b.txt`, 'beta', { metadata: { Stage: 'Two' }, useOctetStream: true })
    assert.deepEqual(o.metadata, { stage: 'Two' }, 'octet-stream upload')
    const many = await sbx.files.writeFiles(
      [{ path: `${dir}/c1.txt`, data: 'c1' }, { path: `${dir}/c2.txt`, data: 'c2' }],
      { metadata: { batch: '7' } },
    )
    assert.deepEqual(many.map((f) => f.metadata), [{ batch: '7' }, { batch: '7' }], 'multipart upload of two files')

    const listed = Object.fromEntries((await sbx.files.list(dir)).map((e) => [e.name, e.metadata]))
    assert.deepEqual(listed, { 'a.txt': md, 'b.txt': { stage: 'Two' }, 'c1.txt': { batch: '7' }, 'c2.txt': { batch: '7' } }, 'list')

    // Writing again replaces the metadata; without any, none is left.
    await sbx.files.write(`${dir}/a.txt`, 'alpha 2', { metadata: { version: '2' } })
    assert.deepEqual((await sbx.files.getInfo(`${dir}/a.txt`)).metadata, { version: '2' })
    await sbx.files.write(`${dir}/a.txt`, 'alpha 3')
    assert.equal((await sbx.files.getInfo(`${dir}/a.txt`)).metadata, undefined, 'a write without metadata clears it')
    assert.equal((await sbx.files.getInfo(dir)).metadata, undefined, 'a directory has none')

    // Bounds, as E2B's: the SDK refuses what is not printable ASCII; the
    // server refuses more than 4096 bytes, and writes nothing.
    await assert.rejects(sbx.files.write(`${dir}/bad.txt`, 'x', { metadata: { k: 'café' } }), (e) => {
      assert.ok(e instanceof InvalidArgumentError, `non-ASCII value: ${errText(e)}`)
      return true
    })
    await assert.rejects(sbx.files.write(`${dir}/big.txt`, 'x', { metadata: { k: 'v'.repeat(5000) } }), (e) => {
      assert.ok(e instanceof InvalidArgumentError, `5000-byte value: want InvalidArgumentError (400), got ${errText(e)}`)
      return true
    })
    assert.equal(await sbx.files.exists(`${dir}/big.txt`), false, 'a refused upload writes nothing')
  })
})

test('files.remove of a path that does not exist succeeds, as on E2B', T, async () => {
  await withSandbox({}, async (sbx) => {
    await sbx.files.remove(`${HOME}/never-was`)
    await sbx.files.remove(`${HOME}/no/such/dir`)
    await sbx.files.write(`${HOME}/f`, 'x')
    await sbx.files.remove(`${HOME}/f`)
    await sbx.files.remove(`${HOME}/f`)
    assert.equal(await sbx.files.exists(`${HOME}/f`), false)
  })
})

/**
 * Requests url as a browser would once {port}-{id}.{domain} resolves to the
 * proxy: no token, no E2B headers, only the URL (sent to the proxy's address
 * with the URL's host; plain HTTP, the proxy serves no TLS yet).
 */
function viaHost(url, { method = 'GET', body, headers = {} } = {}) {
  const u = new URL(url)
  const proxy = new URL(process.env.E2B_SANDBOX_URL)
  return new Promise((resolve, reject) => {
    const req = request(
      { host: proxy.hostname, port: proxy.port, method, path: u.pathname + u.search, headers: { ...headers, Host: u.host } },
      (res) => {
        const chunks = []
        res.on('data', (d) => chunks.push(d))
        res.on('end', () => resolve({ status: res.statusCode, body: Buffer.concat(chunks).toString() }))
      },
    )
    req.on('error', reject)
    req.end(body)
  })
}

function multipart(data) {
  const b = 'cage' + randomBytes(8).toString('hex')
  return {
    body: `--${b}\r\nContent-Disposition: form-data; name="file"; filename="upload"\r\nContent-Type: application/octet-stream\r\n\r\n${data}\r\n--${b}--\r\n`,
    headers: { 'Content-Type': `multipart/form-data; boundary=${b}` },
  }
}

/** A handle on sbx as a client with no E2B_SANDBOX_URL sees it: its URLs are {port}-{id}.{domain}. */
async function hostRouted(sbx) {
  const saved = { url: process.env.E2B_SANDBOX_URL, domain: process.env.E2B_DOMAIN }
  delete process.env.E2B_SANDBOX_URL
  process.env.E2B_DOMAIN = 'cage.test'
  try {
    return await Sandbox.connect(sbx.sandboxId)
  } finally {
    process.env.E2B_SANDBOX_URL = saved.url
    if (saved.domain === undefined) delete process.env.E2B_DOMAIN
    else process.env.E2B_DOMAIN = saved.domain
  }
}

test('signed file URLs: downloadUrl and uploadUrl work without the token; expired, wrong or missing signatures get 401', T, async () => {
  await withSandbox({}, async (first) => {
    const sbx = await hostRouted(first)
    const p = `${HOME}/shared.txt`
    await first.files.write(p, 'for a browser')
    const down = await sbx.downloadUrl(p)
    const u = new URL(down)
    assert.equal(u.host, `49983-${sbx.sandboxId}.cage.test`, `downloadUrl ${down}`)
    assert.match(u.searchParams.get('signature') ?? '', /^v1_/, 'signed')
    let r = await viaHost(down)
    assert.equal(r.status, 200, `GET ${down}: ${r.body}`)
    assert.equal(r.body, 'for a browser')

    // Expiry: a minute ahead works, the past is refused.
    r = await viaHost(await sbx.downloadUrl(p, { useSignatureExpiration: 60 }))
    assert.equal(r.status, 200, `with an expiration a minute ahead: ${r.body}`)
    r = await viaHost(await sbx.downloadUrl(p, { useSignatureExpiration: -5 }))
    assert.equal(r.status, 401, `expired 5 s ago: ${r.status} ${r.body}`)

    // Wrong signatures: tampered, for another path, for reading used to
    // write, extended expiry; and none at all.
    const tampered = new URL(down)
    const sig = tampered.searchParams.get('signature')
    tampered.searchParams.set('signature', sig.slice(0, -2) + (sig.endsWith('AA') ? 'BB' : 'AA'))
    const otherPath = new URL(down)
    otherPath.searchParams.set('path', `${HOME}/.bashrc`)
    const stretched = new URL(await sbx.downloadUrl(p, { useSignatureExpiration: 10 }))
    stretched.searchParams.set('signature_expiration', String(Number(stretched.searchParams.get('signature_expiration')) + 3600))
    const unsigned = new URL(down)
    unsigned.searchParams.delete('signature')
    for (const [what, url] of [['tampered', tampered], ['another path', otherPath], ['a later expiry', stretched], ['unsigned', unsigned]]) {
      r = await viaHost(url.toString())
      assert.equal(r.status, 401, `${what}: ${r.status} ${r.body}`)
    }
    r = await viaHost(down, { method: 'POST', ...multipart('overwritten') })
    assert.equal(r.status, 401, `a read signature used to write: ${r.status} ${r.body}`)
    assert.equal(await first.files.read(p), 'for a browser', 'nothing was written by refused requests')

    // uploadUrl: a POST of multipart form data, as the SDK documents.
    const up = await sbx.uploadUrl(`${HOME}/from-browser.txt`, { useSignatureExpiration: 60 })
    r = await viaHost(up, { method: 'POST', ...multipart('uploaded without the token') })
    assert.equal(r.status, 200, `POST ${up}: ${r.body}`)
    assert.equal(await first.files.read(`${HOME}/from-browser.txt`), 'uploaded without the token')
    assert.equal((await first.commands.run(`stat -c %U ${HOME}/from-browser.txt`)).stdout, 'user\n', 'written as user')

    // The named user, root included: a file only root may read.
    await first.commands.run('echo root-only > /tmp/root-only && chmod 600 /tmp/root-only', { user: 'root' })
    r = await viaHost(await sbx.downloadUrl('/tmp/root-only', { user: 'root' }))
    assert.deepEqual([r.status, r.body], [200, 'root-only\n'], 'signed for root')
    r = await viaHost(await sbx.downloadUrl('/tmp/root-only', { user: 'user' }))
    assert.notEqual(r.status, 200, `signed for user, a file only root reads: ${r.status} ${r.body}`)
    const asRoot = new URL(await sbx.downloadUrl('/tmp/root-only'))
    asRoot.searchParams.set('username', 'root')
    r = await viaHost(asRoot.toString())
    assert.equal(r.status, 401, `a signature for the default user, sent as root: ${r.status} ${r.body}`)
    r = await viaHost(await sbx.uploadUrl('/tmp/by-root.txt', { user: 'root' }), { method: 'POST', ...multipart('r') })
    assert.equal(r.status, 200, `upload signed for root: ${r.body}`)
    assert.equal((await first.commands.run('stat -c %U /tmp/by-root.txt')).stdout, 'root\n')
  })
})

test('getMetrics right after create: an empty list, as E2B answers before its first sample', T, async () => {
  await withSandbox({}, async (sbx) => {
    const m = await sbx.getMetrics()
    assert.ok(Array.isArray(m), `getMetrics() is a list: ${JSON.stringify(m)}`)
    assert.deepEqual(m, [], 'no sample exists yet')
  })
})

test('the base template: python, pip, sudo, git, curl, wget, jq, build-essential', { timeout: 180_000, skip: process.env.CAGE_TEST_BASE !== '1' && 'no base template (scripts/test.sh builds it)' }, async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 180_000 })
  const run = async (cmd, opts) => {
    try {
      return (await sbx.commands.run(cmd, opts)).stdout
    } catch (e) {
      throw new Error(`${cmd}: ${errText(e)} stdout=${JSON.stringify(e.stdout)} stderr=${JSON.stringify(e.stderr)}`)
    }
  }
  try {
    assert.match(await run('python --version'), /^Python 3\./)
    assert.equal(await run('python -c "import sys; print(sys.executable)"'), '/usr/bin/python\n')
    assert.match(await run('pip --version'), /^pip /)
    // pip installs as user (into ~/.local), offline from a local project.
    await sbx.files.write(`${HOME}/pkg/pyproject.toml`, '[project]\nname = "cagepkg"\nversion = "1.0"\n[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n')
    await sbx.files.write(`${HOME}/pkg/cagepkg.py`, 'ANSWER = 42\n')
    await run('cd ~/pkg && pip install --no-build-isolation --no-index --quiet .')
    assert.equal(await run('cd / && python -c "import cagepkg; print(cagepkg.ANSWER)"'), '42\n')

    // sudo: root through the agent; root owns the template's files, and
    // holds no capabilities.
    assert.equal(await run('sudo id -u; sudo -n whoami; id -un'), '0\nroot\nuser\n')
    assert.equal(await run('sudo sh -c "echo from-root > /etc/cage-sudo" && stat -c %U /etc/cage-sudo && cat /etc/cage-sudo'), 'root\nfrom-root\n')
    assert.equal(await run('echo piped | sudo tee /opt/piped >/dev/null && cat /opt/piped'), 'piped\n')
    assert.equal(await run('cd /tmp && sudo pwd'), '/tmp\n')
    assert.equal(await run('sudo -u user id -un'), 'user\n')
    assert.equal(await run('echo secret > ~/private && chmod 600 ~/private && (sudo cat ~/private 2>&1 || echo refused)'),
      'cat: /home/user/private: Permission denied\nrefused\n', 'root without capabilities cannot read another user\'s private file')
    assert.equal(await run('sudo grep -c "^CapEff:.0000000000000000" /proc/self/status'), '1\n', 'no effective capabilities as root')

    assert.match(await run('git --version'), /^git version/)
    assert.match(await run('curl --version | head -1'), /^curl /)
    assert.match(await run('wget --version | head -1'), /^GNU Wget/)
    assert.equal(await run(`jq -n '{a: (6*7)}' -c`), '{"a":42}\n')
    await sbx.files.write(`${HOME}/hello.c`, '#include <stdio.h>\nint main(void) { printf("built %d\\n", 6*7); return 0; }\n')
    assert.equal(await run('cd ~ && make -s hello >/dev/null && ./hello'), 'built 42\n', 'make and gcc (build-essential)')
    assert.equal(await run('node -e "console.log(6*7)"'), '42\n')
  } finally {
    await sbx.kill()
  }
})
