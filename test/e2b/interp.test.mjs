// The real @e2b/code-interpreter (2.8.0) against cage serve and the
// code-interpreter-v1 template: interp_test.go starts the daemon (on one
// wall each run) and runs this file. Every test makes its own sandboxes
// and kills them in a finally.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import { inflateSync } from 'node:zlib'

import { errText } from './helpers.mjs'

const { Sandbox } = await import('@e2b/code-interpreter')
const { TimeoutError, NotFoundError, SandboxError, InvalidArgumentError } = await import('e2b')

const T = { timeout: 180_000 }
const POOLED = process.env.CAGE_TEST_POOLED === '1'
const PUBLIC = process.env.CAGE_TEST_PUBLIC_HOST

console.log(`# @e2b/code-interpreter against ${process.env.E2B_API_URL} (wall ${process.env.CAGE_TEST_WALL}${POOLED ? ', pooled' : ''})`)

/** Creates a code interpreter sandbox (code-interpreter-v1), runs fn, always kills it. */
async function withInterp(opts, fn) {
  const sbx = await Sandbox.create({ timeoutMs: 300_000, ...opts })
  try {
    return await fn(sbx)
  } catch (err) {
    console.log(`# failed in sandbox ${sbx.sandboxId}: ${errText(err)}`)
    throw err
  } finally {
    await sbx.kill().catch((err) => console.error(`# kill ${sbx.sandboxId}: ${err}`))
  }
}

/**
 * A raw request to the sandbox's port 49999 through cage's proxy, on a
 * connection of its own (a refused large body closes its connection):
 * its status and body.
 */
function raw(sbx, path, { method = 'POST', body, token, traffic } = {}) {
  const headers = { 'Content-Type': 'application/json', 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49999' }
  if (token !== undefined) headers['X-Access-Token'] = token
  if (traffic !== undefined) headers['E2B-Traffic-Access-Token'] = traffic
  return new Promise((resolve, reject) => {
    let answered = false
    const req = http.request(`${process.env.E2B_SANDBOX_URL}${path}`, { method, headers, agent: false }, (res) => {
      answered = true
      const chunks = []
      res.on('data', (c) => chunks.push(c))
      res.on('end', () => resolve({ status: res.statusCode, text: Buffer.concat(chunks).toString() }))
      res.on('error', reject)
    })
    // A server may answer (413) and close before it has read all of a
    // large body: the answer counts.
    req.on('error', (err) => (answered ? undefined : reject(err)))
    req.end(body)
  })
}

/** Width and height of a PNG, after inflating its image data to the size they imply (8-bit RGBA or RGB). */
function decodePNG(b64) {
  const png = Buffer.from(b64, 'base64')
  assert.equal(png.subarray(0, 8).toString('hex'), '89504e470d0a1a0a', 'PNG signature')
  let off = 8
  let width, height, colorType
  const idat = []
  while (off < png.length) {
    const len = png.readUInt32BE(off)
    const type = png.subarray(off + 4, off + 8).toString('latin1')
    const data = png.subarray(off + 8, off + 8 + len)
    if (type === 'IHDR') {
      width = data.readUInt32BE(0)
      height = data.readUInt32BE(4)
      assert.equal(data[8], 8, 'bit depth')
      colorType = data[9]
    } else if (type === 'IDAT') idat.push(data)
    off += 12 + len
  }
  const channels = { 2: 3, 6: 4 }[colorType]
  assert.ok(channels, `color type ${colorType}`)
  const pixels = inflateSync(Buffer.concat(idat))
  assert.equal(pixels.length, height * (1 + width * channels), 'inflated image data is height rows of width pixels')
  return { width, height }
}

test('runCode keeps state; execution.text of an expression; streams in order', T, async () => {
  await withInterp({}, async (sbx) => {
    assert.equal((await sbx.runCode('x = 41')).text, undefined)
    const ex = await sbx.runCode('x + 1')
    assert.equal(ex.text, '42')
    assert.equal(ex.error, undefined)
    const got = []
    const ex2 = await sbx.runCode(
      "import sys\nprint('one', flush=True)\nprint('two', file=sys.stderr, flush=True)\nprint('three', flush=True)\n'x is %d' % x",
      { onStdout: (m) => got.push('out:' + m.line), onStderr: (m) => got.push('err:' + m.line) })
    assert.deepEqual(got, ['out:one\n', 'err:two\n', 'out:three\n'])
    assert.deepEqual(ex2.logs.stdout, ['one\n', 'three\n'])
    assert.deepEqual(ex2.logs.stderr, ['two\n'])
    assert.equal(ex2.text, 'x is 41')
    assert.ok(ex2.executionCount >= 3, `executionCount ${ex2.executionCount}`)
    assert.equal((await sbx.commands.run('echo hi')).stdout, 'hi\n', 'envd still answers beside the interpreter')
  })
})

test('a matplotlib plot is a PNG of the figure size; a DataFrame is HTML and data', T, async () => {
  await withInterp({}, async (sbx) => {
    const plot = await sbx.runCode([
      "%config InlineBackend.print_figure_kwargs = {'bbox_inches': None}",
      'import matplotlib.pyplot as plt',
      'fig = plt.figure(figsize=(4, 3), dpi=100)',
      'plt.plot([1, 2, 3], [1, 4, 9])',
      'plt.show()',
    ].join('\n'))
    assert.equal(plot.error, undefined, plot.error?.traceback)
    const png = plot.results.find((r) => r.png)
    assert.ok(png, `a PNG among ${JSON.stringify(plot.results.map((r) => r.formats()))}`)
    assert.deepEqual(decodePNG(png.png), { width: 400, height: 300 })
    const df = await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [float('nan'), 3.5]})")
    assert.equal(df.error, undefined, df.error?.traceback)
    const main = df.results.find((r) => r.isMainResult)
    assert.match(main.html, /<table[^>]*class="dataframe"/)
    assert.deepEqual(main.data, { a: [1, 2], b: [null, 3.5] })
  })
})

