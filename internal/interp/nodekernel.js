// cage's JavaScript and TypeScript kernel (internal/interp/node.go runs it
// with `node -e`). State lives in the kernel's one global scope between
// runs; a run's last expression is its result; top-level await works.
//
// Requests arrive as JSON lines on fd 3: {"id", "code", "env", "ts"}, or
// {"interrupt": id} for the run in progress (with a SIGINT). The
// kernel answers on fd 4, one JSON line per message: {"type": "ready"} once,
// then per run {"id", "type": "stdout"|"stderr", "text"}, {"id", "type":
// "result", "data": {MIME: value}}, {"id", "type": "error", "name", "value",
// "traceback"} and last {"id", "type": "done", "sigint": whether a SIGINT
// reached it}; {"type": "sigint"} is a SIGINT that came between runs.
//
// Each run's code is rewritten before it runs (with TypeScript's parser,
// Debian's node-typescript): TypeScript, and JavaScript with import or
// export, is transpiled to CommonJS; top-level let, const and class become
// var, so a cell can be run again; code with top-level await runs in an
// async function whose declarations are hoisted to the global scope and
// whose last expression is returned.
'use strict'

const fs = require('fs')
const path = require('path')
const readline = require('readline')
const util = require('util')
const vm = require('vm')
const { createRequire } = require('module')

let ts = null
for (const name of ['typescript', '/usr/share/nodejs/typescript']) {
  try {
    ts = require(name)
    break
  } catch {}
}

const OUT = 4
let current = null // the id of the run in progress
let interrupt = null // ends the run in progress's wait on its promise

function send(msg) {
  const b = Buffer.from(JSON.stringify(msg) + '\n')
  for (let off = 0; off < b.length; ) {
    off += fs.writeSync(OUT, b, off, b.length - off)
  }
}

// What the run writes to process.stdout and process.stderr (console.log
// too) is its output; writes between runs have nobody to go to.
for (const name of ['stdout', 'stderr']) {
  process[name].write = function (chunk, encoding, cb) {
    if (typeof encoding === 'function') {
      cb = encoding
      encoding = undefined
    }
    const text = typeof chunk === 'string' ? chunk : Buffer.from(chunk).toString(encoding || 'utf8')
    if (current !== null && text !== '') send({ id: current, type: name, text })
    if (cb) process.nextTick(cb)
    return true
  }
}

// An interrupt between the script's return and the wait on its promise
// is kept for the wait. The server learns that its SIGINT arrived (done's
// sigint, or a sigint message when it comes after the run), so that none
// is left to break the next run.
let interruptPending = false
let sigintSeen = false
process.on('SIGINT', () => {
  sigintSeen = true
  if (current === null) send({ type: 'sigint' })
  else if (interrupt) interrupt()
  else interruptPending = true
})
process.on('uncaughtException', (e) => {
  if (current !== null) send({ id: current, type: 'stderr', text: 'Uncaught ' + describe(e).traceback + '\n' })
})
process.on('unhandledRejection', (e) => {
  if (current !== null) send({ id: current, type: 'stderr', text: 'Unhandled promise rejection: ' + describe(e).traceback + '\n' })
})

// The names a CommonJS cell expects, resolving modules from the working
// directory (then Node's global paths).
globalThis.require = createRequire(path.join(process.cwd(), '[cell]'))
globalThis.module = { exports: {} }
globalThis.exports = globalThis.module.exports

// describe is a thrown value as an error line; the stack stops where the
// kernel's own frames begin.
function describe(e) {
  if (e instanceof Error || (e !== null && typeof e === 'object' && 'stack' in e)) {
    const lines = String(e.stack ?? '').split('\n')
    const end = lines.findIndex((l) => /^\s+at .*(node:vm|\[eval\])/.test(l))
    const traceback = (end < 0 ? lines : lines.slice(0, end)).join('\n')
    return { name: String(e.name || 'Error'), value: String(e.message ?? ''), traceback }
  }
  return { name: 'Error', value: util.inspect(e), traceback: '' }
}

function parse(code, fileName) {
  return ts.createSourceFile(fileName, code, ts.ScriptTarget.Latest, true, ts.ScriptKind.JS)
}

function hasModuleSyntax(sf) {
  return sf.statements.some((s) => ts.isImportDeclaration(s) || ts.isImportEqualsDeclaration(s) ||
    ts.isExportDeclaration(s) || ts.isExportAssignment(s) ||
    (s.modifiers || []).some((m) => m.kind === ts.SyntaxKind.ExportKeyword))
}

// hasTopLevelAwait: an await outside any function.
function hasTopLevelAwait(node) {
  if (ts.isAwaitExpression(node) || (ts.isForOfStatement(node) && node.awaitModifier)) return true
  if (ts.isFunctionLike(node)) return false
  return ts.forEachChild(node, hasTopLevelAwait) || false
}

function bindingNames(name, out) {
  if (ts.isIdentifier(name)) {
    out.add(name.text)
    return
  }
  for (const el of name.elements) {
    if (!ts.isOmittedExpression(el)) bindingNames(el.name, out)
  }
}

