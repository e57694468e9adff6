// The real E2B JS SDK against cage serve. e2b_test.go starts the daemon and
// runs this file once per SDK version, the version named by E2B_SDK_MODULE
// ("e2b" is 2.51.0, "e2b-246" is 2.46.1, which still creates with
// POST /sandboxes where 2.51 uses POST /v2/sandboxes). Every test makes its
// own sandboxes and kills them in a finally.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'

import { moduleName, sdk, sdkVersion, TEMPLATE, withSandbox, waitFor, errText } from './helpers.mjs'

const { Sandbox, CommandExitError, FilesystemEventType, FileType, NotFoundError } = sdk

console.log(`# E2B SDK ${moduleName} ${sdkVersion}, API ${process.env.E2B_API_URL}, sandboxes ${process.env.E2B_SANDBOX_URL}`)

const T = { timeout: 60_000 }
const HOME = '/home/user'
const enc = new TextEncoder()

test('create returns a sandbox id of [a-z0-9]', T, async () => {
  await withSandbox({}, async (sbx) => {
    assert.match(sbx.sandboxId, /^[a-z0-9]+$/)
    assert.equal(await sbx.isRunning(), true, 'isRunning() right after create')
  })
})

test('commands.run: stdout, stderr and exit code 0', T, async () => {
  await withSandbox({}, async (sbx) => {
    const r = await sbx.commands.run('echo hello; echo oops >&2; whoami')
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'hello\nuser\n', 'stdout (the default user is "user")')
    assert.equal(r.stderr, 'oops\n')
  })
})

test('commands.run: envs reach the command', T, async () => {
  await withSandbox({}, async (sbx) => {
    const r = await sbx.commands.run('printf "%s|%s" "$CMD_ONLY" "$WITH_SPACE"', {
      envs: { CMD_ONLY: 'from-cmd', WITH_SPACE: 'a b  c' },
    })
    assert.equal(r.stdout, 'from-cmd|a b  c')
  })
})

test('Sandbox.create envs reach commands, and command envs override them', T, async () => {
  await withSandbox({ envs: { SBX_ONLY: 'from-sandbox', SHARED: 'sandbox' } }, async (sbx) => {
    const r = await sbx.commands.run('printf "%s|%s|%s" "$SBX_ONLY" "$CMD_ONLY" "$SHARED"', {
      envs: { CMD_ONLY: 'from-cmd', SHARED: 'cmd' },
    })
    assert.equal(r.stdout, 'from-sandbox|from-cmd|cmd')
  })
})

test('commands.run: cwd (default is the home of user)', T, async () => {
  await withSandbox({}, async (sbx) => {
    assert.equal((await sbx.commands.run('pwd')).stdout, `${HOME}\n`, 'default cwd')
    assert.equal((await sbx.commands.run('pwd', { cwd: '/tmp' })).stdout, '/tmp\n', 'cwd: /tmp')
  })
})

test('commands.run: onStdout/onStderr stream chunks while the command runs', T, async () => {
  await withSandbox({}, async (sbx) => {
    const out = []
    const err = []
    const start = Date.now()
    const r = await sbx.commands.run(
      'for i in 1 2 3 4 5; do echo out$i; echo err$i >&2; sleep 0.6; done',
      {
        onStdout: (d) => out.push({ d, at: Date.now() - start }),
        onStderr: (d) => err.push({ d, at: Date.now() - start }),
      },
    )
    const end = Date.now() - start
    assert.equal(r.stdout, 'out1\nout2\nout3\nout4\nout5\n')
    assert.equal(r.stderr, 'err1\nerr2\nerr3\nerr4\nerr5\n')
    assert.equal(out.map((c) => c.d).join(''), r.stdout, 'onStdout chunks add up to stdout')
    assert.equal(err.map((c) => c.d).join(''), r.stderr, 'onStderr chunks add up to stderr')
    // The command runs ~3 s; the first line must arrive about when it is
    // printed, not when the command ends.
    const timeline = `stdout chunks at ${out.map((c) => c.at)} ms, stderr at ${err.map((c) => c.at)} ms, run returned at ${end} ms`
    assert.ok(out.length >= 2 && err.length >= 2, `output arrived in several chunks: ${timeline}`)
    assert.ok(out[0].at < end - 1500, `first stdout chunk arrived while the command ran: ${timeline}`)
    assert.ok(err[0].at < end - 1500, `first stderr chunk arrived while the command ran: ${timeline}`)
  })
})

