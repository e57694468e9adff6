package mcp

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/client"
)

// The sandbox tools: create, list, kill, pause, resume.

type createIn struct {
	Template      string            `json:"template,omitempty" jsonschema:"template to start from: base (Debian with Python, Node.js and build tools), code-interpreter-v1 (for run_code), or any the daemon has; default: the daemon's default template"`
	TimeoutS      int64             `json:"timeout_s,omitempty" jsonschema:"seconds the sandbox lives before it is killed; sandbox_resume extends it"`
	Envs          map[string]string `json:"envs,omitempty" jsonschema:"environment variables for every command run in the sandbox"`
	Metadata      map[string]string `json:"metadata,omitempty" jsonschema:"string pairs attached to the sandbox, to find it again with sandbox_list"`
	AllowInternet bool              `json:"allow_internet,omitempty" jsonschema:"whether the sandbox may reach the public internet (cloud metadata, the host and private networks are denied either way)"`
	MemoryMB      int64             `json:"memory_mb,omitempty" jsonschema:"memory limit in MiB (default: the daemon's, 512)"`
	CPUs          float64           `json:"cpus,omitempty" jsonschema:"CPU limit in cores, fractions allowed (default: the daemon's, 1)"`
	Wall          string            `json:"wall,omitempty" jsonschema:"isolation: process, runc, gvisor or microvm (default: the daemon's)"`
}

var createSchema = lazySchema[createIn](func(p props) {
	p.def("timeout_s", 300).rng("timeout_s", 1, 86400).def("allow_internet", true).
		maxProps("envs", maxEnvs).maxProps("metadata", maxMetadata).rng("memory_mb", 0, 1<<30).rng("cpus", 0, 1024).
		enum("wall", "process", "runc", "gvisor", "microvm").maxLen("template", 256)
})

// sandboxOut describes one sandbox.
type sandboxOut struct {
	SandboxID string            `json:"sandbox_id"`
	Template  string            `json:"template"`
	Wall      string            `json:"wall"`
	State     string            `json:"state" jsonschema:"running or paused"`
	StartedAt time.Time         `json:"started_at"`
	EndAt     time.Time         `json:"end_at" jsonschema:"when the sandbox ends unless extended (sandbox_resume)"`
	Metadata  map[string]string `json:"metadata,omitempty"`
}

func detailOut(d *types.SandboxDetail) sandboxOut {
	return sandboxOut{SandboxID: d.SandboxID, Template: d.TemplateID, Wall: string(d.Wall), State: string(d.State),
		StartedAt: d.StartedAt, EndAt: d.EndAt, Metadata: d.Metadata}
}

func (t *tools) create(ctx context.Context, _ *sdk.CallToolRequest, in createIn) (*sdk.CallToolResult, sandboxOut, error) {
	if err := checkEnvs(in.Envs); err != nil {
		return nil, sandboxOut{}, err
	}
	if len(in.Metadata) > maxMetadata {
		return nil, sandboxOut{}, fmt.Errorf("metadata: at most %d pairs", maxMetadata)
	}
	timeout := in.TimeoutS
	if timeout == 0 {
		timeout = 300
	}
	body := types.NewSandboxV2{TemplateID: in.Template, Timeout: &timeout, EnvVars: in.Envs, Metadata: in.Metadata,
		AllowInternetAccess: &in.AllowInternet, MemoryMB: in.MemoryMB, CPUCount: in.CPUs, Wall: types.Wall(in.Wall)}
	sb, err := t.c.Create(ctx, body)
	if err != nil {
		return nil, sandboxOut{}, t.failure(err)
	}
	d, err := t.c.Get(ctx, sb.SandboxID)
	if err != nil {
		return nil, sandboxOut{}, t.failure(err)
	}
	return nil, detailOut(d), nil
}

type listIn struct {
	State    string            `json:"state,omitempty" jsonschema:"which sandboxes: running, paused or all"`
	Metadata map[string]string `json:"metadata,omitempty" jsonschema:"only sandboxes with all of these metadata pairs"`
}

var listSchema = lazySchema[listIn](func(p props) {
	p.def("state", "running").enum("state", "running", "paused", "all").maxProps("metadata", maxMetadata)
})

type listOut struct {
	Sandboxes []sandboxOut `json:"sandboxes"`
	Count     int          `json:"count"`
}

