// The real MCP client (@modelcontextprotocol/sdk 1.32.2) against cage's MCP
// server: over stdio, spawning `cage mcp` (CAGE_BIN) with the key in
// E2B_API_KEY, and over streamable HTTP at /mcp on the daemon's API address
// with the key as a bearer token. mcp_test.go starts the daemon, makes a
// second key (CAGE_TEST_OTHER_KEY) and plants a file on the host
// (CAGE_TEST_HOST_SECRET) that no tool may reach. Every test kills the
// sandboxes it makes.
import { test, describe, before, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import net from 'node:net'
import fs from 'node:fs'
import path from 'node:path'

import { Client } from '@modelcontextprotocol/sdk/client/index.js'
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js'
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js'

const API = process.env.E2B_API_URL
const PROXY = process.env.E2B_SANDBOX_URL
const KEY = process.env.E2B_API_KEY
const OTHER = process.env.CAGE_TEST_OTHER_KEY
const BIN = process.env.CAGE_BIN
const SECRET = process.env.CAGE_TEST_HOST_SECRET
const INTERP = process.env.CAGE_TEST_INTERP === '1'
for (const [name, v] of Object.entries({ E2B_API_URL: API, E2B_SANDBOX_URL: PROXY, E2B_API_KEY: KEY, CAGE_TEST_OTHER_KEY: OTHER, CAGE_BIN: BIN, CAGE_TEST_HOST_SECRET: SECRET })) {
  if (!v) throw new Error(`${name} is not set: mcp_test.go runs this file`)
}
for (const u of [API, PROXY]) {
  if (!['127.0.0.1', 'localhost'].includes(new URL(u).hostname)) throw new Error(`${u} is not a loopback cage`)
}
const T = { timeout: 120_000 }
const TOOLS = ['sandbox_create', 'sandbox_list', 'sandbox_kill', 'sandbox_pause', 'sandbox_resume', 'exec', 'run_code', 'file_read', 'file_write', 'file_list', 'port_url']
// A 1x1 PNG.
const PNG1 = 'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=='

/** A connected client over transport ('stdio' or 'http') with key. */
async function connect(transport, key = KEY) {
  const c = new Client({ name: 'cage-mcp-test', version: '1.0.0' })
  if (transport === 'stdio') {
    // The key and addresses in E2B's variables, as an E2B user's MCP config has them.
    await c.connect(new StdioClientTransport({
      command: BIN, args: ['mcp'], stderr: 'inherit',
      env: { E2B_API_KEY: key, E2B_API_URL: API, E2B_SANDBOX_URL: PROXY, PATH: process.env.PATH },
    }))
  } else {
    await c.connect(new StreamableHTTPClientTransport(new URL(`${API}/mcp`), { requestInit: { headers: { Authorization: `Bearer ${key}` } } }))
  }
  return c
}

const textOf = (r) => r.content.filter((x) => x.type === 'text').map((x) => x.text).join('\n')

/** Calls a tool that must succeed and returns its structured content. */
async function ok(c, name, args) {
  const r = await c.callTool({ name, arguments: args })
  assert.ok(!r.isError, `${name}: want success, got the tool error: ${textOf(r)}`)
  return r
}

/** Calls a tool that must fail as a tool (isError, not a protocol error) and returns its text. */
async function fails(c, name, args) {
  const r = await c.callTool({ name, arguments: args })
  assert.equal(r.isError, true, `${name}: want a tool error, got ${JSON.stringify(r).slice(0, 500)}`)
  return textOf(r)
}

/** Creates a sandbox (host template unless args say), runs fn(id), always kills it. */
async function withSandbox(c, args, fn) {
  const sb = (await ok(c, 'sandbox_create', { template: 'host', timeout_s: 300, ...args })).structuredContent
  try {
    return await fn(sb.sandbox_id, sb)
  } catch (err) {
    console.log(`# failed in sandbox ${sb.sandbox_id}`)
    throw err
  } finally {
    const r = await c.callTool({ name: 'sandbox_kill', arguments: { sandbox_id: sb.sandbox_id } })
    if (r.isError) console.error(`# kill ${sb.sandbox_id}: ${textOf(r)}`)
  }
}

/** GET through the proxy, routed by Host (as a browser does once the name resolves) or by headers. */
function viaProxy(url, { host, headers = {} } = {}) {
  const u = new URL(url)
  return new Promise((resolve, reject) => {
    const h = { ...headers }
    if (host) h.Host = host
    const req = http.request({ host: u.hostname, port: u.port, path: u.pathname, headers: h, agent: false }, (res) => {
      let body = ''
      res.on('data', (d) => (body += d))
      res.on('end', () => resolve({ status: res.statusCode, body }))
    })
    req.on('error', reject)
    req.end()
  })
}

async function until(fn, ms, what) {
  const deadline = Date.now() + ms
  let last
  while (Date.now() < deadline) {
    last = await fn()
    if (last.ok) return last
    await new Promise((r) => setTimeout(r, 100))
  }
  throw new Error(`timed out waiting for ${what}: ${JSON.stringify(last)}`)
}

for (const transport of ['stdio', 'http']) {
  describe(`MCP over ${transport}`, () => {
    let c
    before(async () => { c = await connect(transport) })
    after(async () => { await c?.close() })

    test('lists the tools with their schemas and annotations', T, async () => {
      const { tools } = await c.listTools()
      assert.deepEqual(tools.map((t) => t.name).sort(), [...TOOLS].sort())
      const by = Object.fromEntries(tools.map((t) => [t.name, t]))
      for (const t of tools) {
        assert.ok(t.description.length > 20, `${t.name} has a description`)
        assert.equal(t.inputSchema.type, 'object')
        assert.ok(t.outputSchema, `${t.name} declares its structured output`)
        assert.equal(typeof t.annotations?.readOnlyHint, 'boolean', `${t.name} says whether it is read-only`)
        for (const [p, s] of Object.entries(t.inputSchema.properties ?? {})) assert.ok(s.description, `${t.name}.${p} is documented`)
      }
      for (const n of ['sandbox_list', 'file_read', 'file_list', 'port_url']) assert.equal(by[n].annotations.readOnlyHint, true, n)
      assert.equal(by.sandbox_kill.annotations.destructiveHint, true)
      assert.equal(by.sandbox_kill.annotations.idempotentHint, true)
      assert.equal(by.exec.annotations.readOnlyHint, false)
      assert.deepEqual(by.exec.inputSchema.required.sort(), ['command', 'sandbox_id'])
      assert.equal(by.exec.inputSchema.properties.max_output_bytes.default, 32768)
    })

    test('create, exec, write then read, list, pause, resume, kill', T, async () => {
      let id
      await withSandbox(c, { metadata: { suite: `mcp-${transport}` } }, async (sid, sb) => {
        id = sid
        assert.equal(sb.state, 'running')
        assert.ok(Date.parse(sb.end_at) > Date.now() + 200_000, `end_at ${sb.end_at} is about 300 s ahead`)
        let r = (await ok(c, 'exec', { sandbox_id: id, command: 'echo out; echo err >&2; exit 3' })).structuredContent
        assert.equal(r.exit_code, 3)
        assert.equal(r.stdout, 'out\n')
        assert.equal(r.stderr, 'err\n')
        assert.equal(r.truncated, false)
        r = (await ok(c, 'exec', { sandbox_id: id, command: 'pwd; echo $GREETING', cwd: '/tmp', envs: { GREETING: 'hello' } })).structuredContent
        assert.equal(r.stdout, '/tmp\nhello\n')

        const w = (await ok(c, 'file_write', { sandbox_id: id, path: 'notes/a.txt', content: 'héllo, wörld\n' })).structuredContent
        assert.equal(w.path, '/home/user/notes/a.txt')
        assert.equal(w.size, Buffer.byteLength('héllo, wörld\n'))
        let rd = await ok(c, 'file_read', { sandbox_id: id, path: '/home/user/notes/a.txt' })
        assert.equal(rd.structuredContent.encoding, 'utf8')
        assert.equal(rd.content[0].text, 'héllo, wörld\n')
        // Binary data round-trips as base64, and a script gets its mode.
        const bin = Buffer.from([0, 1, 2, 255, 254, 10, 13])
        await ok(c, 'file_write', { sandbox_id: id, path: 'b.bin', content: bin.toString('base64'), encoding: 'base64' })
        rd = (await ok(c, 'file_read', { sandbox_id: id, path: 'b.bin' })).structuredContent
        assert.equal(rd.encoding, 'base64')
        assert.deepEqual(Buffer.from(rd.content, 'base64'), bin)
        await ok(c, 'file_write', { sandbox_id: id, path: 'run.sh', content: '#!/bin/sh\necho ran\n', mode: '0755' })
        assert.equal((await ok(c, 'exec', { sandbox_id: id, command: './run.sh' })).structuredContent.stdout, 'ran\n')
        // An image comes back as image content.
        await ok(c, 'file_write', { sandbox_id: id, path: 'dot.png', content: PNG1, encoding: 'base64' })
        const img = await ok(c, 'file_read', { sandbox_id: id, path: 'dot.png' })
        const ic = img.content.find((x) => x.type === 'image')
        assert.ok(ic, `file_read of a PNG gives image content: ${JSON.stringify(img.content).slice(0, 300)}`)
        assert.equal(ic.mimeType, 'image/png')
        assert.equal(ic.data, PNG1)
        // Reading a part: max_bytes and offset.
        rd = (await ok(c, 'file_read', { sandbox_id: id, path: 'notes/a.txt', max_bytes: 5, offset: 1 })).structuredContent
        assert.equal(rd.truncated, true)
        assert.equal(rd.size, Buffer.byteLength('héllo, wörld\n'))
        assert.equal(rd.content, 'éllo')

        const ls = (await ok(c, 'file_list', { sandbox_id: id, path: '~' })).structuredContent
        const names = ls.entries.map((e) => e.name)
        for (const n of ['notes', 'b.bin', 'run.sh', 'dot.png']) assert.ok(names.includes(n), `file_list has ${n}: ${names}`)
        assert.equal(ls.entries.find((e) => e.name === 'run.sh').mode, '0755')
        assert.equal(ls.entries.find((e) => e.name === 'notes').type, 'dir')
        assert.match(await fails(c, 'file_read', { sandbox_id: id, path: 'no/such/file' }), /no such file|not found/i)

        const listed = (await ok(c, 'sandbox_list', { metadata: { suite: `mcp-${transport}` } })).structuredContent
        assert.deepEqual(listed.sandboxes.map((s) => s.sandbox_id), [id])

        // Pause keeps the sandbox's processes; tools say it is paused; resume brings it back.
        await ok(c, 'exec', { sandbox_id: id, command: 'sleep 600', background: true })
        let st = (await ok(c, 'sandbox_pause', { sandbox_id: id })).structuredContent
        assert.equal(st.state, 'paused')
        assert.equal((await ok(c, 'sandbox_pause', { sandbox_id: id })).structuredContent.changed, false, 'pause is idempotent')
        assert.match(await fails(c, 'exec', { sandbox_id: id, command: 'true' }), /paused/)
        st = (await ok(c, 'sandbox_resume', { sandbox_id: id, timeout_s: 200 })).structuredContent
        assert.equal(st.state, 'running')
        r = (await ok(c, 'exec', { sandbox_id: id, command: 'pgrep -x sleep >/dev/null && echo alive' })).structuredContent
        assert.equal(r.stdout, 'alive\n', 'the background process survived the pause')
      })
      // Killed: gone for every tool, with the API's not-found.
      assert.match(await fails(c, 'exec', { sandbox_id: id, command: 'true' }), /not found/)
      assert.match(await fails(c, 'sandbox_kill', { sandbox_id: id }), /not found/)
    })

    test('huge outputs are truncated, keep their head and tail, and say so', T, async () => {
      await withSandbox(c, {}, async (id) => {
        const r = (await ok(c, 'exec', { sandbox_id: id, command: 'seq 1 1000000; seq 1 200000 >&2', max_output_bytes: 4096 })).structuredContent
        assert.equal(r.exit_code, 0)
        assert.equal(r.truncated, true)
        assert.equal(r.stdout_bytes, 6888896, 'every byte was counted')
        assert.ok(r.stdout.length < 4096 + 300, `stdout kept within the bound: ${r.stdout.length} characters`)
        assert.ok(r.stdout.startsWith('1\n2\n3\n'), 'the head is kept')
        assert.ok(r.stdout.endsWith('999999\n1000000\n'), 'the tail is kept')
        assert.match(r.stdout, /left out here: it wrote 6888896 bytes, over max_output_bytes=4096/)
        assert.ok(r.stderr.endsWith('200000\n') && r.stderr.length < 4096 + 300, 'stderr too')
        // 64 MiB of output through the default bound.
        const big = (await ok(c, 'exec', { sandbox_id: id, command: 'head -c 67108864 /dev/zero | tr "\\0" x' })).structuredContent
        assert.equal(big.truncated, true)
        assert.ok(big.stdout.length < 32768 + 300)
        assert.match(big.error, /stopped forwarding output after 16 MiB/)
        // A command past its timeout is killed and says so.
        const slow = (await ok(c, 'exec', { sandbox_id: id, command: 'sleep 30', timeout_s: 1 })).structuredContent
        assert.equal(slow.reason, 'timeout')
        assert.equal(slow.exit_code, -1)
      })
    })

    test('run_code: Python with state, a matplotlib plot as image content, huge output truncated', { ...T, skip: !INTERP && process.env.CAGE_TEST_NO_INTERP }, async () => {
      await withSandbox(c, { template: 'code-interpreter-v1' }, async (id) => {
        await ok(c, 'run_code', { sandbox_id: id, code: 'x = 6 * 7' })
        let r = await ok(c, 'run_code', { sandbox_id: id, code: 'print("state:", x)\nx + 1' })
        assert.equal(r.structuredContent.stdout, 'state: 42\n')
        assert.equal(r.structuredContent.results.find((x) => x.is_main)?.text, '43')
        r = await ok(c, 'run_code', {
          sandbox_id: id,
          code: 'import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title("cage")\nplt.show()',
        })
        const imgs = r.content.filter((x) => x.type === 'image')
        assert.equal(imgs.length, 1, `one image: ${JSON.stringify(r.content).slice(0, 400)}`)
        assert.equal(imgs[0].mimeType, 'image/png')
        const png = Buffer.from(imgs[0].data, 'base64')
        assert.deepEqual([...png.subarray(0, 8)], [137, 80, 78, 71, 13, 10, 26, 10], 'a PNG')
        assert.ok(png.length > 1000, `a real plot: ${png.length} bytes`)
        assert.equal(r.structuredContent.images, 1)
        assert.ok(r.structuredContent.results.some((x) => x.formats.includes('png')))
        // An exception is reported with its name; output over the bound is cut.
        r = await ok(c, 'run_code', { sandbox_id: id, code: '1/0' })
        assert.equal(r.structuredContent.error.name, 'ZeroDivisionError')
        r = await ok(c, 'run_code', { sandbox_id: id, code: 'print("y" * 3_000_000)', max_output_bytes: 2048 })
        assert.equal(r.structuredContent.truncated, true)
        assert.ok(r.structuredContent.stdout.length < 2048 + 300)
        assert.match(r.structuredContent.stdout, /left out here/)
        // JavaScript too.
        r = await ok(c, 'run_code', { sandbox_id: id, code: '[1, 2, 3].map((n) => n * 2).join(",")', language: 'javascript' })
        assert.equal(r.structuredContent.results.find((x) => x.is_main)?.text, '2,4,6')
      })
      if (transport !== 'http') return
      // A sandbox whose ports are not public: run_code sends its traffic token too.
      const res = await fetch(`${API}/v2/sandboxes`, {
        method: 'POST', headers: { 'X-API-Key': KEY, 'Content-Type': 'application/json' },
        body: JSON.stringify({ templateID: 'code-interpreter-v1', timeout: 120, network: { allowPublicTraffic: false } }),
      })
      assert.equal(res.status, 201)
      const sb = await res.json()
      try {
        const r = await ok(c, 'run_code', { sandbox_id: sb.sandboxID, code: '2 ** 10' })
        assert.equal(r.structuredContent.results.find((x) => x.is_main)?.text, '1024')
      } finally {
        await ok(c, 'sandbox_kill', { sandbox_id: sb.sandboxID })
      }
    })

    test('run_code on a sandbox without the code interpreter is a clear tool error', T, async () => {
      await withSandbox(c, {}, async (id) => {
        const msg = await fails(c, 'run_code', { sandbox_id: id, code: 'print(1)' })
        assert.match(msg, /has no code interpreter/)
        assert.match(msg, /code-interpreter-v1/)
      })
    })

    test('port_url: a server inside answers at the URL through the proxy', T, async () => {
      await withSandbox(c, {}, async (id) => {
        const bg = (await ok(c, 'exec', {
          sandbox_id: id,
          command: 'cd /tmp && echo "served over mcp" > index.html && exec python3 -m http.server 8000 --bind 127.0.0.1',
          background: true,
        })).structuredContent
        assert.ok(bg.pid > 0, `background gives a pid: ${JSON.stringify(bg)}`)
        const p = (await ok(c, 'port_url', { sandbox_id: id, port: 8000 })).structuredContent
        assert.equal(p.public, true)
        assert.equal(new URL(p.url).hostname, `8000-${id}.localhost`)
        assert.equal(p.proxy, PROXY)
        const viaHost = await until(async () => {
          const r = await viaProxy(p.proxy + '/', { host: new URL(p.url).host })
          return { ok: r.status === 200, ...r }
        }, 20_000, `GET ${p.url}`)
        assert.equal(viaHost.body, 'served over mcp\n')
        const viaHeaders = await viaProxy(p.proxy + '/', { headers: p.headers })
        assert.equal(viaHeaders.status, 200)
        assert.equal(viaHeaders.body, 'served over mcp\n')
        await fails(c, 'port_url', { sandbox_id: id, port: 70000 })
      })
    })

    test('port_url of a sandbox whose ports are not public carries its traffic token', T, async () => {
      // Made through the API: sandbox_create leaves E2B's default (public).
      const res = await fetch(`${API}/v2/sandboxes`, {
        method: 'POST', headers: { 'X-API-Key': KEY, 'Content-Type': 'application/json' },
        body: JSON.stringify({ templateID: 'host', timeout: 120, network: { allowPublicTraffic: false } }),
      })
      assert.equal(res.status, 201)
      const sb = await res.json()
      try {
        await ok(c, 'exec', { sandbox_id: sb.sandboxID, command: 'cd /tmp && echo private > index.html && exec python3 -m http.server 8001 --bind 127.0.0.1', background: true })
        const p = (await ok(c, 'port_url', { sandbox_id: sb.sandboxID, port: 8001 })).structuredContent
        assert.equal(p.public, false)
        assert.equal(p.headers['E2b-Traffic-Access-Token'], sb.trafficAccessToken)
        const r = await until(async () => {
          const r = await viaProxy(p.proxy + '/', { headers: p.headers })
          return { ok: r.status === 200, ...r }
        }, 20_000, 'the private port with its token')
        assert.equal(r.body, 'private\n')
        const bare = await viaProxy(p.proxy + '/', { host: new URL(p.url).host })
        assert.notEqual(bare.status, 200, 'without the token the port does not answer')
      } finally {
        await ok(c, 'sandbox_kill', { sandbox_id: sb.sandboxID })
      }
    })

    test("another key's sandbox is not found, whatever the tool", T, async () => {
      const b = await connect(transport, OTHER)
      try {
        await withSandbox(c, {}, async (id) => {
          const ghost = 'zz' + id.slice(2)
          const norm = (s, x) => s.replaceAll(x, 'ID')
          const calls = [
            ['exec', { command: 'true' }], ['file_read', { path: '/etc/hostname' }], ['file_write', { path: 'x', content: 'x' }],
            ['file_list', { path: '/' }], ['port_url', { port: 8000 }], ['sandbox_pause', {}], ['sandbox_resume', {}],
            ['sandbox_kill', {}], ['run_code', { code: '1' }],
          ]
          for (const [name, args] of calls) {
            const theirs = await fails(b, name, { sandbox_id: id, ...args })
            const none = await fails(b, name, { sandbox_id: ghost, ...args })
            assert.match(theirs, /not found/, `${name} on another key's sandbox`)
            assert.equal(norm(theirs, id), norm(none, ghost), `${name}: another key's sandbox reads as one that never existed`)
          }
          const listed = (await ok(b, 'sandbox_list', { state: 'all' })).structuredContent
          assert.ok(!listed.sandboxes.some((s) => s.sandbox_id === id), 'the other key does not list it')
          const r = (await ok(c, 'exec', { sandbox_id: id, command: 'echo still here' })).structuredContent
          assert.equal(r.stdout, 'still here\n', 'the owner still has it, running')
        })
      } finally {
        await b.close()
      }
    })

    test('paths that reach for the host stay inside the sandbox, as the agent confines them', T, async () => {
      const secret = fs.readFileSync(SECRET, 'utf8')
      const dir = path.dirname(SECRET)
      await withSandbox(c, {}, async (id) => {
        const reach = [`../../../../../../../..${SECRET}`, SECRET, `/proc/1/root${SECRET}`, `/proc/self/root${SECRET}`, 'host-link', 'proc-link']
        await ok(c, 'exec', { sandbox_id: id, command: `ln -s ${SECRET} ~/host-link; ln -s /proc/1/root${SECRET} ~/proc-link` })
        for (const p of reach) {
          const r = await c.callTool({ name: 'file_read', arguments: { sandbox_id: id, path: p } })
          assert.ok(!textOf(r).includes(secret.trim()), `file_read ${p} must not return the host's file: ${textOf(r).slice(0, 200)}`)
          assert.equal(r.isError, true, `file_read ${p}: the sandbox has no such file`)
        }
        const w = (await ok(c, 'file_write', { sandbox_id: id, path: `../../../../../../..${dir}/planted.txt`, content: 'planted' })).structuredContent
        assert.equal(w.path, `${dir}/planted.txt`, 'the path is resolved in the sandbox')
        await ok(c, 'exec', { sandbox_id: id, command: `ln -s ${dir} ~/host-dir` })
        const r = await c.callTool({ name: 'file_write', arguments: { sandbox_id: id, path: 'host-dir/through-link.txt', content: 'planted' } })
        assert.ok(!fs.existsSync(path.join(dir, 'planted.txt')), 'nothing written on the host by a path with ..')
        assert.ok(!fs.existsSync(path.join(dir, 'through-link.txt')), `nothing written on the host through a link (${textOf(r)})`)
        const inside = (await ok(c, 'exec', { sandbox_id: id, command: `cat ${dir}/planted.txt` })).structuredContent
        assert.equal(inside.stdout, 'planted', 'it landed in the sandbox instead')
        const ls = (await ok(c, 'file_list', { sandbox_id: id, path: dir })).structuredContent
        assert.ok(!ls.entries.some((e) => e.name === path.basename(SECRET)), 'file_list of the directory shows the sandbox, not the host')
      })
    })

    test('bad input is a tool error naming the problem, never a protocol error', T, async () => {
      assert.match(await fails(c, 'exec', { sandbox_id: 'NOT AN ID', command: 'true' }), /sandbox_id/)
      assert.match(await fails(c, 'exec', { sandbox_id: 'abc' }), /command/)
      assert.match(await fails(c, 'exec', { sandbox_id: 'abc', command: 'true', timeout_s: 99999 }), /timeout_s/)
      assert.match(await fails(c, 'file_write', { sandbox_id: 'abc', path: 'x', content: '!!', encoding: 'base64' }), /base64/)
      assert.match(await fails(c, 'run_code', { sandbox_id: 'abc', code: '1', language: 'cobol' }), /language/)
      assert.match(await fails(c, 'sandbox_create', { template: 'no-such-template-here' }), /template/)
      assert.match(await fails(c, 'exec', { sandbox_id: 'abc', command: 'true', extra: 1 }), /extra|additional/)
    })
  })
}

test("the audit trail has /mcp's requests (the caller's address, the key) and the API calls its tools made", T, async () => {
  const entries = []
  for (let next = '', pages = 0; pages < 50; pages++) {
    const res = await fetch(`${API}/audit?kind=api&limit=1000${next ? `&nextToken=${next}` : ''}`, { headers: { 'X-API-Key': KEY } })
    assert.equal(res.status, 200)
    const page = await res.json()
    entries.push(...page.entries)
    if (!page.nextToken) break
    next = page.nextToken
  }
  const mcp = entries.filter((e) => e.route === 'POST /mcp')
  assert.ok(mcp.length > 10, `POST /mcp entries: ${mcp.length}`)
  // 200 for requests, 202 for notifications (notifications/initialized).
  const odd = mcp.filter((e) => !e.keyID || e.client !== '127.0.0.1' || ![200, 202].includes(e.status))
  assert.deepEqual(odd, [], 'every /mcp entry has the key, the caller and the status')
  assert.ok(mcp.some((e) => e.status === 200))
  assert.ok(entries.some((e) => e.route === 'POST /v2/sandboxes' && e.status === 201), 'sandbox_create went through the API')
})

test('a wrong key: over stdio every tool call is a tool error; over HTTP the connection is refused with 401', T, async () => {
  const wrong = 'e2b_' + '0'.repeat(40)
  const s = await connect('stdio', wrong)
  try {
    assert.match(await fails(s, 'sandbox_list', {}), /refused the API key/)
    assert.match(await fails(s, 'sandbox_create', {}), /refused the API key/)
  } finally {
    await s.close()
  }
  await assert.rejects(connect('http', wrong), (err) => /401|invalid API key/.test(String(err)), 'HTTP with a wrong key')
})

/** A raw POST /mcp on a connection of its own: status and body. */
function rawPost(pathAndQuery, headers, body) {
  return new Promise((resolve, reject) => {
    const u = new URL(API)
    const req = http.request({ host: u.hostname, port: u.port, method: 'POST', path: pathAndQuery, agent: false,
      headers: { 'Content-Type': 'application/json', Accept: 'application/json, text/event-stream', ...headers } }, (res) => {
      let text = ''
      res.on('data', (d) => (text += d))
      res.on('end', () => resolve({ status: res.statusCode, text }))
    })
    req.on('error', reject)
    req.end(body)
  })
}

const initialize = JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'initialize', params: { protocolVersion: '2025-06-18', capabilities: {}, clientInfo: { name: 'raw', version: '1' } } })