test('commands.run: non-zero exit throws CommandExitError', T, async () => {
  await withSandbox({}, async (sbx) => {
    await assert.rejects(sbx.commands.run('echo partial; echo bad >&2; exit 3'), (e) => {
      assert.ok(e instanceof CommandExitError, `want CommandExitError, got ${errText(e)}`)
      assert.equal(e.exitCode, 3)
      assert.equal(e.stdout, 'partial\n')
      assert.equal(e.stderr, 'bad\n')
      return true
    })
  })
})

test('commands.run: background command, then wait()', T, async () => {
  await withSandbox({}, async (sbx) => {
    const h = await sbx.commands.run('sleep 1; echo done', { background: true })
    assert.equal(typeof h.pid, 'number')
    const listed = await sbx.commands.list()
    assert.ok(listed.some((p) => p.pid === h.pid), `commands.list() shows pid ${h.pid}: ${JSON.stringify(listed)}`)
    const r = await h.wait()
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'done\n')
    assert.equal(h.exitCode, 0)
  })
})

test('commands: kill() a background command', T, async () => {
  await withSandbox({}, async (sbx) => {
    const h = await sbx.commands.run('echo started; sleep 30', { background: true })
    await waitFor(() => h.stdout.includes('started'), 10_000, () => `"started" on stdout, have ${JSON.stringify(h.stdout)}`)
    const start = Date.now()
    assert.equal(await h.kill(), true, 'kill() returns true for a running command')
    await assert.rejects(h.wait(), (e) => {
      assert.ok(e instanceof CommandExitError, `want CommandExitError, got ${errText(e)}`)
      assert.notEqual(e.exitCode, 0)
      // envd reports a signal death as exit -1 with error "signal: killed";
      // a shell-style 137 also says SIGKILL.
      assert.ok(
        /signal|kill/i.test(e.error ?? '') || e.exitCode === -1 || e.exitCode === 137,
        `ended by a signal: exitCode ${e.exitCode}, error ${JSON.stringify(e.error)}`,
      )
      return true
    })
    assert.ok(Date.now() - start < 10_000, 'wait() ended soon after kill()')
    assert.equal(await sbx.commands.kill(h.pid), false, 'killing it again finds no process')
  })
})