func (t *tools) list(ctx context.Context, _ *sdk.CallToolRequest, in listIn) (*sdk.CallToolResult, listOut, error) {
	var states []string
	switch in.State {
	case "", "running":
		states = []string{"running"}
	case "paused":
		states = []string{"paused"}
	case "all":
		states = []string{"running", "paused"}
	default:
		return nil, listOut{}, fmt.Errorf("state %q: want running, paused or all", clip(in.State, 40))
	}
	all, err := t.c.ListStates(ctx, states, in.Metadata)
	if err != nil {
		return nil, listOut{}, t.failure(err)
	}
	out := listOut{Sandboxes: []sandboxOut{}, Count: len(all)}
	for _, s := range all {
		out.Sandboxes = append(out.Sandboxes, sandboxOut{SandboxID: s.SandboxID, Template: s.TemplateID, Wall: string(s.Wall),
			State: string(s.State), StartedAt: s.StartedAt, EndAt: s.EndAt, Metadata: s.Metadata})
	}
	return nil, out, nil
}

type idIn struct {
	SandboxID string `json:"sandbox_id" jsonschema:"the sandbox, as sandbox_create or sandbox_list gave it"`
}

var idSchema = lazySchema[idIn](func(p props) { p.sandboxID() })

type killOut struct {
	SandboxID string `json:"sandbox_id"`
	Killed    bool   `json:"killed"`
}

func (t *tools) kill(ctx context.Context, _ *sdk.CallToolRequest, in idIn) (*sdk.CallToolResult, killOut, error) {
	if err := checkID(in.SandboxID); err != nil {
		return nil, killOut{}, err
	}
	if err := t.c.Kill(ctx, in.SandboxID); err != nil {
		return nil, killOut{}, t.failure(err)
	}
	t.forget(in.SandboxID)
	return nil, killOut{SandboxID: in.SandboxID, Killed: true}, nil
}

type pauseIn struct {
	SandboxID  string `json:"sandbox_id" jsonschema:"the sandbox, as sandbox_create or sandbox_list gave it"`
	KeepMemory bool   `json:"keep_memory,omitempty" jsonschema:"keep the sandbox's memory, so its processes resume where they stood (false: keep only its files, release its memory; its processes end)"`
}

var pauseSchema = lazySchema[pauseIn](func(p props) { p.sandboxID().def("keep_memory", true) })

type stateOut struct {
	SandboxID string    `json:"sandbox_id"`
	State     string    `json:"state"`
	EndAt     time.Time `json:"end_at,omitzero" jsonschema:"when a running sandbox ends unless extended"`
	Changed   bool      `json:"changed" jsonschema:"false when the sandbox was already in this state"`
}

func (t *tools) pause(ctx context.Context, _ *sdk.CallToolRequest, in pauseIn) (*sdk.CallToolResult, stateOut, error) {
	if err := checkID(in.SandboxID); err != nil {
		return nil, stateOut{}, err
	}
	err := t.c.Pause(ctx, in.SandboxID, in.KeepMemory)
	var ae *client.APIError
	if errors.As(err, &ae) && ae.Status == http.StatusConflict {
		// Paused already (idempotent), or in a state that cannot pause.
		if d, gerr := t.c.Get(ctx, in.SandboxID); gerr == nil && d.State == "paused" {
			return nil, stateOut{SandboxID: in.SandboxID, State: "paused"}, nil
		}
	}
	if err != nil {
		return nil, stateOut{}, t.failure(err)
	}
	t.forget(in.SandboxID)
	return nil, stateOut{SandboxID: in.SandboxID, State: "paused", Changed: true}, nil
}

type resumeIn struct {
	SandboxID string `json:"sandbox_id" jsonschema:"the sandbox, as sandbox_create or sandbox_list gave it"`
	TimeoutS  int64  `json:"timeout_s,omitempty" jsonschema:"seconds from now the sandbox lives; a running sandbox that would end sooner is extended"`
}

var resumeSchema = lazySchema[resumeIn](func(p props) { p.sandboxID().def("timeout_s", 300).rng("timeout_s", 1, 86400) })

func (t *tools) resume(ctx context.Context, _ *sdk.CallToolRequest, in resumeIn) (*sdk.CallToolResult, stateOut, error) {
	if err := checkID(in.SandboxID); err != nil {
		return nil, stateOut{}, err
	}
	timeout := in.TimeoutS
	if timeout == 0 {
		timeout = 300
	}
	before, err := t.c.Get(ctx, in.SandboxID)
	if err != nil {
		return nil, stateOut{}, t.failure(err)
	}
	if _, err := t.c.Resume(ctx, in.SandboxID, timeout); err != nil {
		return nil, stateOut{}, t.failure(err)
	}
	d, err := t.c.Get(ctx, in.SandboxID)
	if err != nil {
		return nil, stateOut{}, t.failure(err)
	}
	return nil, stateOut{SandboxID: d.SandboxID, State: string(d.State), EndAt: d.EndAt, Changed: before.State == "paused"}, nil
}
