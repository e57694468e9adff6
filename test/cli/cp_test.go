package clitest

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cagehq/cage/internal/testutil"
)

// cpDaemon is a `cage serve` of the test's own (data, run directory,
// ports), whose sandboxes `cage cp` copies out of.
type cpDaemon struct {
	e   *env
	env []string // CAGE_HOST, CAGE_PROXY_URL, CAGE_API_KEY
}

func startCpDaemon(t *testing.T, e *env) *cpDaemon {
	t.Helper()
	data := t.TempDir()
	out, err := e.command(context.Background(), "keys", "create", "--data", data, "--name", "cp").Output()
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if err != nil || !strings.HasPrefix(lines[len(lines)-1], "e2b_") {
		t.Fatalf("cage keys create: %v, %q", err, out)
	}
	api, proxy := testutil.FreeLoopback(t), testutil.FreeLoopback(t)
	cmd := e.command(context.Background(), "serve", "--data", data, "--api", api, "--proxy", proxy, "--pool", "0")
	var log bytes.Buffer
	cmd.Stdout, cmd.Stderr = &log, &log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("cage serve:\n%s", log.String())
		}
	})
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if resp, err := http.Get("http://" + api + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("cage serve did not answer /health:\n%s", log.String())
		}
	}
	return &cpDaemon{e: e, env: []string{"CAGE_HOST=http://" + api, "CAGE_PROXY_URL=http://" + proxy, "CAGE_API_KEY=" + lines[len(lines)-1]}}
}

func (d *cpDaemon) cage(args ...string) result {
	d.e.t.Helper()
	return d.e.cageEnv(nil, d.env, args...)
}

// create makes a sandbox (host template, no network) and returns its id.
func (d *cpDaemon) create(t *testing.T, args ...string) string {
	t.Helper()
	r := d.cage(append([]string{"create", "--timeout", "5m"}, args...)...)
	id := strings.TrimSpace(r.stdout)
	if r.code != 0 || id == "" {
		t.Fatalf("cage create: %v", r)
	}
	t.Cleanup(func() { d.cage("rm", id) })
	return id
}

func (d *cpDaemon) sh(t *testing.T, id, script string) {
	t.Helper()
	if r := d.cage("exec", id, "--", "sh", "-c", script); r.code != 0 {
		t.Fatalf("in the sandbox: %q: %v", script, r)
	}
}