test('files: write/read text and bytes, list, exists, makeDir, rename, remove', T, async () => {
  await withSandbox({}, async (sbx) => {
    const dir = `${HOME}/ftest`
    // write creates the missing parent directories
    const w = await sbx.files.write(`${dir}/sub/a.txt`, 'hello files\n')
    assert.equal(w.path, `${dir}/sub/a.txt`)
    assert.equal(w.name, 'a.txt')
    assert.equal(await sbx.files.read(`${dir}/sub/a.txt`), 'hello files\n')
    // the file is the default user's, as a command sees it
    assert.equal((await sbx.commands.run(`stat -c %U ${dir}/sub/a.txt`)).stdout, 'user\n', 'owner of a written file')

    const bytes = new Uint8Array(256)
    for (let i = 0; i < 256; i++) bytes[i] = i
    await sbx.files.write(`${dir}/bin.dat`, bytes.buffer)
    const back = await sbx.files.read(`${dir}/bin.dat`, { format: 'bytes' })
    assert.ok(back instanceof Uint8Array, 'format: bytes gives a Uint8Array')
    assert.deepEqual(Array.from(back), Array.from(bytes), 'bytes round-trip')

    const entries = await sbx.files.list(dir)
    const byName = Object.fromEntries(entries.map((e) => [e.name, e]))
    assert.deepEqual(Object.keys(byName).sort(), ['bin.dat', 'sub'], `list(${dir})`)
    assert.equal(byName['bin.dat'].type, FileType.FILE)
    assert.equal(byName['bin.dat'].path, `${dir}/bin.dat`)
    assert.equal(byName['bin.dat'].size, 256)
    assert.equal(byName.sub.type, FileType.DIR)

    assert.equal(await sbx.files.exists(`${dir}/sub/a.txt`), true)
    assert.equal(await sbx.files.exists(`${dir}/nope`), false)

    assert.equal(await sbx.files.makeDir(`${dir}/made/deep`), true, 'makeDir of a new directory')
    assert.equal(await sbx.files.makeDir(`${dir}/made/deep`), false, 'makeDir of an existing directory')
    assert.equal((await sbx.commands.run(`test -d ${dir}/made/deep && echo yes`)).stdout, 'yes\n')

    const moved = await sbx.files.rename(`${dir}/sub/a.txt`, `${dir}/b.txt`)
    assert.equal(moved.path, `${dir}/b.txt`)
    assert.equal(moved.name, 'b.txt')
    assert.equal(await sbx.files.exists(`${dir}/sub/a.txt`), false, 'old name is gone after rename')
    assert.equal(await sbx.files.read(`${dir}/b.txt`), 'hello files\n')

    await sbx.files.remove(`${dir}/b.txt`)
    assert.equal(await sbx.files.exists(`${dir}/b.txt`), false, 'removed file')
    await sbx.files.remove(`${dir}/made`)
    assert.equal(await sbx.files.exists(`${dir}/made`), false, 'removed directory tree')

    await assert.rejects(sbx.files.read(`${dir}/nope`), (e) => {
      assert.ok(e instanceof NotFoundError, `reading a missing file: want NotFoundError, got ${errText(e)}`)
      return true
    })
  })
})

test('files.watchDir sees a file created after the watch starts', T, async () => {
  await withSandbox({}, async (sbx) => {
    const dir = `${HOME}/watched`
    assert.equal(await sbx.files.makeDir(dir), true)
    const events = []
    let exited = null
    const handle = await sbx.files.watchDir(
      dir,
      (ev) => {
        events.push(ev)
      },
      { onExit: (err) => (exited = { err: err ? errText(err) : null }) },
    )
    try {
      await sbx.files.write(`${dir}/new.txt`, 'x')
      const want = [FilesystemEventType.CREATE, FilesystemEventType.WRITE]
      await waitFor(
        () => events.some((ev) => ev.name === 'new.txt' && want.includes(ev.type)),
        10_000,
        () =>
          `a create/write event for new.txt, have ${JSON.stringify(events)}` +
          (exited ? `; the watch stream ended early: ${exited.err ?? 'without an error'}` : ''),
      )
    } finally {
      await handle.stop()
    }
  })
})

test('getInfo: id, template, dates, metadata', T, async () => {
  const metadata = { owner: 'e2b-test', n: '1' }
  const before = Date.now()
  await withSandbox({ timeoutMs: 120_000, metadata }, async (sbx) => {
    const info = await sbx.getInfo()
    assert.equal(info.sandboxId, sbx.sandboxId)
    assert.ok(info.templateId, 'templateId is set')
    assert.ok(info.templateId === TEMPLATE || info.name === TEMPLATE, `templateId ${info.templateId} or name ${info.name} is "${TEMPLATE}"`)
    assert.deepEqual(info.metadata, metadata)
    assert.equal(info.state, 'running')
    assert.ok(info.startedAt instanceof Date && !isNaN(info.startedAt), `startedAt is a date: ${info.startedAt}`)
    assert.ok(info.endAt instanceof Date && !isNaN(info.endAt), `endAt is a date: ${info.endAt}`)
    assert.ok(Math.abs(info.startedAt - before) < 30_000, `startedAt ${info.startedAt.toISOString()} is about now`)
    const life = info.endAt - info.startedAt
    assert.ok(Math.abs(life - 120_000) < 5_000, `endAt - startedAt = ${life} ms, want ~120000 (timeoutMs)`)
    // the static form answers the same
    const again = await Sandbox.getInfo(sbx.sandboxId)
    assert.equal(again.sandboxId, sbx.sandboxId)
  })
})

