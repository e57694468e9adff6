package cli

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Attack: root runs cage template build on a context another host user
// owns (a checkout of theirs). Its Dockerfile is a link to a file only
// root may read (the parse error then quoted its first line: a password
// hash of /etc/shadow), or a FIFO (root's build waited at its open for
// good, before an interrupt could stop it cleanly). Expected: each is
// refused at once with a line naming the Dockerfile; a link inside the
// context (Dockerfile -> docker/Dockerfile) and a regular file named by
// -f are read.
func TestOpenDockerfileHostile(t *testing.T) {
	ctxDir, outside := t.TempDir(), t.TempDir()
	secret := filepath.Join(outside, "shadow")
	if err := os.WriteFile(secret, []byte("root:$6$SECRET-HASH:19000:0:99999:7:::\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(outside, "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(ctxDir, "docker"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(ctxDir, "docker", "Dockerfile"), []byte("FROM bb\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	open := func(ctxDir, file string) (string, error) {
		type res struct {
			body string
			err  error
		}
		done := make(chan res, 1)
		go func() {
			f, _, err := openDockerfile(ctxDir, file)
			if err != nil {
				done <- res{err: err}
				return
			}
			defer f.Close()
			b, err := io.ReadAll(f)
			done <- res{string(b), err}
		}()
		select {
		case r := <-done:
			return r.body, r.err
		case <-time.After(10 * time.Second):
			// Let the blocked open go, so that the test ends.
			if w, err := os.OpenFile(fifo, os.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
				w.Close()
			}
			return "", errHung
		}
	}
	link := func(target string) {
		t.Helper()
		os.Remove(filepath.Join(ctxDir, "Dockerfile"))
		if err := os.Symlink(target, filepath.Join(ctxDir, "Dockerfile")); err != nil {
			t.Fatal(err)
		}
	}

	link(secret)
	if body, err := open(ctxDir, ""); err == nil || !strings.Contains(err.Error(), "not a file of the build context") {
		t.Errorf("the context's Dockerfile, a link to root's file: read %q, %v; want it refused", body, err)
	}
	link(fifo)
	if body, err := open(ctxDir, ""); err == nil || err == errHung {
		t.Errorf("the context's Dockerfile, a link to a FIFO: %q, %v; want it refused at once", body, err)
	}
	for _, p := range []string{filepath.Join(ctxDir, "fifo"), fifo} {
		if p != fifo {
			if err := syscall.Mkfifo(p, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if body, err := open(ctxDir, p); err == nil || err == errHung || !strings.Contains(err.Error(), "not a regular file") {
			t.Errorf("-f %s, a FIFO: %q, %v; want it refused at once", p, body, err)
		}
	}
	link("docker/Dockerfile")
	if body, err := open(ctxDir, ""); err != nil || body != "FROM bb\n" {
		t.Errorf("the context's Dockerfile, a link inside it: %q, %v; want it read", body, err)
	}
	if body, err := open(ctxDir, filepath.Join(ctxDir, "docker", "Dockerfile")); err != nil || body != "FROM bb\n" {
		t.Errorf("-f docker/Dockerfile: %q, %v; want it read", body, err)
	}
}

var errHung = errorString("the open blocked")

type errorString string

func (e errorString) Error() string { return string(e) }