// smallDisk mounts a tmpfs of 256 MiB as the copies' destination: were a
// bound not kept, the copy would fill it, never the host's disk.
func smallDisk(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=256m"); err != nil {
		t.Fatalf("mount a tmpfs for the destination: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// empty checks that dir holds only the names in keep: nothing half-written,
// no stage left behind.
func empty(t *testing.T, what, dir string, keep ...string) {
	t.Helper()
	es, _ := os.ReadDir(dir)
	var names []string
	for _, e := range es {
		names = append(names, e.Name())
	}
	if strings.Join(names, ",") != strings.Join(keep, ",") {
		t.Errorf("%s: %s holds %q, want %q", what, dir, names, keep)
	}
}

// TestCpOutBounded: copies out of a sandbox are bounded in bytes and
// entries, keep holes as holes, and a refused copy is one line, exit 64,
// and leaves nothing on the host.
func TestCpOutBounded(t *testing.T) {
	e := setup(t)
	d := startCpDaemon(t, e)
	id := d.create(t)
	// A sparse file of 1 TiB costs the sandbox nothing.
	d.sh(t, id, `set -e; truncate -s 1T /tmp/huge; mkdir -p /tmp/hugedir/sub; truncate -s 1T /tmp/hugedir/sub/huge
mkdir /tmp/many; i=0; while [ $i -lt 50 ]; do : > /tmp/many/f$i; i=$((i+1)); done
truncate -s 64M /tmp/sparse; printf x | dd of=/tmp/sparse bs=1 seek=33554432 conv=notrunc 2>/dev/null
mkdir /tmp/sparsedir; cp --sparse=always /tmp/sparse /tmp/sparsedir/sparse`)

	dst := smallDisk(t)
	for _, c := range []struct{ what, src, flag string }{
		{"a 1 TiB sparse file", id + ":/tmp/huge", "--max-bytes"},
		{"a directory holding a 1 TiB sparse file", id + ":/tmp/hugedir", "--max-bytes"},
		{"a directory of 50 files with --max-entries 20", id + ":/tmp/many", "--max-entries"},
		{"a 64 MiB sparse file with --max-bytes 16M", id + ":/tmp/sparse", "--max-bytes"},
	} {
		args := []string{"cp", c.src, filepath.Join(dst, "out")}
		switch {
		case strings.Contains(c.what, "--max-entries"):
			args = append(args, "--max-entries", "20")
		case strings.Contains(c.what, "--max-bytes 16M"):
			args = append(args, "--max-bytes", "16M")
		}
		r := d.cage(args...)
		if r.code != exitUsage {
			t.Errorf("cage cp of %s: %v; want it refused with exit %d", c.what, r, exitUsage)
		}
		oneLine(t, "cage cp of "+c.what, r.stderr, c.flag, "nothing was copied")
		empty(t, "after the refused copy of "+c.what, dst)
	}

	// Within the bounds, holes stay holes: 64 MiB of file, a block of disk.
	for _, src := range []string{"/tmp/sparse", "/tmp/sparsedir"} {
		out := filepath.Join(dst, filepath.Base(src))
		if r := d.cage("cp", id+":"+src, out); r.code != 0 {
			t.Fatalf("cage cp %s: %v", src, r)
		}
		p := out
		if src == "/tmp/sparsedir" {
			p = filepath.Join(out, "sparse")
		}
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil || st.Size != 64<<20 || st.Blocks*512 > 1<<20 {
			t.Errorf("%s copied out: %d bytes taking %d bytes of disk (%v); want 64 MiB in at most 1 MiB", src, st.Size, st.Blocks*512, err)
		}
		f, _ := os.Open(p)
		b := make([]byte, 1)
		if _, err := f.ReadAt(b, 32<<20); err != nil || b[0] != 'x' {
			t.Errorf("%s copied out: byte at 32 MiB %q, %v; want x", src, b, err)
		}
		f.Close()
	}
	empty(t, "after the copies", dst, "sparse", "sparsedir")

	for _, args := range [][]string{{"--max-bytes", "0"}, {"--max-bytes", "lots"}, {"--max-entries", "0"}} {
		r := d.cage(append([]string{"cp", id + ":/tmp/sparse", filepath.Join(dst, "bad")}, args...)...)
		if r.code != exitUsage {
			t.Errorf("cage cp %v: %v; want exit %d", args, r, exitUsage)
		}
		oneLine(t, "cage cp "+strings.Join(args, " "), r.stderr, args[0])
	}
}

// TestCpOutHostileTar: the sandbox decides what its "tar" sends (here a
// script first on its PATH). Streams built to write through a symlink, to
// link a host file, to name a huge sparse file or to run past the output
// cap are refused, one line, nothing written outside the destination and
// nothing left in it.
func TestCpOutHostileTar(t *testing.T) {
	e := setup(t)
	d := startCpDaemon(t, e)
	id := d.create(t, "--env", "PATH=/tmp/evil:/usr/local/bin:/usr/bin:/bin")
	parent := smallDisk(t)
	outside := filepath.Join(parent, "outside")
	if err := os.Mkdir(outside, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(outside, "canary"), []byte("canary"), 0o644); err != nil {
		t.Fatal(err)
	}
	streams := map[string][]byte{
		"through-symlink": tarStream(t, tar.Header{Name: "evil", Typeflag: tar.TypeSymlink, Linkname: "../outside"},
			tar.Header{Name: "evil/canary", Typeflag: tar.TypeReg, Size: 5}),
		"hardlink-out": tarStream(t, tar.Header{Name: "f", Typeflag: tar.TypeReg, Size: 5},
			tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "../outside/canary"}),
		"dotdot": tarStream(t, tar.Header{Name: "../outside/canary", Typeflag: tar.TypeReg, Size: 5}),
	}
	for name, b := range streams {
		p := filepath.Join(t.TempDir(), name+".tar")
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		if r := d.cage("cp", p, id+":/tmp/streams/"); r.code != 0 {
			t.Fatalf("cage cp %s into the sandbox: %v", name, r)
		}
	}
	d.sh(t, id, `set -e; mkdir -p /tmp/evil /tmp/src /tmp/sp; truncate -s 1T /tmp/sp/huge
mkdir /tmp/big; head -c 70000000 /dev/urandom > /tmp/big/random
printf '#!/bin/sh\ncase "$(cat /tmp/mode)" in\nsparse) exec /usr/bin/tar -c -S -C /tmp/sp . ;;\nbig) exec /usr/bin/tar -c -C /tmp/big . ;;\n*) exec cat /tmp/streams/$(cat /tmp/mode).tar ;;\nesac\n' > /tmp/evil/tar
chmod +x /tmp/evil/tar`)
	for _, c := range []struct{ mode, want string }{
		{"through-symlink", "not a directory"},
		{"hardlink-out", "leaves the destination"},
		{"dotdot", "leaves the destination"},
		{"sparse", "--max-bytes"},
		{"big", "output limit"},
	} {
		d.sh(t, id, "printf %s "+c.mode+" > /tmp/mode")
		dst := filepath.Join(parent, "dst")
		r := d.cage("cp", id+":/tmp/src", dst)
		if r.code == 0 {
			t.Errorf("cage cp of the %s stream: %v; want it refused", c.mode, r)
		}
		oneLine(t, "cage cp of the "+c.mode+" stream", r.stderr, c.want)
		empty(t, "after the "+c.mode+" stream", parent, "outside")
		empty(t, "after the "+c.mode+" stream", outside, "canary")
		if b, _ := os.ReadFile(filepath.Join(outside, "canary")); string(b) != "canary" {
			t.Errorf("the %s stream changed the canary: %q", c.mode, b)
		}
	}
}

// tarStream is a tar of headers, each regular file holding "pwned".
func tarStream(t *testing.T, hs ...tar.Header) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range hs {
		h.Mode = 0o644
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			io.WriteString(tw, "pwned")
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}
