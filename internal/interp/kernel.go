package interp

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os/exec"
	"regexp"
	"strings"
	"time"

	"github.com/cagehq/cage/internal/interp/jupyter"
)

// Kernel runs one context's code and keeps its state between runs.
type Kernel interface {
	// Execute runs code with env set for this run only, handing out what
	// it produces. When ctx ends the run is interrupted; if it goes on
	// regardless, Execute returns jupyter.ErrNotInterrupted.
	Execute(ctx context.Context, code string, env map[string]string, out Output) error
	// Restart forgets the state: the kernel's process starts again.
	Restart(ctx context.Context) error
	// Close ends the kernel.
	Close() error
	// Exited is non-nil once the kernel ended on its own (a
	// *jupyter.ExitError saying how).
	Exited() error
}

// Language starts the kernels of one language.
type Language struct {
	// Start starts a kernel working in cwd.
	Start func(ctx context.Context, cwd string) (Kernel, error)
	// Missing says why this sandbox cannot run the language ("": it can).
	Missing func() string
}

// Languages are the languages cage's code interpreter runs: E2B's names.
func Languages() map[string]Language {
	return map[string]Language{
		"python":     jupyterLanguage("python3", pythonEnv),
		"r":          jupyterLanguage("ir", rEnv),
		"javascript": nodeLanguage(false),
		"typescript": nodeLanguage(true),
		"bash":       bashLanguage(),
	}
}

// envCode is the code a language's kernel runs (silently) to set env for
// one run, and to put back what was there before.
type envCode func(env map[string]string) (set, restore string)

func jupyterLanguage(spec string, env envCode) Language {
	return Language{
		Start: func(ctx context.Context, cwd string) (Kernel, error) {
			s, err := jupyter.FindSpec(spec, jupyter.SpecDirs())
			if err != nil {
				return nil, err
			}
			k, err := jupyter.Start(ctx, s, jupyter.Options{Cwd: cwd})
			if err != nil {
				return nil, err
			}
			return &jupyterKernel{Kernel: k, env: env}, nil
		},
		Missing: func() string {
			if _, err := jupyter.FindSpec(spec, jupyter.SpecDirs()); err != nil {
				return err.Error()
			}
			return ""
		},
	}
}

// jupyterKernel is a context on a Jupyter kernel.
type jupyterKernel struct {
	*jupyter.Kernel
	env envCode
}

func (j *jupyterKernel) Execute(ctx context.Context, code string, env map[string]string, out Output) error {
	if len(env) > 0 {
		set, restore := j.env(env)
		if reply, err := j.Kernel.Execute(ctx, set, true, func(*jupyter.Message) {}); err != nil {
			return err
		} else if reply.Status != "ok" {
			out.Error("EnvVarsError", "setting env_vars failed: "+reply.EName+": "+reply.EValue, strings.Join(reply.Traceback, "\n"))
			return nil
		}
		defer func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, _ = j.Kernel.Execute(ctx, restore, true, func(*jupyter.Message) {})
		}()
	}
	errored := false
	reply, err := j.Kernel.Execute(ctx, code, false, func(m *jupyter.Message) { forward(m, out, &errored) })
	if err != nil {
		return err
	}
	switch reply.Status {
	case "error":
		if !errored {
			out.Error(reply.EName, reply.EValue, plainText(strings.Join(reply.Traceback, "\n")))
		}
	case "abort", "aborted":
		out.Error("ExecutionAborted", "Execution was aborted", "")
	}
	return nil
}

// forward hands out one IOPub message of a run.
func forward(m *jupyter.Message, out Output, errored *bool) {
	switch m.Header.MsgType {
	case "execute_input":
		var c struct {
			Count int `json:"execution_count"`
		}
		if m.Decode(&c) == nil {
			out.Count(c.Count)
		}
	case "stream":
		var c struct{ Name, Text string }
		if m.Decode(&c) == nil && (c.Name == "stdout" || c.Name == "stderr") {
			out.Stream(c.Name, c.Text, m.Time())
		}
	case "display_data", "execute_result":
		var c struct {
			Data map[string]json.RawMessage `json:"data"`
		}
		if m.Decode(&c) == nil && len(c.Data) > 0 {
			out.Result(c.Data, m.Header.MsgType == "execute_result")
		}
	case "error":
		var c struct {
			EName     string   `json:"ename"`
			EValue    string   `json:"evalue"`
			Traceback []string `json:"traceback"`
		}
		if m.Decode(&c) == nil {
			out.Error(c.EName, c.EValue, plainText(strings.Join(c.Traceback, "\n")))
			*errored = true
		}
	}
}

// pythonEnv sets os.environ: the values travel base64-encoded, so no
// quote or newline in them can change the code.
func pythonEnv(env map[string]string) (set, restore string) {
	b, _ := json.Marshal(env)
	set = fmt.Sprintf(`import os as _cage_os, json as _cage_json, base64 as _cage_b64
_cage_new = _cage_json.loads(_cage_b64.b64decode(%q).decode())
_cage_saved_env = {k: _cage_os.environ.get(k) for k in _cage_new}
_cage_os.environ.update(_cage_new)
del _cage_os, _cage_json, _cage_b64, _cage_new`, base64.StdEncoding.EncodeToString(b))
	restore = `import os as _cage_os
for _cage_k, _cage_v in _cage_saved_env.items():
    if _cage_v is None:
        _cage_os.environ.pop(_cage_k, None)
    else:
        _cage_os.environ[_cage_k] = _cage_v
del _cage_os, _cage_k, _cage_v, _cage_saved_env`
	return set, restore
}

// rEnv sets R's environment from JSON in a raw string whose delimiter the
// JSON cannot hold.
func rEnv(env map[string]string) (set, restore string) {
	b, _ := json.Marshal(env)
	dashes := "-"
	for strings.Contains(string(b), "]"+dashes+`"`) {
		dashes += "-"
	}
	set = fmt.Sprintf(`local({ e <- jsonlite::fromJSON(r"%s[%s]%s"); assign(".cage_saved_env", Sys.getenv(names(e), unset = NA, names = TRUE), envir = globalenv()); do.call(Sys.setenv, e) })`,
		dashes, b, dashes)
	restore = `local({ s <- get(".cage_saved_env", envir = globalenv()); for (k in names(s)) { if (is.na(s[[k]])) Sys.unsetenv(k) else do.call(Sys.setenv, stats::setNames(list(s[[k]]), k)) }; rm(".cage_saved_env", envir = globalenv()) })`
	return set, restore
}

// ansiEscape matches a terminal's control sequences (colours, cursor).
var ansiEscape = regexp.MustCompile(`\x1b\[[0-9;?]*[ -/]*[@-~]`)

// plainText is a traceback without the colours a kernel may paint it with
// (IPython does unless configured NoColor): the SDK shows it as text.
func plainText(s string) string { return ansiEscape.ReplaceAllString(s, "") }

// missingCommand says a command is not installed ("" when it is).
func missingCommand(name, pkg string) string {
	if _, err := exec.LookPath(name); err != nil {
		return fmt.Sprintf("%s is not installed (Debian package %s)", name, pkg)
	}
	return ""
}
