package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	pb "github.com/cagehq/cage/api/gen/process"
	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/agent"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/client"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/units"
)

// The daemon's client commands: create, ls, exec, cp, rm, inspect.

type daemonFlags struct {
	host, proxy, key string
	json             bool
}

func (d *daemonFlags) register(cmd *cobra.Command) {
	fl := cmd.PersistentFlags()
	fl.StringVar(&d.host, "host", envOr("CAGE_HOST", "http://127.0.0.1:3000"), "the daemon's control API ($CAGE_HOST)")
	fl.StringVar(&d.proxy, "proxy-url", envOr("CAGE_PROXY_URL", "http://127.0.0.1:3001"), "the daemon's sandbox proxy ($CAGE_PROXY_URL)")
	fl.StringVar(&d.key, "key", os.Getenv("CAGE_API_KEY"), "API key ($CAGE_API_KEY)")
	fl.BoolVar(&d.json, "json", false, "print JSON")
}

func (d *daemonFlags) client() (*client.Client, error) {
	if d.key == "" {
		return nil, exitf(ExitUsage, "no API key: set CAGE_API_KEY or pass --key (create one with `cage keys create`)")
	}
	return client.New(d.host, d.proxy, d.key), nil
}

// apiFailure turns a client error into cage's exit codes.
func apiFailure(err error) error {
	var ae *client.APIError
	switch {
	case errors.Is(err, client.ErrNotRunning):
		return exitf(ExitUnavailable, "%v (start it with `cage serve`, or point CAGE_HOST / --host at it)", err)
	case errors.As(err, &ae):
		switch ae.Status {
		case 400, 413:
			return exitf(ExitUsage, "%s", ae.Message)
		case 401:
			return exitf(ExitNoPerm, "%s", ae.Message)
		case 404:
			return exitf(ExitNotFoundObj, "%s", ae.Message)
		}
		return exitf(ExitInternal, "%s (HTTP %d)", ae.Message, ae.Status)
	}
	return exitf(ExitInternal, "%v", err)
}

func jsonEncoder(w io.Writer) *json.Encoder {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc
}

func parseKV(flag string, kvs []string) (map[string]string, error) {
	m := map[string]string{}
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, exitf(ExitUsage, "--%s %q: want K=V", flag, kv)
		}
		m[k] = v
	}
	return m, nil
}

func newClientCmds(g *globals) []*cobra.Command {
	d := &daemonFlags{}
	cmds := []*cobra.Command{newCreateCmd(d), newLsCmd(d), newExecCmd(d), newCpCmd(d), newRmCmd(d), newInspectCmd(d),
		newPauseCmd(d), newResumeCmd(d), newSnapshotCmd(d), newForkCmd(d)}
	for _, c := range cmds {
		d.register(c)
	}
	return cmds
}

func newCreateCmd(d *daemonFlags) *cobra.Command {
	var template, memory, disk, timeout, wallName string
	var cpus float64
	var pids int64
	var env, meta []string
	var nf netFlags
	cmd := &cobra.Command{
		Use:   "create",
		Short: "Create a sandbox in the daemon; prints its id",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := d.client()
			if err != nil {
				return err
			}
			body := types.NewSandboxV2{TemplateID: template, Wall: types.Wall(wallName), CPUCount: max(cpus, 0),
				Pids: max(pids, 0)}
			if timeout != "" {
				t, err := units.ParseDuration(timeout)
				if err != nil || t < time.Second {
					return exitf(ExitUsage, "--timeout %q: want at least 1s", timeout)
				}
				secs := int64(t / time.Second)
				body.Timeout = &secs
			}
			for _, f := range []struct {
				flag string
				dst  *int64
			}{{memory, &body.MemoryMB}, {disk, &body.DiskSizeMB}} {
				if f.flag == "" {
					continue
				}
				n, err := units.ParseSize(f.flag)
				if err != nil {
					return exitf(ExitUsage, "%v", err)
				}
				*f.dst = n >> 20
			}
			if body.EnvVars, err = parseKV("env", env); err != nil {
				return err
			}
			if body.Metadata, err = parseKV("metadata", meta); err != nil {
				return err
			}
			// cage's default is no network (E2B's routes default to the
			// internet when a client says nothing).
			p, err := nf.policy()
			if err != nil {
				return err
			}
			body.Network = networkBody(p)
			sb, err := c.Create(ctx(cmd), body)
			if err != nil {
				return apiFailure(err)
			}
			if d.json {
				// The create answer lacks the times, state and metadata.
				full, err := c.Get(ctx(cmd), sb.SandboxID)
				if err != nil {
					return apiFailure(err)
				}
				return jsonEncoder(cmd.OutOrStdout()).Encode(full)
			}
			fmt.Fprintln(cmd.OutOrStdout(), sb.SandboxID)
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&template, "template", "host", "template")
	fl.StringVar(&wallName, "wall", "", "isolation: process, runc, gvisor (default: the server's)")
	fl.StringVar(&timeout, "timeout", "", "lifetime (default: the server's, 300s)")
	fl.StringVar(&memory, "memory", "", "memory limit (e.g. 512M)")
	fl.StringVar(&disk, "disk", "", "writable storage size")
	fl.Float64Var(&cpus, "cpus", 0, "CPU limit in cores")
	fl.Int64Var(&pids, "pids", 0, "process limit")
	fl.StringArrayVarP(&env, "env", "e", nil, "environment K=V (repeatable)")
	fl.StringArrayVar(&meta, "metadata", nil, "metadata K=V (repeatable)")
	nf.add(fl)
	return cmd
}

