package agent

import (
	"bytes"
	"path"
	"strings"
	"testing"
)

// FuzzSandboxPath: whatever a request names and whatever home the passwd
// file gives, the path the file API acts on is clean and absolute, holds no
// "..", and relTo of it (what openat2 resolves in the root) is "." or a
// clean relative path that never climbs; a NUL byte is refused.
func FuzzSandboxPath(f *testing.F) {
	for _, seed := range [][2]string{
		{"a", "/home/user"}, {"~", "/home/user"}, {"~/x/../../..", "/home/user"}, {"../../../etc/passwd", "/home/user"},
		{"/x/../../..", ""}, {"~other/x", "/"}, {"a\x00b", "/home/user"}, {".", "relative/home"},
		{"//a//b/", "../../.."}, {"~/", "~"}, {strings.Repeat("../", 100) + "x", "/"}, {"", "/home/user"},
	} {
		f.Add(seed[0], seed[1])
	}
	f.Fuzz(func(t *testing.T, p, home string) {
		for _, raw := range []string{p, home} {
			r := relTo(raw)
			checkRel(t, raw, r)
		}
		got, err := sandboxPath(p, User{Home: home})
		if strings.ContainsRune(p, 0) || p == "" {
			if err == nil {
				t.Fatalf("sandboxPath(%q) = %q, want an error", p, got)
			}
			return
		}
		if err != nil {
			if !strings.HasPrefix(p, "~") && !strings.ContainsRune(home, 0) {
				t.Fatalf("sandboxPath(%q, home %q): %v", p, home, err)
			}
			return
		}
		if !path.IsAbs(got) || path.Clean(got) != got || strings.Contains(got, "\x00") {
			t.Fatalf("sandboxPath(%q, home %q) = %q: not clean and absolute", p, home, got)
		}
		for _, el := range strings.Split(got, "/") {
			if el == ".." || el == "." {
				t.Fatalf("sandboxPath(%q) = %q holds %q", p, got, el)
			}
		}
		if path.IsAbs(p) && got != path.Clean(p) {
			t.Fatalf("sandboxPath(%q) = %q, want %q", p, got, path.Clean(p))
		}
		r := relTo(got)
		checkRel(t, got, r)
		if (r == "." && got != "/") || (r != "." && "/"+r != got) {
			t.Fatalf("relTo(%q) = %q", got, r)
		}
	})
}

func checkRel(t *testing.T, in, r string) {
	t.Helper()
	if r == "" || strings.HasPrefix(r, "/") || r == ".." || strings.HasPrefix(r, "../") || path.Clean(r) != r {
		t.Fatalf("relTo(%q) = %q: not a clean path below the root", in, r)
	}
}

// FuzzLookupUser: user lookup on a hostile passwd file (huge lines,
// missing fields, duplicate names, negative or huge ids) never panics,
// answers the same way twice, agrees with a plain reading of passwd(5)
// (the first line of a name wins; a bare number is a uid), and never
// yields an id the kernel would take for "unchanged".
func FuzzLookupUser(f *testing.F) {
	seeds := []struct{ data, name string }{
		{"root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n", "user"},
		{"user:x:1:1::/a:/bin/sh\nuser:x:2:2::/b:/bin/sh\n", "user"},
		{"user:x:-1:-1::/:/bin/sh\n", "user"},
		{"user:x:4294967295:0::/:/bin/sh\n", "user"},
		{"user:x:99999999999999999999:0::/:/bin/sh\n", "user"},
		{"user:x:1\n", "user"},
		{"user" + strings.Repeat(":", 10000) + "\n", "user"},
		{strings.Repeat("a", 1<<16) + ":x:1:1::/:/bin/sh\n", strings.Repeat("a", 1<<16)},
		{"", "4294967294"},
		{"", "-5"},
		{"::0:0::/:/bin/sh\n", ""},
		{"user:x:1000:1000::/home/user:/bin/sh\r\n", "user"},
	}
	for _, s := range seeds {
		f.Add([]byte(s.data), s.name)
	}
	f.Fuzz(func(t *testing.T, data []byte, name string) {
		a := parseAccounts(data)
		if lines := bytes.Count(data, []byte("\n")) + 1; len(a.users) > lines || len(a.names) > lines {
			t.Fatalf("%d users, %d names from %d lines", len(a.users), len(a.names), lines)
		}
		u, err := a.lookup(name)
		u2, err2 := a.lookup(name)
		if u != u2 || (err == nil) != (err2 == nil) {
			t.Fatalf("lookup %q: %+v %v, then %+v %v", name, u, err, u2, err2)
		}
		want, wantOK := referenceLookup(data, name)
		if wantOK != (err == nil) || (wantOK && u != want) {
			t.Fatalf("lookup %q: %+v %v; the reference says %+v %v", name, u, err, want, wantOK)
		}
		if err == nil && (u.Name != name || u.UID < 0 || u.UID > maxID || u.GID < 0 || u.GID > maxID) {
			t.Fatalf("lookup %q: %+v", name, u)
		}
	})
}

// referenceLookup reads passwd(5) the plain way.
func referenceLookup(data []byte, name string) (User, bool) {
	if name == "" {
		return User{}, false
	}
	for _, line := range strings.Split(string(data), "\n") {
		fields := strings.Split(line, ":")
		if len(fields) < 7 || fields[0] != name {
			continue
		}
		uid, ok1 := parseID(fields[2])
		gid, ok2 := parseID(fields[3])
		if !ok1 || !ok2 {
			return User{}, false
		}
		return User{Name: name, UID: int(uid), GID: int(gid), Home: fields[5]}, true
	}
	if n, ok := parseID(name); ok {
		return User{Name: name, UID: int(n), GID: int(n), Home: "/"}, true
	}
	return User{}, false
}