test('setTimeout moves endAt', T, async () => {
  await withSandbox({ timeoutMs: 60_000 }, async (sbx) => {
    const first = (await sbx.getInfo()).endAt
    const asked = Date.now()
    await sbx.setTimeout(600_000)
    const second = (await sbx.getInfo()).endAt
    assert.ok(second > first, `endAt moved later: ${first.toISOString()} -> ${second.toISOString()}`)
    assert.ok(Math.abs(second - (asked + 600_000)) < 5_000, `endAt ${second.toISOString()} is ~600 s from the call`)
    await sbx.setTimeout(30_000)
    const third = (await sbx.getInfo()).endAt
    assert.ok(third < second, `endAt moved earlier: ${second.toISOString()} -> ${third.toISOString()}`)
  })
})

test('Sandbox.list: metadata filter and pagination', { timeout: 90_000 }, async () => {
  const suite = randomBytes(6).toString('hex')
  const made = []
  try {
    for (const kind of ['a', 'a', 'b']) {
      made.push(await Sandbox.create(TEMPLATE, { timeoutMs: 120_000, metadata: { suite, kind } }))
    }
    const [a1, a2, b1] = made.map((s) => s.sandboxId)

    // filter: both keys must match
    const all = []
    const p = Sandbox.list({ query: { metadata: { suite, kind: 'a' } } })
    for (let i = 0; p.hasNext && i < 10; i++) all.push(...(await p.nextItems()))
    assert.deepEqual(all.map((s) => s.sandboxId).sort(), [a1, a2].sort(), `filter {suite, kind: a}`)
    for (const s of all) {
      assert.deepEqual(s.metadata, { suite, kind: 'a' })
      assert.equal(s.state, 'running')
      assert.ok(s.startedAt instanceof Date && !isNaN(s.startedAt), 'list item startedAt')
    }

    // pagination: one per page, every id exactly once
    const seen = []
    const pages = Sandbox.list({ query: { metadata: { suite } }, limit: 1 })
    let n = 0
    while (pages.hasNext) {
      assert.ok(++n <= 10, `more than 10 pages for 3 sandboxes: seen ${seen}`)
      const items = await pages.nextItems()
      assert.ok(items.length <= 1, `page ${n} has ${items.length} items with limit 1`)
      seen.push(...items.map((s) => s.sandboxId))
    }
    assert.ok(n >= 3, `3 sandboxes at limit 1 take at least 3 pages, took ${n}`)
    assert.equal(new Set(seen).size, seen.length, `no id twice across pages: ${seen}`)
    assert.deepEqual(seen.sort(), [a1, a2, b1].sort())
  } finally {
    await Promise.all(made.map((s) => s.kill().catch((e) => console.error(`# kill ${s.sandboxId}: ${e}`))))
  }
})

test('Sandbox.connect(id) gives a working handle', T, async () => {
  await withSandbox({}, async (sbx) => {
    await sbx.files.write(`${HOME}/marker`, 'from-first-handle')
    const again = await Sandbox.connect(sbx.sandboxId)
    assert.equal(again.sandboxId, sbx.sandboxId)
    const r = await again.commands.run('cat ~/marker; echo; echo via-connect')
    assert.equal(r.stdout, 'from-first-handle\nvia-connect\n')
  })
})