// prepare turns a cell into a script for the kernel's global scope, and
// says whether the script's value is a promise of the cell's value.
function prepare(code, isTS) {
  if (!ts) {
    if (isTS) throw new Error('TypeScript is not installed in this sandbox (Debian package node-typescript)')
    if (/\bawait\b/.test(code)) {
      try {
        new vm.Script(code)
      } catch (e) {
        if (e instanceof SyntaxError) return { code: `(async () => {\n${code}\n})()`, async: true }
      }
    }
    return { code, async: false }
  }
  // An .mjs file is a module: top-level await parses as await.
  let sf = parse(code, 'cell.mjs')
  if (isTS || hasModuleSyntax(sf)) {
    code = ts.transpileModule(code, {
      fileName: isTS ? 'cell.ts' : 'cell.js',
      reportDiagnostics: false,
      compilerOptions: { target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.CommonJS, esModuleInterop: true, allowJs: true },
    }).outputText
    sf = parse(code, 'cell.mjs')
  }
  const stmts = sf.statements
  const isAsync = stmts.some(hasTopLevelAwait)
  const edits = [] // [start, end, text]
  const names = new Set()
  const functions = []
  for (const s of stmts) {
    if (ts.isVariableStatement(s)) {
      const list = s.declarationList
      if (!isAsync) {
        const kw = list.flags & ts.NodeFlags.Let ? 3 : list.flags & ts.NodeFlags.Const ? 5 : 0
        if (kw) edits.push([list.getStart(sf), list.getStart(sf) + kw, 'var'])
        continue
      }
      const parts = []
      for (const d of list.declarations) {
        bindingNames(d.name, names)
        if (d.initializer) parts.push(`(${d.name.getText(sf)} = ${d.initializer.getText(sf)})`)
      }
      edits.push([s.getStart(sf), s.end, parts.length ? `void (${parts.join(', ')});` : ';'])
    } else if (ts.isClassDeclaration(s) && s.name) {
      if (isAsync) names.add(s.name.text)
      edits.push([s.getStart(sf), s.end, `${isAsync ? '' : 'var '}${s.name.text} = ${s.getText(sf)};`])
    } else if (isAsync && ts.isFunctionDeclaration(s) && s.name) {
      names.add(s.name.text)
      functions.push(s.name.text)
    }
  }
  const last = stmts[stmts.length - 1]
  if (isAsync && last && ts.isExpressionStatement(last)) {
    edits.push([last.getStart(sf), last.end, `return (${last.expression.getText(sf)});`])
  }
  edits.sort((a, b) => b[0] - a[0])
  for (const [start, end, text] of edits) code = code.slice(0, start) + text + code.slice(end)
  if (!isAsync) return { code, async: false }
  const decl = names.size ? `var ${[...names].join(', ')};\n` : ''
  const hoist = functions.map((n) => `globalThis[${JSON.stringify(n)}] = ${n};`).join(' ')
  return { code: `${decl}(async () => { ${hoist}\n${code}\n})()`, async: true }
}

function setEnv(env) {
  const saved = {}
  for (const [k, v] of Object.entries(env || {})) {
    saved[k] = Object.prototype.hasOwnProperty.call(process.env, k) ? process.env[k] : undefined
    process.env[k] = v
  }
  return saved
}

function restoreEnv(saved) {
  for (const [k, v] of Object.entries(saved)) {
    if (v === undefined) delete process.env[k]
    else process.env[k] = v
  }
}

async function run(req) {
  current = req.id
  interruptPending = sigintSeen = false
  const saved = setEnv(req.env)
  try {
    const cell = prepare(req.code, req.ts)
    const script = new vm.Script(cell.code, { filename: `cell${req.id}.${req.ts ? 'ts' : 'js'}` })
    let value = script.runInThisContext({ breakOnSigint: true, displayErrors: false })
    if (cell.async) {
      value = await new Promise((resolve, reject) => {
        interrupt = () => reject(Object.assign(new Error('Execution was interrupted'), { name: 'InterruptedError' }))
        if (interruptPending) interrupt()
        Promise.resolve(value).then(resolve, reject)
      })
    }
    if (value !== undefined) {
      send({ id: req.id, type: 'result', data: { 'text/plain': util.inspect(value, { depth: 6, maxArrayLength: 1000, breakLength: 100 }) } })
    }
  } catch (e) {
    if (e && e.code === 'ERR_SCRIPT_EXECUTION_INTERRUPTED') sigintSeen = true
    send({ id: req.id, type: 'error', ...describe(e) })
  } finally {
    interrupt = null
    restoreEnv(saved)
    send({ id: req.id, type: 'done', sigint: sigintSeen })
    current = null
  }
}

const queue = []
let running = false
async function pump() {
  if (running) return
  running = true
  while (queue.length) await run(queue.shift())
  running = false
}

const requests = readline.createInterface({ input: fs.createReadStream(null, { fd: 3 }), crlfDelay: Infinity })
requests.on('line', (line) => {
  const req = JSON.parse(line)
  if (req.interrupt !== undefined) {
    // The server interrupts with SIGINT (a script that never yields) and
    // this message (a promise that never settles).
    if (req.interrupt === current) {
      if (interrupt) interrupt()
      else interruptPending = true
    }
    return
  }
  queue.push(req)
  pump()
})
requests.on('close', () => process.exit(0))
send({ type: 'ready', typescript: ts !== null })