test('an exception is an error with name, value and a plain traceback', T, async () => {
  await withInterp({}, async (sbx) => {
    const errors = []
    const ex = await sbx.runCode('def f():\n    return 1 / 0\nf()', { onError: (e) => errors.push(e.name) })
    assert.equal(ex.error.name, 'ZeroDivisionError')
    assert.equal(ex.error.value, 'division by zero')
    assert.match(ex.error.traceback, /return 1 \/ 0/)
    assert.doesNotMatch(ex.error.traceback, /\x1b/, 'no colour escapes')
    assert.deepEqual(errors, ['ZeroDivisionError'])
  })
})

test('envs apply to one run only, whatever they hold', T, async () => {
  await withInterp({}, async (sbx) => {
    const value = 'it\'s "quoted"\nand $HOME `x` \\ done'
    const code = "import os\nprint(os.environ.get('ONLY', 'unset'), end='')"
    assert.equal((await sbx.runCode(code, { envs: { ONLY: value } })).logs.stdout.join(''), value)
    assert.equal((await sbx.runCode(code)).logs.stdout.join(''), 'unset')
    const js = await sbx.runCode('process.env.ONLY', { language: 'javascript', envs: { ONLY: 'js value' } })
    assert.equal(js.text, 'js value')
    const sh = await sbx.runCode('echo "$ONLY"', { language: 'bash', envs: { ONLY: value } })
    assert.equal(sh.logs.stdout.join(''), value + '\n')
    assert.equal((await sbx.runCode('echo "${ONLY-unset}"', { language: 'bash' })).logs.stdout.join(''), 'unset\n')
  })
})