test('kill: the sandbox leaves the list and its commands fail', T, async () => {
  await withSandbox({}, async (sbx) => {
    const id = sbx.sandboxId
    assert.equal((await sbx.commands.run('echo alive')).stdout, 'alive\n')
    assert.equal(await sbx.kill(), true, 'kill() of a running sandbox')

    const left = []
    const p = Sandbox.list()
    for (let i = 0; p.hasNext && i < 50; i++) left.push(...(await p.nextItems()))
    assert.ok(!left.some((s) => s.sandboxId === id), `killed ${id} still listed: ${left.map((s) => s.sandboxId)}`)

    await assert.rejects(sbx.commands.run('echo still-here', { requestTimeoutMs: 10_000 }), (e) => {
      console.log(`# command on a killed sandbox: ${errText(e)}`)
      return true
    })
    assert.equal(await sbx.isRunning(), false, 'isRunning() after kill')
    await assert.rejects(Sandbox.getInfo(id), (e) => {
      assert.ok(e instanceof NotFoundError, `getInfo of a killed sandbox: want NotFoundError, got ${errText(e)}`)
      return true
    })
    assert.equal(await Sandbox.kill(id), false, 'a second kill finds nothing')
  })
})

test('pty: create, input, resize, kill', T, async () => {
  await withSandbox({}, async (sbx) => {
    const dec = new TextDecoder()
    let out = ''
    const h = await sbx.pty.create({
      cols: 80,
      rows: 24,
      onData: (d) => {
        out += dec.decode(d, { stream: true })
      },
    })
    const seen = () => `pty output so far: ${JSON.stringify(out)}`
    try {
      assert.equal(typeof h.pid, 'number')
      await sbx.pty.sendInput(h.pid, enc.encode('echo hi-$((6*7))\n'))
      await waitFor(() => out.includes('hi-42'), 10_000, seen)

      let mark = out.length
      await sbx.pty.sendInput(h.pid, enc.encode('stty size\n'))
      await waitFor(() => out.slice(mark).includes('24 80'), 10_000, () => `"24 80" from stty size; ${seen()}`)

      await sbx.pty.resize(h.pid, { cols: 100, rows: 30 })
      mark = out.length
      await sbx.pty.sendInput(h.pid, enc.encode('stty size\n'))
      await waitFor(() => out.slice(mark).includes('30 100'), 10_000, () => `"30 100" after resize; ${seen()}`)
    } catch (e) {
      await sbx.pty.kill(h.pid).catch(() => {})
      throw e
    }
    assert.equal(await sbx.pty.kill(h.pid), true, 'pty.kill() of a live PTY')
    await assert.rejects(h.wait(), (e) => {
      assert.ok(e instanceof CommandExitError, `wait() on a killed PTY: want CommandExitError, got ${errText(e)}`)
      return true
    })
  })
})

// --- network: the test world (testutil.World) is the sandboxes' outside ---

const PUBLIC = process.env.CAGE_TEST_PUBLIC_HOST
const OTHER = process.env.CAGE_TEST_OTHER_HOST
const fetchCmd = (url) =>
  `python3 -c 'import urllib.request, sys
try: print("OK:" + urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())
except Exception as ex: print("FAIL:" + type(ex).__name__)' ${url}`

test('network: the internet by default; updateNetwork to an allowlist; getInfo shows it', T, async () => {
  await withSandbox({}, async (sbx) => {
    const get = async (url) => (await sbx.commands.run(fetchCmd(url))).stdout.trim()
    assert.equal(await get('http://other.example.org/'), `OK:other ${OTHER}`, 'a public name, by default')
    assert.match(await get('http://169.254.169.254/'), /^FAIL/, 'cloud metadata, always denied')
    await sbx.updateNetwork({ allowOut: ['allowed.example.com'], denyOut: ['0.0.0.0/0'] })
    assert.equal(await get('http://allowed.example.com/'), `OK:public ${PUBLIC}`, 'the allowed name after the update')
    assert.match(await get('http://other.example.org/'), /^FAIL/, 'a name not allowed after the update')
    assert.match(await get(`http://${OTHER}/`), /^FAIL/, 'an address not allowed after the update')
    const info = await sbx.getInfo()
    assert.deepEqual(info.network?.allowOut, ['allowed.example.com'])
    assert.deepEqual(info.network?.denyOut, ['0.0.0.0/0'])
    assert.equal(info.allowInternetAccess, false)
  })
})