// networkBody is a policy as the API's network field.
func networkBody(p network.Policy) types.SandboxNetworkConfig {
	n := types.SandboxNetworkConfig{Mode: types.NetworkMode(p.Mode)}
	for _, r := range p.Allow {
		n.AllowOut = append(n.AllowOut, r.String())
	}
	for _, r := range p.Deny {
		n.DenyOut = append(n.DenyOut, r.String())
	}
	return n
}

func ctx(cmd *cobra.Command) context.Context {
	if c := cmd.Context(); c != nil {
		return c
	}
	return context.Background()
}

func newLsCmd(d *daemonFlags) *cobra.Command {
	var meta []string
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List running sandboxes",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := d.client()
			if err != nil {
				return err
			}
			md, err := parseKV("metadata", meta)
			if err != nil {
				return err
			}
			list, err := c.List(ctx(cmd), md)
			if err != nil {
				return apiFailure(err)
			}
			if d.json {
				if list == nil {
					list = []types.ListedSandbox{}
				}
				return jsonEncoder(cmd.OutOrStdout()).Encode(list)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tTEMPLATE\tWALL\tSTARTED\tENDS IN\tCPUS\tMEMORY")
			for _, s := range list {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%g\t%dMiB\n", termSafe(s.SandboxID), termSafe(s.TemplateID), termSafe(string(s.Wall)),
					s.StartedAt.Local().Format("15:04:05"), time.Until(s.EndAt).Round(time.Second), s.CPUCount, s.MemoryMB)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringArrayVar(&meta, "metadata", nil, "only sandboxes with metadata K=V (repeatable)")
	return cmd
}

func newInspectCmd(d *daemonFlags) *cobra.Command {
	return &cobra.Command{
		Use:   "inspect ID",
		Short: "Show a sandbox",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := d.client()
			if err != nil {
				return err
			}
			sb, err := c.Get(ctx(cmd), args[0])
			if err != nil {
				return apiFailure(err)
			}
			if d.json {
				return jsonEncoder(cmd.OutOrStdout()).Encode(sb)
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "id:        %s\ntemplate:  %s\nwall:      %s\nstate:     %s\nstarted:   %s\nends:      %s (in %s)\n",
				termSafe(sb.SandboxID), termSafe(sb.TemplateID), termSafe(string(sb.Wall)), termSafe(string(sb.State)), sb.StartedAt.Local().Format(time.RFC3339),
				sb.EndAt.Local().Format(time.RFC3339), time.Until(sb.EndAt).Round(time.Second))
			fmt.Fprintf(w, "limits:    %g cpus, %d MiB memory, %d MiB disk, %d pids\n", sb.CPUCount, sb.MemoryMB, sb.DiskSizeMB, sb.Pids)
			for k, v := range sb.Metadata {
				fmt.Fprintf(w, "metadata:  %s=%s\n", termSafe(k), termSafe(v))
			}
			return nil
		},
	}
}

func newRmCmd(d *daemonFlags) *cobra.Command {
	return &cobra.Command{
		Use:   "rm ID...",
		Short: "Destroy sandboxes",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := d.client()
			if err != nil {
				return err
			}
			var first error
			for _, id := range args {
				if err := c.Kill(ctx(cmd), id); err != nil {
					fmt.Fprintf(cmd.ErrOrStderr(), "cage: %s: %s\n", termSafe(id), termSafeLines(err.Error()))
					if first == nil {
						first = apiFailure(err)
					}
					continue
				}
				if !d.json {
					fmt.Fprintln(cmd.OutOrStdout(), id)
				}
			}
			if first != nil {
				var ee *exitError
				if errors.As(first, &ee) {
					return &exitError{code: ee.code}
				}
			}
			return nil
		},
	}
}

