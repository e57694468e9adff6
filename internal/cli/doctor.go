package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/hostcheck"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/sandbox"
)

func newDoctorCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "doctor",
		Short: "Check what this host can run, wall by wall",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !doctor(cmd.Context(), g, cmd.OutOrStdout()) {
				return &exitError{code: ExitUnavailable}
			}
			return nil
		},
	}
}

type check struct {
	name string
	ok   bool
	info string
}

func printChecks(w io.Writer, title string, cs []check) {
	fmt.Fprintln(w, title)
	for _, c := range cs {
		mark := "ok  "
		if !c.ok {
			mark = "FAIL"
		}
		fmt.Fprintf(w, "  [%s] %-22s %s\n", mark, c.name, c.info)
	}
}

// doctor prints the host's facts and each wall's state; it reports whether
// the default wall works.
func doctor(ctx context.Context, g *globals, w io.Writer) bool {
	var host []check
	for _, c := range hostcheck.Host() {
		host = append(host, check{c.Name, c.OK, c.Info})
	}
	printChecks(w, "host:", host)

	var netChecks []check
	upstreams, err := network.ParseUpstreams(strings.Split(os.Getenv("CAGE_DNS"), ","))
	if err != nil {
		netChecks = append(netChecks, check{"CAGE_DNS", false, err.Error()})
	}
	for _, f := range network.Readiness(upstreams) {
		netChecks = append(netChecks, check{f.Name, f.OK, f.Info})
	}
	printChecks(w, "network (for --net internet|allowlist):", netChecks)

	var walls []check
	processOK := false
	for _, w := range sandbox.Walls {
		ok, info := probeWall(ctx, g, w)
		walls = append(walls, check{w, ok, info})
		if w == "process" {
			processOK = ok
		}
	}
	if _, err := exec.LookPath("crun"); err == nil {
		walls = append(walls, check{"(crun)", false, "installed but unused: crun 1.8 refuses hybrid cgroup hosts; cage runs runc"})
	}
	printChecks(w, "walls:", walls)
	return processOK
}

func ifElse(c bool, a, b string) string {
	if c {
		return a
	}
	return b
}

// probeWall creates a real sandbox on a wall and runs `true` in it.
func probeWall(ctx context.Context, g *globals, wallName string) (bool, string) {
	h, err := sandbox.NewHost(g.runDir, "", g.log)
	if err != nil {
		return false, err.Error()
	}
	if err := h.WallMissing(wallName); err != nil {
		return false, err.Error()
	}
	// A wall whose sandboxes start from an image (microvm: base) needs
	// the template store.
	if h.Templates, err = openTemplates(""); err != nil {
		return false, err.Error()
	}
	if ctx == nil {
		ctx = context.Background()
	}
	// The first microvm of a template makes its image and snapshot.
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	start := time.Now()
	sb, err := h.Create(ctx, sandbox.Options{Wall: wallName, DieWithCaller: true})
	if err != nil {
		if errors.Is(err, sandbox.ErrNotFound) {
			return false, "create failed: the wall's default template is not in the store (make base builds base): " + err.Error()
		}
		return false, "create failed: " + err.Error()
	}
	defer sb.Destroy()
	c := agentclient.New(sb.Dial, sb.Token())
	defer c.Close()
	end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "true", Stdout: io.Discard, Stderr: io.Discard})
	if err != nil {
		select {
		case <-sb.Exited():
			err = sb.Err()
		default:
		}
		return false, "run failed: " + err.Error()
	}
	if end.GetExitCode() != 0 {
		return false, fmt.Sprintf("`true` exited %d", end.GetExitCode())
	}
	note := ""
	if d := h.Describe(ctx, wallName); d != "" {
		note = " (" + d + ")"
	}
	return true, fmt.Sprintf("works: create → `true` ended in %v%s", time.Since(start).Round(100*time.Microsecond), note)
}
