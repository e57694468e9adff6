// Package cli is cage's command line: `cage run`, `cage doctor`, and later
// the daemon's client commands. Errors reach the user as one line and a
// distinct exit code; no Go panic or stack trace ever does.
package cli

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime/debug"

	"github.com/spf13/cobra"

	"github.com/cagehq/cage/internal/sandbox"
)

// Exit codes of cage itself. A command run in a sandbox passes its own code
// through; these are chosen to stay clear of the common ones (sysexits.h,
// and 124-127 as timeout(1) and shells use them).
const (
	ExitUsage       = 64  // malformed flags or limits, limits too small
	ExitNoTemplate  = 66  // unknown template
	ExitNotFoundObj = 66  // no such sandbox (the daemon's commands)
	ExitUnavailable = 69  // the host lacks a kernel feature or a part
	ExitNoPerm      = 77  // not root
	ExitTimeout     = 124 // the sandbox's wall-clock timeout expired
	ExitInternal    = 125 // cage failed to create or run the sandbox
	ExitNotExec     = 126 // the command exists but cannot be executed
	ExitNotFound    = 127 // the command does not exist in the sandbox
)

// exitError carries an exit code; msg is printed unless empty.
type exitError struct {
	code int
	msg  string
}

func (e *exitError) Error() string { return e.msg }

func exitf(code int, format string, args ...any) error {
	return &exitError{code: code, msg: fmt.Sprintf(format, args...)}
}

// exitCode returns the code for err and the line to print.
func exitCode(err error) (int, string) {
	var ee *exitError
	switch {
	case errors.As(err, &ee):
		return ee.code, ee.msg
	case errors.Is(err, sandbox.ErrInvalid):
		return ExitUsage, err.Error()
	case errors.Is(err, sandbox.ErrNotFound):
		return ExitNoTemplate, err.Error()
	case errors.Is(err, sandbox.ErrPermission):
		return ExitNoPerm, err.Error()
	case errors.Is(err, sandbox.ErrUnavailable):
		return ExitUnavailable, err.Error()
	}
	return ExitInternal, err.Error()
}

type globals struct {
	debug  bool
	runDir string
	log    *slog.Logger
}

// Main runs the command line and returns the process's exit code.
func Main(args []string, stdout, stderr io.Writer) (code int) {
	defer func() {
		if r := recover(); r != nil {
			fmt.Fprintf(stderr, "cage: internal error: %v\n", r)
			if os.Getenv("CAGE_DEBUG") != "" {
				fmt.Fprintf(stderr, "%s\n", debug.Stack())
			}
			code = ExitInternal
		}
	}()
	g := &globals{}
	root := &cobra.Command{
		Use:           "cage",
		Short:         "Disposable sandboxes for AI agents",
		SilenceErrors: true,
		SilenceUsage:  true,
		PersistentPreRun: func(cmd *cobra.Command, _ []string) {
			level := slog.LevelWarn
			if g.debug {
				level = slog.LevelDebug
			}
			g.log = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
		},
	}
	root.PersistentFlags().BoolVar(&g.debug, "debug", false, "log what cage does")
	root.PersistentFlags().StringVar(&g.runDir, "run-dir", envOr("CAGE_RUN_DIR", "/run/cage"), "runtime state directory")
	root.AddCommand(newRunCmd(g), newDoctorCmd(g), newBenchCmd(g), newServeCmd(g), newKeysCmd(g), newTeamsCmd(), newTemplateCmd(g), newAuditCmd())
	root.AddCommand(newClientCmds(g)...)
	root.AddCommand(newMCPCmd(), newClusterCmd())
	usageErrors(root)
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error {
		return exitf(ExitUsage, "%v", err)
	})
	err := root.Execute()
	if err == nil {
		return 0
	}
	code, msg := exitCode(err)
	if msg != "" {
		// A message may quote what a sandbox's agent or a client wrote.
		fmt.Fprintln(stderr, "cage: "+termSafeLines(msg))
	}
	return code
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

// usageErrors makes every argument-count error of the command tree a usage
// error (exit 64) with the command's usage line.
func usageErrors(cmd *cobra.Command) {
	if check := cmd.Args; check != nil {
		cmd.Args = func(c *cobra.Command, args []string) error {
			if err := check(c, args); err != nil {
				var ee *exitError
				if errors.As(err, &ee) {
					return err
				}
				return exitf(ExitUsage, "%v (usage: %s)", err, c.UseLine())
			}
			return nil
		}
	}
	for _, sub := range cmd.Commands() {
		usageErrors(sub)
	}
}