test('a run longer than timeoutMs raises TimeoutError, and the context goes on with its state', T, async () => {
  await withInterp({}, async (sbx) => {
    await sbx.runCode('kept = 7')
    await assert.rejects(sbx.runCode('import time\ntime.sleep(600)', { timeoutMs: 1500 }), (err) => {
      assert.ok(err instanceof TimeoutError, `want TimeoutError, got ${errText(err)}`)
      return true
    })
    const ex = await sbx.runCode('kept * 6')
    assert.equal(ex.text, '42', `the context after the timeout: ${JSON.stringify(ex.error)}`)
  })
})

test('contexts: create with cwd and language, list, restart, remove', T, async () => {
  await withInterp({}, async (sbx) => {
    const ctx = await sbx.createCodeContext({ cwd: '/tmp', language: 'python' })
    assert.equal(ctx.cwd, '/tmp')
    assert.equal(ctx.language, 'python')
    assert.equal((await sbx.runCode('import os\nv = 1\nos.getcwd()', { context: ctx })).text, '/tmp')
    const home = await sbx.runCode('import os\nos.getcwd()')
    assert.equal(home.text, '/home/user', 'the default context is in /home/user')
    const listed = await sbx.listCodeContexts()
    assert.ok(listed.some((c) => c.id === ctx.id && c.cwd === '/tmp'), JSON.stringify(listed))
    assert.ok(listed.some((c) => c.language === 'python' && c.cwd === '/home/user'), JSON.stringify(listed))
    await sbx.restartCodeContext(ctx)
    const after = await sbx.runCode('v', { context: ctx })
    assert.equal(after.error?.name, 'NameError', 'state is gone after a restart')
    assert.equal((await sbx.runCode('import os\nos.getcwd()', { context: ctx })).text, '/tmp', 'cwd kept')
    await sbx.removeCodeContext(ctx.id)
    assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
    // (A refused runCode leaves the SDK's request timer pending: short.)
    await assert.rejects(sbx.runCode('1', { context: ctx, requestTimeoutMs: 5000 }), NotFoundError)
    const js = await sbx.createCodeContext({ language: 'javascript', cwd: '/tmp' })
    assert.equal((await sbx.runCode('process.cwd()', { context: js })).text, '/tmp')
  })
})

test('two contexts run at the same time', T, async () => {
  await withInterp({}, async (sbx) => {
    const [a, b] = await Promise.all([sbx.createCodeContext(), sbx.createCodeContext()])
    const wait = (mine, theirs) => `import os, time
open('/tmp/${mine}', 'w').close()
for _ in range(3000):
    if os.path.exists('/tmp/${theirs}'): break
    time.sleep(0.01)
else:
    print('gave up')
print('done')`
    const [ra, rb] = await Promise.all([sbx.runCode(wait('a', 'b'), { context: a }), sbx.runCode(wait('b', 'a'), { context: b })])
    assert.deepEqual([ra.logs.stdout, rb.logs.stdout], [['done\n'], ['done\n']])
  })
})

test('javascript and typescript keep state and await; bash; r', T, async () => {
  await withInterp({}, async (sbx) => {
    const js = async (code) => sbx.runCode(code, { language: 'javascript' })
    assert.equal((await js('const a = await Promise.resolve(20); a + 1')).text, '21')
    assert.equal((await js('a * 2')).text, '40')
    const logged = await js("console.log('hello', 1 + 1); 'last'")
    assert.deepEqual(logged.logs.stdout, ['hello 2\n'])
    assert.equal(logged.text, 'last')
    assert.equal((await js("throw new RangeError('nope')")).error.name, 'RangeError')
    const ts = async (code) => sbx.runCode(code, { language: 'typescript' })
    assert.equal((await ts('interface P { n: number }\nconst p: P = { n: await Promise.resolve(5) }\np.n * 2')).text, '10')
    assert.equal((await ts('const q: number = p.n + 1; q')).text, '6')
    const sh = async (code) => sbx.runCode(code, { language: 'bash' })
    assert.deepEqual((await sh('n=3; cd /tmp; echo $n')).logs.stdout, ['3\n'])
    assert.deepEqual((await sh('echo $n $PWD; whoami')).logs.stdout.join(''), '3 /tmp\nuser\n')
    assert.equal((await sh('exit_code() { return 3; }; exit_code')).error?.name, 'CommandExitError')
    const r = await sbx.runCode('x <- c(1, 2, 3)\ncat("sum", sum(x), "\\n")\nmean(x)', { language: 'r' })
    assert.equal(r.error, undefined, r.error?.traceback)
    assert.deepEqual(r.logs.stdout, ['sum 6 \n'])
    assert.equal(r.results[0]?.text, '[1] 2')
  })
})

