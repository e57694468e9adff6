package mcp

import (
	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
)

// ToolNames are the tools every server has, in the order they are listed.
var ToolNames = []string{"sandbox_create", "sandbox_list", "sandbox_kill", "sandbox_pause", "sandbox_resume",
	"exec", "run_code", "file_read", "file_write", "file_list", "port_url"}

// hints are a tool's annotations: readOnly; else destructive, idempotent;
// openWorld says whether it reaches past the sandbox (the internet).
func hints(title string, readOnly, destructive, idempotent, openWorld bool) *sdk.ToolAnnotations {
	a := &sdk.ToolAnnotations{Title: title, ReadOnlyHint: readOnly, OpenWorldHint: ptr(openWorld)}
	if !readOnly {
		a.DestructiveHint, a.IdempotentHint = ptr(destructive), idempotent
	} else {
		a.DestructiveHint, a.IdempotentHint = ptr(false), true
	}
	return a
}

func (t *tools) register(s *sdk.Server) {
	sdk.AddTool(s, &sdk.Tool{Name: "sandbox_create", InputSchema: createSchema(),
		Annotations: hints("Create a sandbox", false, false, false, true),
		Description: "Create a sandbox: an isolated Linux machine that lives timeout_s seconds (300 by default). " +
			"Returns its sandbox_id, which every other tool takes. Use template code-interpreter-v1 for run_code."},
		t.create)
	sdk.AddTool(s, &sdk.Tool{Name: "sandbox_list", InputSchema: listSchema(),
		Annotations: hints("List sandboxes", true, false, true, false),
		Description: "List this API key's sandboxes (running by default), optionally only those with given metadata."},
		t.list)
	sdk.AddTool(s, &sdk.Tool{Name: "sandbox_kill", InputSchema: idSchema(),
		Annotations: hints("Kill a sandbox", false, true, true, false),
		Description: "Kill a sandbox: its processes and files are gone for good."},
		t.kill)
	sdk.AddTool(s, &sdk.Tool{Name: "sandbox_pause", InputSchema: pauseSchema(),
		Annotations: hints("Pause a sandbox", false, true, true, false),
		Description: "Pause a running sandbox until sandbox_resume: with keep_memory (the default) its processes are frozen " +
			"and resume where they stood; without, only its files are kept and its processes end."},
		t.pause)
	sdk.AddTool(s, &sdk.Tool{Name: "sandbox_resume", InputSchema: resumeSchema(),
		Annotations: hints("Resume or extend a sandbox", false, false, true, false),
		Description: "Resume a paused sandbox for timeout_s seconds; on a running sandbox, extend its life to at least timeout_s from now."},
		t.resume)
	sdk.AddTool(s, &sdk.Tool{Name: "exec", InputSchema: execSchema(),
		Annotations: hints("Run a shell command", false, true, false, true),
		Description: "Run a shell command line in a sandbox (bash -l -c) and return its exit code, stdout and stderr. " +
			"Output beyond max_output_bytes per stream keeps its head and tail (truncated is set). A non-zero exit code " +
			"is a result, not an error. background starts a server or long job and returns its pid at once."},
		t.exec)
	sdk.AddTool(s, &sdk.Tool{Name: "run_code", InputSchema: codeSchema(),
		Annotations: hints("Run code in the code interpreter", false, true, false, true),
		Description: "Run Python (or JavaScript, TypeScript, R, bash) in a sandbox's code interpreter, like a notebook cell: " +
			"variables stay between runs. Returns stdout, stderr, the last expression's value, the error raised, and " +
			"charts and images (matplotlib figures) as image content. Needs a sandbox of template code-interpreter-v1."},
		t.runCode)
	sdk.AddTool(s, &sdk.Tool{Name: "file_read", InputSchema: readSchema(),
		Annotations: hints("Read a file", true, false, true, false),
		Description: "Read a file in a sandbox: text as text, PNG/JPEG/GIF/WebP as image content, other bytes as base64. " +
			"At most max_bytes from offset; truncated says whether the file goes on."},
		agentBound(&fileWithin, t.readFile))
	sdk.AddTool(s, &sdk.Tool{Name: "file_write", InputSchema: writeSchema(),
		Annotations: hints("Write a file", false, true, true, false),
		Description: "Write a file in a sandbox (text, or base64 for binary data), making missing directories and replacing " +
			"a file that is there. mode sets its permissions (e.g. 0755 for a script)."},
		agentBound(&fileWithin, t.writeFile))
	sdk.AddTool(s, &sdk.Tool{Name: "file_list", InputSchema: listFilesSchema(),
		Annotations: hints("List a directory", true, false, true, false),
		Description: "List a directory in a sandbox (its tree to depth levels): names, types, sizes, modes, times."},
		agentBound(&fileWithin, t.listFiles))
	sdk.AddTool(s, &sdk.Tool{Name: "port_url", InputSchema: portSchema(),
		Annotations: hints("URL of a port", true, false, true, false),
		Description: "The URL at which a server listening on a port inside a sandbox is reached through cage's proxy " +
			"(start the server with exec and background first)."},
		t.portURL)
}
