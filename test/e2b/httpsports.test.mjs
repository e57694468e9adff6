// The real E2B SDK (2.51.0) with network.httpsPorts: Sandbox.create passes
// the list, getInfo shows it, and a TLS server inside on a listed port is
// reached through the proxy by a client speaking plain HTTP (the proxy's
// hop to the sandbox is TLS, the certificate the sandbox's own). A port
// the agent owns is refused. httpsports_test.go runs it.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { request } from 'node:http'

import { sdk, TEMPLATE, withSandbox, waitFor } from './helpers.mjs'

const { Sandbox } = sdk
const T = { timeout: 120_000 }

const server = `import http.server, ssl
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        body = b"tls inside the sandbox"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
srv = http.server.HTTPServer(("0.0.0.0", 8443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain("/tmp/cert.pem", "/tmp/key.pem")
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
srv.serve_forever()
`

/** GET / of host through the proxy, in plain HTTP. */
function viaProxy(host) {
  const proxy = new URL(process.env.E2B_SANDBOX_URL)
  return new Promise((resolve, reject) => {
    const req = request({ host: proxy.hostname, port: proxy.port, path: '/', headers: { Host: host } }, (res) => {
      let body = ''
      res.on('data', (d) => (body += d))
      res.on('end', () => resolve({ status: res.statusCode, body }))
    })
    req.on('error', reject)
    req.end()
  })
}

test('network.httpsPorts: a TLS server inside answers plain HTTP clients through the proxy', T, async () => {
  await withSandbox({ network: { httpsPorts: [8443] } }, async (sbx) => {
    const info = await Sandbox.getInfo(sbx.sandboxId)
    assert.deepEqual(info.network?.httpsPorts, [8443], 'getInfo shows the list')
    await sbx.files.write('/tmp/tls.py', server)
    await sbx.commands.run(
      'openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=sandbox -keyout /tmp/key.pem -out /tmp/cert.pem 2>/dev/null',
    )
    await sbx.commands.run('python3 /tmp/tls.py', { background: true })
    const host = sbx.getHost(8443)
    let last
    await waitFor(async () => {
      last = await viaProxy(host)
      return last.status === 200
    }, 20_000, () => `the TLS server at ${host}: ${JSON.stringify(last)}`)
    assert.equal(last.body, 'tls inside the sandbox')
  })
})

test('network.httpsPorts: the agent port 49983 and bad ports are refused', T, async () => {
  for (const ports of [[49983], [0], [70000], [8443, 8443]]) {
    await assert.rejects(
      Sandbox.create(TEMPLATE, { timeoutMs: 60_000, network: { httpsPorts: ports } }),
      (err) => /httpsPorts/.test(err.message) && err.message.includes(String(ports[0])),
      `httpsPorts ${JSON.stringify(ports)} is refused naming the port`,
    )
  }
})