test('a run that prints 50 MB is bounded and the context goes on', T, async () => {
  await withInterp({}, async (sbx) => {
    const ex = await sbx.runCode("import sys\nfor _ in range(50):\n    sys.stdout.write('x' * (1 << 20))\n'end'", { timeoutMs: 120_000 })
    const out = ex.logs.stdout.join('')
    assert.ok(out.length > 1 << 20 && out.length <= 16 << 20, `stdout of ${out.length} bytes`)
    assert.match(ex.logs.stderr.join(''), /passed the interpreter's limit of 16 MiB; the rest was dropped/)
    assert.equal((await sbx.runCode('2 + 2')).text, '4')
  })
})

test('a run that kills its kernel: the next run says so, a restart recovers', T, async () => {
  await withInterp({}, async (sbx) => {
    const died = await sbx.runCode('import os\nos.kill(os.getpid(), 9)')
    assert.equal(died.error?.name, 'KernelDied', JSON.stringify(died.error))
    const next = await sbx.runCode('1 + 1')
    assert.equal(next.error?.name, 'KernelDied')
    assert.match(next.error.value, /restart the context \(restartCodeContext\)/)
    const ctx = (await sbx.listCodeContexts()).find((c) => c.language === 'python' && c.cwd === '/home/user')
    assert.ok(next.error.value.includes(ctx.id), 'the error names the context')
    await sbx.restartCodeContext(ctx)
    assert.equal((await sbx.runCode('1 + 1')).text, '2')
  })
})

test('code that kills the interpreter: it starts again, with fresh contexts', T, async () => {
  await withInterp({}, async (sbx) => {
    await sbx.runCode('kept = 1')
    await assert.rejects(sbx.runCode('import os, signal\nos.kill(os.getppid(), signal.SIGKILL)', { timeoutMs: 10_000, requestTimeoutMs: 10_000 }))
    let ex
    for (let i = 0; i < 100 && !ex; i++) {
      ex = await sbx.runCode('1 + 1', { requestTimeoutMs: 5000 }).catch(() => new Promise((r) => setTimeout(r, 200)))
    }
    assert.equal(ex?.text, '2', 'the interpreter answers again within 20 s')
    assert.equal((await sbx.runCode('kept')).error?.name, 'NameError', 'its state went with it')
  })
})

test('bad input: context and language, unknown context and language, malformed JSON, 10 MB of code', T, async () => {
  await withInterp({}, async (sbx) => {
    const ctx = await sbx.createCodeContext()
    await assert.rejects(sbx.runCode('1', { context: ctx, language: 'python' }), InvalidArgumentError)
    const token = sbx.envdAccessToken
    let res = await raw(sbx, '/execute', { token, body: JSON.stringify({ code: '1', context_id: ctx.id, language: 'python' }) })
    assert.equal(res.status, 400)
    assert.equal(res.text, 'Only one of context_id or language can be provided')
    await assert.rejects(sbx.runCode('1', { context: { id: 'no-such-context', language: 'python', cwd: '/' }, requestTimeoutMs: 5000 }), (err) => {
      assert.ok(err instanceof NotFoundError, errText(err))
      assert.match(err.message, /Context no-such-context not found/)
      return true
    })
    await assert.rejects(sbx.runCode('1', { language: 'cobol', requestTimeoutMs: 5000 }), (err) => {
      assert.ok(err instanceof SandboxError && /400/.test(err.message), errText(err))
      return true
    })
    res = await raw(sbx, '/execute', { token, body: JSON.stringify({ code: '1', language: 'cobol' }) })
    assert.equal(res.status, 400)
    assert.match(res.text, /^unknown language "cobol": this code interpreter runs bash, javascript, python, r, typescript$/)
    res = await raw(sbx, '/execute', { token, body: '{"code": ' })
    assert.equal(res.status, 422)
    res = await raw(sbx, '/execute', { token, body: JSON.stringify({ code: '#'.repeat(10 << 20) }) })
    assert.equal(res.status, 413)
    assert.match(res.text, /request body is larger than 4194304 bytes/)
    assert.equal((await sbx.runCode('3 * 3')).text, '9', 'the interpreter after the bad requests')
  })
})

test('access: running code takes the access token; a private sandbox takes the traffic token everywhere', T, async () => {
  await withInterp({}, async (sbx) => {
    const body = JSON.stringify({ code: '1' })
    assert.equal((await raw(sbx, '/execute', { body })).status, 401, 'no X-Access-Token')
    assert.equal((await raw(sbx, '/execute', { body, token: 'wrong' })).status, 401, 'a wrong X-Access-Token')
    assert.equal((await raw(sbx, '/contexts', { method: 'GET', token: 'wrong' })).status, 401, 'a wrong token on /contexts')
    const open = await raw(sbx, '/contexts', { method: 'GET' })
    assert.equal(open.status, 200, 'a public sandbox lists contexts without a token, as E2B')
  })
  await withInterp({ network: { allowPublicTraffic: false } }, async (sbx) => {
    assert.ok(sbx.trafficAccessToken, 'a private sandbox has a traffic token')
    assert.equal((await sbx.runCode('5 * 5')).text, '25', 'the SDK sends the traffic token')
    assert.equal((await sbx.listCodeContexts()).length >= 1, true)
    const res = await raw(sbx, '/contexts', { method: 'GET' })
    assert.equal(res.status, 403, 'contexts of a private sandbox without the traffic token')
    const exec = await raw(sbx, '/execute', { body: JSON.stringify({ code: '1' }), token: sbx.envdAccessToken })
    assert.equal(exec.status, 403, 'running code in a private sandbox without the traffic token')
  })
})

test('pool: a create gets a sandbox whose kernel was up before it, with the network it asked for', { ...T, skip: !POOLED && 'the daemon keeps no pool' }, async () => {
  // The pool fills in the background: wait until a create is served by it.
  let seen = false
  for (let i = 0; i < 60 && !seen; i++) {
    const before = Date.now() / 1000
    await withInterp({}, async (sbx) => {
      const started = Number((await sbx.runCode("import os\nos.stat('/proc/self').st_ctime")).text)
      if (started < before) {
        seen = true
        const ex = await sbx.runCode(`import urllib.request\nurllib.request.urlopen('http://${PUBLIC}/', timeout=5).status`)
        assert.equal(ex.text, '200', `the internet a create asks for by default: ${JSON.stringify(ex.error)}`)
      }
    })
    if (!seen) await new Promise((r) => setTimeout(r, 1000))
  }
  assert.ok(seen, 'no create was served by a started sandbox from the pool in a minute')
  await withInterp({ allowInternetAccess: false }, async (sbx) => {
    const ex = await sbx.runCode(`import urllib.request\ntry:\n    urllib.request.urlopen('http://${PUBLIC}/', timeout=3)\n    print('reached')\nexcept Exception as e:\n    print('refused')`)
    assert.deepEqual(ex.logs.stdout, ['refused\n'], 'no internet where the create asked for none')
  })
})
