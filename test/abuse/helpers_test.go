package abuse

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// runSh runs `sh -c script` through ac for up to a minute; a non-zero exit
// is an error.
func runSh(ac *agentclient.Client, script string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out, errb bytes.Buffer
	end, err := ac.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", script}, Stdout: &out, Stderr: &errb})
	if err != nil {
		return out.String(), err
	}
	if end.GetExitCode() != 0 {
		return out.String(), fmt.Errorf("exit %d: %s", end.GetExitCode(), errb.String())
	}
	return out.String(), nil
}

// sandboxDirs lists the sandboxes whose state directories are on the host.
func sandboxDirs(d *cageserve.Daemon) []string {
	ents, _ := os.ReadDir(filepath.Join(d.RunDir, "sandboxes"))
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}
