// Shared by the SDK test files: loads the E2B SDK named by E2B_SDK_MODULE,
// refuses to run unless every URL points at a loopback cage, and creates
// sandboxes that are always killed.
import { readFileSync } from 'node:fs'

export const moduleName = process.env.E2B_SDK_MODULE || 'e2b'

// Never talk to the real E2B: without these the SDK goes to *.e2b.app.
for (const name of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY']) {
  if (!process.env[name]) {
    throw new Error(`${name} is not set: these tests run only against a local cage serve (see e2b_test.go)`)
  }
}
for (const name of ['E2B_API_URL', 'E2B_SANDBOX_URL']) {
  const host = new URL(process.env[name]).hostname
  if (!['127.0.0.1', 'localhost', '[::1]'].includes(host)) {
    throw new Error(`${name}=${process.env[name]} is not a loopback address`)
  }
}

export const sdk = await import(moduleName)

export const sdkVersion = JSON.parse(
  readFileSync(new URL(`./node_modules/${moduleName}/package.json`, import.meta.url), 'utf8'),
).version

// The host template, or what the daemon's wall needs instead (the microvm
// wall runs base: no VM is given the host's files).
export const TEMPLATE = process.env.CAGE_TEST_TEMPLATE || 'host'

/** Creates a sandbox from TEMPLATE, runs fn, and always kills it. */
export async function withSandbox(opts, fn) {
  const sbx = await sdk.Sandbox.create(TEMPLATE, { timeoutMs: 120_000, ...opts })
  try {
    return await fn(sbx)
  } catch (err) {
    // The id ties a failure to the daemon's log.
    console.log(`# failed in sandbox ${sbx.sandboxId}: ${errText(err)}`)
    throw err
  } finally {
    await sbx.kill().catch((err) => console.error(`# kill ${sbx.sandboxId}: ${err}`))
  }
}

/** Polls pred every 50 ms until it holds or ms pass; then fails with what() */
export async function waitFor(pred, ms, what) {
  const deadline = Date.now() + ms
  while (!(await pred())) {
    if (Date.now() > deadline) {
      throw new Error(`timed out after ${ms} ms waiting for ${what()}`)
    }
    await new Promise((r) => setTimeout(r, 50))
  }
}

/** Describes an error for an assertion message: its class, message and cause. */
export function errText(err) {
  if (!(err instanceof Error)) return String(err)
  return `${err.constructor?.name}: ${err.message}${err.cause ? ` (cause: ${err.cause})` : ''}`
}
