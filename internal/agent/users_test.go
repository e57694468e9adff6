package agent

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// lookupWithin runs LookupUser, failing the test if it takes longer than
// a few seconds (the old agent blocked for ever on a FIFO).
func lookupWithin(t *testing.T, passwd, name string) (User, error) {
	t.Helper()
	type result struct {
		u   User
		err error
	}
	done := make(chan result, 1)
	go func() {
		u, err := LookupUser(passwd, name)
		done <- result{u, err}
	}()
	select {
	case r := <-done:
		return r.u, r.err
	case <-time.After(5 * time.Second):
		t.Fatalf("LookupUser(%s, %q) hangs", passwd, name)
		return User{}, nil
	}
}

// TestAccountsReadAgainWhenChanged: root inside rewrites /etc/passwd (in
// place, keeping its size, or by renaming a new file over it); the next
// lookup sees the new entry. The old agent cached the first copy for ever.
func TestAccountsReadAgainWhenChanged(t *testing.T) {
	dir := t.TempDir()
	passwd := filepath.Join(dir, "passwd")
	os.WriteFile(passwd, []byte("user:x:1000:1000::/home/user:/bin/sh\n"), 0o644)
	if u, err := lookupWithin(t, passwd, "user"); err != nil || u.UID != 1000 {
		t.Fatalf("first lookup: %+v %v", u, err)
	}
	// In place, same size; the mtime moves (set explicitly: a coarse clock
	// could give the same tick).
	os.WriteFile(passwd, []byte("user:x:1001:1000::/home/user:/bin/sh\n"), 0o644)
	os.Chtimes(passwd, time.Now(), time.Now().Add(time.Second))
	if u, err := lookupWithin(t, passwd, "user"); err != nil || u.UID != 1001 {
		t.Fatalf("after an in-place rewrite: %+v %v", u, err)
	}
	// A new file renamed over it.
	tmp := filepath.Join(dir, "passwd.new")
	os.WriteFile(tmp, []byte("user:x:1002:1000::/home/u2:/bin/sh\nnew:x:7:7::/:/bin/sh\n"), 0o644)
	os.Rename(tmp, passwd)
	if u, err := lookupWithin(t, passwd, "user"); err != nil || u.UID != 1002 || u.Home != "/home/u2" {
		t.Fatalf("after a rename over it: %+v %v", u, err)
	}
	if u, err := lookupWithin(t, passwd, "new"); err != nil || u.UID != 7 {
		t.Fatalf("a user added: %+v %v", u, err)
	}
	if n := lookupName(passwd, 7); n != "new" {
		t.Fatalf("name of uid 7: %q", n)
	}
}

// TestAccountsHostileFile: /etc/passwd made a FIFO (before or after the
// agent cached it), a symlink, or a file larger than the agent reads:
// lookups answer at once, named users with an error, bare ids still work.
func TestAccountsHostileFile(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := unix.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	if u, err := lookupWithin(t, fifo, "user"); err == nil {
		t.Fatalf("a FIFO read as passwd: %+v", u)
	}
	passwd := filepath.Join(dir, "passwd")
	os.WriteFile(passwd, []byte("user:x:1000:1000::/home/user:/bin/sh\n"), 0o644)
	if _, err := lookupWithin(t, passwd, "user"); err != nil {
		t.Fatal(err)
	}
	real := filepath.Join(dir, "real")
	os.WriteFile(real, []byte("user:x:1000:1000::/home/user:/bin/sh\n"), 0o644)
	huge := "user:x:1000:1000::/home/user:/bin/sh\n" + strings.Repeat("x", maxAccountsFile)
	for name, plant := range map[string]func() error{
		"fifo":    func() error { return unix.Mkfifo(passwd, 0o644) },
		"symlink": func() error { return os.Symlink(real, passwd) },
		"huge":    func() error { return os.WriteFile(passwd, []byte(huge), 0o644) },
	} {
		os.Remove(passwd)
		if err := plant(); err != nil {
			t.Fatal(err)
		}
		if u, err := lookupWithin(t, passwd, "user"); err == nil {
			t.Errorf("%s: user found: %+v", name, u)
		} else if !strings.Contains(err.Error(), "cannot read") {
			t.Errorf("%s: error does not say why: %v", name, err)
		}
		if u, err := lookupWithin(t, passwd, "1234"); err != nil || u.UID != 1234 {
			t.Errorf("%s: bare uid: %+v %v", name, u, err)
		}
		if n := lookupName(passwd, 1000); n != "1000" {
			t.Errorf("%s: name of 1000: %q", name, n)
		}
	}
}

// TestParseAccounts: the first entry of a name or id wins, malformed and
// out-of-range ids name nobody, short lines are skipped.
func TestParseAccounts(t *testing.T) {
	a := parseAccounts([]byte("dup:x:1:1::/a:/bin/sh\ndup:x:2:2::/b:/bin/sh\n" +
		"neg:x:-1:0::/:/bin/sh\nbig:x:4294967295:0::/:/bin/sh\nshort:x:5\n::6:6::/:/bin/sh\n" +
		"max:x:4294967294:4294967294::/:/bin/sh\nnogid:x:9:x::/:/bin/sh"))
	for name, want := range map[string]int{"dup": 1, "max": maxID, "5": 5} {
		if u, err := a.lookup(name); err != nil || u.UID != want {
			t.Errorf("lookup %s: %+v %v, want uid %d", name, u, err, want)
		}
	}
	for _, name := range []string{"neg", "big", "nogid", "short", "-1", "4294967295", "", "nobody"} {
		if u, err := a.lookup(name); err == nil {
			t.Errorf("lookup %q: %+v accepted", name, u)
		}
	}
	if a.name(1) != "dup" || a.name(5) != "short" || a.name(6) != "6" || a.name(9) != "nogid" {
		t.Errorf("names: %v", a.names)
	}
}