test('network: allowInternetAccess false with network.allowOut on create', T, async () => {
  await withSandbox({ allowInternetAccess: false, network: { allowOut: ['allowed.example.com'] } }, async (sbx) => {
    const get = async (url) => (await sbx.commands.run(fetchCmd(url))).stdout.trim()
    assert.equal(await get('http://allowed.example.com/'), `OK:public ${PUBLIC}`)
    assert.match(await get('http://other.example.org/'), /^FAIL/)
  })
})

test('getHost: a server inside answers at {port}-{id}.{domain} through the proxy', T, async () => {
  await withSandbox({}, async (sbx) => {
    await sbx.commands.run('cd /tmp && echo "served from the sandbox" > index.html && python3 -m http.server 8000 --bind 127.0.0.1', {
      background: true,
    })
    const proxy = new URL(process.env.E2B_SANDBOX_URL)
    const host = sbx.getHost(8000)
    assert.match(host, new RegExp(`^8000-${sbx.sandboxId}\\.`))
    const { request } = await import('node:http')
    const fetchVia = () =>
      new Promise((resolve, reject) => {
        const req = request({ host: proxy.hostname, port: proxy.port, path: '/', headers: { Host: host } }, (res) => {
          let body = ''
          res.on('data', (d) => (body += d))
          res.on('end', () => resolve({ status: res.statusCode, body }))
        })
        req.on('error', reject)
        req.end()
      })
    let last
    await waitFor(async () => {
      last = await fetchVia()
      return last.status === 200
    }, 20_000, () => `the server at ${host}: ${JSON.stringify(last)}`)
    assert.equal(last.body, 'served from the sandbox\n')
  })
})

test('an image template: Sandbox.create(name) runs in the image, writes stay its own', T, async () => {
  const sbx = await Sandbox.create('cage-test', { timeoutMs: 120_000 })
  try {
    const r = await sbx.commands.run('head -1 /etc/os-release; id -un; echo $CAGE_TEST_IMAGE')
    assert.equal(r.stdout, 'ID=cage-test\nuser\n1\n')
    await sbx.files.write('/home/user/note.txt', 'mine')
    assert.equal(await sbx.files.read('/home/user/note.txt'), 'mine')
    const info = await sbx.getInfo()
    assert.equal(info.templateId, 'cage-test')
    const other = await Sandbox.create('cage-test', { timeoutMs: 120_000 })
    try {
      assert.equal(await other.files.exists('/home/user/note.txt'), false)
    } finally {
      await other.kill()
    }
  } finally {
    await sbx.kill()
  }
})

test('the base template: python3 -c and node -e, as user, through the SDK', { timeout: 120_000, skip: process.env.CAGE_TEST_BASE !== '1' && 'no base template (scripts/test.sh builds it)' }, async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 120_000 })
  try {
    const py = await sbx.commands.run('python3 -c "import sys; print(6*7, sys.version_info.major)"')
    assert.equal(py.stdout, '42 3\n')
    const node = await sbx.commands.run('node -e "console.log(6*7)"')
    assert.equal(node.stdout, '42\n')
    const who = await sbx.commands.run('whoami; pwd; git --version | cut -d" " -f1-2')
    assert.equal(who.stdout, 'user\n/home/user\ngit version\n')
  } finally {
    await sbx.kill()
  }
})
