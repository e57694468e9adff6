// Package mcp is cage's MCP server: sandboxes as tools for agents that
// speak the Model Context Protocol (Claude Desktop, Cursor, VS Code, agent
// frameworks), built on the official Go SDK
// (github.com/modelcontextprotocol/go-sdk).
//
// The server is a client of the daemon like the CLI: every tool goes
// through the control API (internal/client) and the sandbox proxy
// (internal/agentclient, the code interpreter's port) with one API key, so
// what a tool may touch is what the API lets that key touch, and another
// key's sandbox is "not found" as it is there. The same tools serve both
// transports: `cage mcp` runs one server over stdio with the key from the
// environment (internal/cli), and the daemon serves `/mcp` on its API
// listener over streamable HTTP (Handler), checking the key in
// `Authorization: Bearer` or `X-API-Key` before it reads a byte of the
// body and answering each request statelessly with that key's server.
//
// The tools (tools.go registers them): sandbox_create, sandbox_list,
// sandbox_kill, sandbox_pause, sandbox_resume, exec, run_code, file_read,
// file_write, file_list, port_url. Inputs are typed structs whose JSON
// Schema (with defaults and bounds, schema.go) the SDK checks before a
// handler runs; outputs are structured. A failure is a tool result with
// isError and one line a model can act on, never a protocol error. Output a
// tool returns is bounded: exec and run_code keep the head and the tail of
// each stream and say what they dropped; file_read reads at most max_bytes.
package mcp