test('HTTP: a key in the URL is refused, even beside a good key in the header', T, async () => {
  for (const q of [`?api_key=${KEY}`, `?key=${KEY}`, `?token=${KEY}`, `?x=${KEY}`]) {
    const r = await rawPost(`/mcp${q}`, { Authorization: `Bearer ${KEY}` }, initialize)
    assert.equal(r.status, 400, `POST /mcp${q.replace(KEY, 'KEY')}: ${r.text}`)
    assert.match(r.text, /never in a URL/)
    assert.ok(!r.text.includes(KEY), 'the answer does not echo the key')
  }
  const r = await rawPost('/mcp', { 'X-API-Key': KEY }, initialize)
  assert.equal(r.status, 200, `the same request with the key in X-API-Key only: ${r.text}`)
  assert.match(r.text, /"serverInfo"/)
})

/**
 * Sends the headers of a POST /mcp that announces a 1 GiB body and 10 bytes
 * of it, and reports the status line if an answer comes within ms (null if none).
 */
function announceHugeBody(headers, ms) {
  return new Promise((resolve, reject) => {
    const u = new URL(API)
    const sock = net.connect({ host: u.hostname, port: Number(u.port) }, () => {
      const lines = [`POST /mcp HTTP/1.1`, `Host: ${u.host}`, 'Content-Type: application/json', 'Accept: application/json, text/event-stream',
        'Content-Length: 1073741824', ...Object.entries(headers).map(([k, v]) => `${k}: ${v}`)]
      sock.write(lines.join('\r\n') + '\r\n\r\n{"jsonrpc"')
    })
    let got = ''
    const timer = setTimeout(() => { sock.destroy(); resolve(null) }, ms)
    sock.on('data', (d) => {
      got += d
      if (got.includes('\r\n')) { clearTimeout(timer); sock.destroy(); resolve(got.split('\r\n')[0]) }
    })
    sock.on('error', (err) => { clearTimeout(timer); reject(err) })
  })
}

test('HTTP: the key is checked before the body: a wrong or missing key is answered without waiting for it', T, async () => {
  assert.match(await announceHugeBody({ Authorization: 'Bearer e2b_' + '1'.repeat(40) }, 5000) ?? 'no answer', / 401 /, 'a wrong bearer key')
  assert.match(await announceHugeBody({ 'X-API-Key': 'e2b_' + '2'.repeat(40) }, 5000) ?? 'no answer', / 401 /, 'a wrong X-API-Key')
  assert.match(await announceHugeBody({}, 5000) ?? 'no answer', / 401 /, 'no key')
  // With the right key the server waits for the body it was promised, and a body over 8 MiB is refused.
  assert.equal(await announceHugeBody({ 'X-API-Key': KEY }, 1000), null, 'with the right key it reads on')
})
