package oci_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/hostproc"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/wall"
)

// creatorEnv makes this test binary the creator of TestAdoptAfterKill's
// sandbox: it creates one on the wall named, prints it and waits to be
// killed.
const creatorEnv = "CAGE_TEST_OCI_CREATOR"

func newHost(t *testing.T, runDir string) *sandbox.Host {
	t.Helper()
	h, err := sandbox.NewHost(runDir, filepath.Join(testutil.Binaries(t), "cage-agent"), nil)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// TestAdoptAfterKill: the creator of an OCI sandbox dies by SIGKILL (a
// daemon crashing); the sandbox runs on, and a new process adopts it and
// reaches its agent. Under gVisor the agent connects to the host, whose
// socket the new process makes anew, so this is the agent reconnecting by
// itself; under runc the host dials the socket it made.
func TestAdoptAfterKill(t *testing.T) {
	if w := os.Getenv(creatorEnv); w != "" {
		create(t, w)
		return
	}
	testutil.RequireRoot(t)
	for _, w := range []string{"runc", "gvisor"} {
		t.Run(w, func(t *testing.T) {
			runDir := testutil.RunDir(t)
			h := newHost(t, runDir)
			if err := h.WallMissing(w); err != nil {
				testutil.SkipWall(t, w, "%v", err)
			}
			cmd := exec.Command(os.Args[0], "-test.run=^TestAdoptAfterKill$", "-test.count=1")
			cmd.Env = append(os.Environ(), creatorEnv+"="+w, "CAGE_TEST_RUN_DIR="+runDir,
				"CAGE_TEST_BIN="+testutil.Binaries(t))
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			var id, token string
			var pid int
			var start uint64
			line, err := bufio.NewReader(out).ReadString('\n')
			if _, serr := fmt.Sscan(line, &id, &pid, &start, &token); err != nil || serr != nil {
				_ = cmd.Process.Kill()
				_ = cmd.Wait()
				t.Fatalf("the creator said %q (%v, %v): %s", line, err, serr, stderr.String())
			}
			_ = cmd.Process.Signal(syscall.SIGKILL)
			_ = cmd.Wait()
			if st, err := hostproc.StartTime(pid); err != nil || st != start {
				t.Fatalf("the sandbox died with its creator")
			}
			sb, err := h.Adopt(w, wall.Adoption{ID: id, PID: pid, StartTime: start, Token: token, Slot: -1})
			if err != nil {
				t.Fatalf("adopt: %v", err)
			}
			defer func() {
				if err := sb.Destroy(); err != nil {
					t.Errorf("destroy: %v", err)
				}
			}()
			c := agentclient.New(sb.Dial, sb.Token())
			defer c.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var got strings.Builder
			end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", "cat /tmp/before"}, Stdout: &got})
			if err != nil || end.GetExitCode() != 0 || got.String() != "written by the creator\n" {
				t.Errorf("a command in the adopted sandbox: %v %v %q", err, end, got.String())
			}
		})
	}
}

// create is the creator's side: a sandbox with a file written, printed as
// "id pid start token", then wait for SIGKILL.
func create(t *testing.T, w string) {
	h, err := sandbox.NewHost(os.Getenv("CAGE_TEST_RUN_DIR"), filepath.Join(os.Getenv("CAGE_TEST_BIN"), "cage-agent"), nil)
	if err != nil {
		t.Fatal(err)
	}
	sb, err := h.Create(context.Background(), sandbox.Options{Wall: w})
	if err != nil {
		t.Fatal(err)
	}
	c := agentclient.New(sb.Dial, sb.Token())
	end, err := c.Run(context.Background(), agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", "echo written by the creator > /tmp/before"}})
	if err != nil || end.GetExitCode() != 0 {
		t.Fatalf("write: %v %v", err, end)
	}
	st, err := hostproc.StartTime(sb.AgentPID())
	if err != nil {
		t.Fatal(err)
	}
	fmt.Printf("%s %d %d %s\n", sb.ID(), sb.AgentPID(), st, sb.Token())
	time.Sleep(time.Hour)
}