func newExecCmd(d *daemonFlags) *cobra.Command {
	var workdir, user, tty string
	var env []string
	cmd := &cobra.Command{
		Use:   "exec ID -- CMD [ARGS...]",
		Short: "Run a command in a running sandbox; exits with its code",
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) < 2 || (args[1] == "--" && len(args) < 3) {
				return exitf(ExitUsage, "usage: cage exec ID -- CMD [ARGS...]")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if args[1] == "--" { // flags stop at the id, so "--" arrives as an argument
				args = append(args[:1], args[2:]...)
			}
			c, err := d.client()
			if err != nil {
				return err
			}
			envs, err := parseKV("env", env)
			if err != nil {
				return err
			}
			sb, err := c.Get(ctx(cmd), args[0])
			if err != nil {
				return apiFailure(err)
			}
			ac, err := c.Agent(sb.SandboxID, sb.EnvdAccessToken)
			if err != nil {
				return exitf(ExitUsage, "%v", err)
			}
			defer ac.Close()
			opts := agentclient.RunOptions{Cmd: args[1], Args: args[2:], Cwd: workdir, User: user, Env: envs,
				Stdout: cmd.OutOrStdout(), Stderr: cmd.ErrOrStderr()}
			return execIn(ctx(cmd), ac, opts, tty, sb)
		},
	}
	cmd.Flags().SetInterspersed(false)
	fl := cmd.Flags()
	fl.StringVarP(&workdir, "workdir", "w", "", "working directory")
	fl.StringVarP(&user, "user", "u", "", "user (default: the sandbox's)")
	fl.StringArrayVarP(&env, "env", "e", nil, "environment K=V (repeatable)")
	fl.StringVar(&tty, "tty", "auto", "PTY: auto, always, never")
	return cmd
}

// execIn runs a command in a daemon's sandbox with the caller's terminal.
func execIn(ctx context.Context, ac *agentclient.Client, opts agentclient.RunOptions, tty string, sb *types.SandboxDetail) error {
	if opts.MaxOutput == 0 {
		// The agent's own bound, counted here too: the agent is inside
		// the wall, and one that ignored it wrote without end.
		opts.MaxOutput = agent.DefaultMaxOutput
	}
	var restore func()
	gaveUp := make(chan struct{}) // closed at the second signal
	if tty == "always" || (tty == "auto" && term.IsTerminal(int(os.Stdin.Fd()))) {
		// Undone on every way out (a second signal included): a
		// terminal left raw echoes nothing and ignores Ctrl-C.
		restore = sync.OnceFunc(setupPTY(ctx, ac, &opts))
		defer restore()
	} else {
		opts.Stdin = os.Stdin
	}
	// With a terminal too: raw, it sends no SIGINT of its own, but a
	// SIGTERM or SIGHUP from outside (a closed terminal) ended cage exec
	// at once, its terminal left raw and the command running.
	var pid atomic.Uint32
	var giveUp sync.Once
	stop := forwardSignals(ctx, ac, &opts, func() {
		// The second signal kills the command and ends cage exec
		// whatever the agent does: it is inside the wall, and one
		// that never ends the stream (or never answers) held cage
		// exec through every SIGINT, SIGTERM and SIGHUP.
		if p := pid.Load(); p != 0 {
			sel := &pb.ProcessSelector{Selector: &pb.ProcessSelector_Pid{Pid: p}}
			sctx, cancel := context.WithTimeout(ctx, signalWait)
			_, _ = ac.Process.SendSignal(sctx, connect.NewRequest(&pb.SendSignalRequest{Process: sel, Signal: pb.Signal_SIGNAL_SIGKILL}))
			cancel()
		}
		giveUp.Do(func() { close(gaveUp) })
	})
	prev := opts.OnStart
	opts.OnStart = func(p uint32) {
		pid.Store(p)
		if prev != nil {
			prev(p)
		}
	}
	defer stop()
	type ran struct {
		end *pb.ProcessEvent_EndEvent
		err error
	}
	result := make(chan ran, 1)
	go func() {
		end, err := ac.Run(ctx, opts)
		result <- ran{end, err}
	}()
	var end *pb.ProcessEvent_EndEvent
	var err error
	select {
	case r := <-result:
		end, err = r.end, r.err
	case <-gaveUp:
		return exitf(130, "interrupted; the command was sent SIGKILL")
	}
	if restore != nil {
		restore()
	}
	if err != nil {
		if e := commandRefused(err); e != nil {
			return e
		}
		if errors.Is(err, client.ErrNotRunning) {
			return apiFailure(err)
		}
		return exitf(ExitInternal, "%v", err)
	}
	return exitFromEnd(end, opts.Cmd, sb.MemoryMB<<20, sb.Pids, os.Stderr)
}
