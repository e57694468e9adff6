package agent

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// sudoEnv is an agent serving sudo on a socket of its own, with accounts
// where "user" (1000) is in the group sudo and "other" (2000) is not.
type sudoTestEnv struct {
	t      *testing.T
	socket string
	shim   string // templates/base/sudo
}

func newSudoEnv(t *testing.T) *sudoTestEnv {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("SKIP: needs root (the commands run as other users)")
	}
	if _, err := os.Stat("/usr/bin/python3"); err != nil {
		t.Skip("SKIP: the sudo client is a python3 script; no /usr/bin/python3 here")
	}
	dir := t.TempDir()
	os.Chmod(dir, 0o755)
	passwd := filepath.Join(dir, "passwd")
	group := filepath.Join(dir, "group")
	os.WriteFile(passwd, []byte("root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n"+
		"other:x:2000:2000::/home/other:/bin/bash\ncage-agent:x:65533:65533::/nonexistent:/usr/sbin/nologin\n"), 0o644)
	os.WriteFile(group, []byte("root:x:0:\nsudo:x:27:user\nuser:x:1000:\nother:x:2000:\n"), 0o644)
	s, err := New(Config{Root: "/", Passwd: passwd, Group: group, AgentUID: testAgentUID})
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 6)
	rand.Read(b)
	e := &sudoTestEnv{t: t, socket: "@cage-test-sudo-" + hex.EncodeToString(b)}
	s.serveSudo(e.socket)
	e.shim, _ = filepath.Abs("../../templates/base/sudo")
	if _, err := os.Stat(e.shim); err != nil {
		t.Fatal(err)
	}
	return e
}

// cmd is the sudo client run as uid with args.
func (e *sudoTestEnv) cmd(uid int, stdin string, args ...string) *exec.Cmd {
	c := exec.Command("/usr/bin/python3", append([]string{e.shim}, args...)...)
	c.Env = []string{"CAGE_SUDO_SOCKET=" + e.socket, "PATH=/usr/bin:/bin", "TERM=xterm-test", "SECRET_OF_CALLER=x"}
	c.Dir = "/tmp"
	c.Stdin = strings.NewReader(stdin)
	c.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid)}}
	return c
}

// run runs the client and returns stdout, stderr and the exit code.
func (e *sudoTestEnv) run(uid int, stdin string, args ...string) (string, string, int) {
	e.t.Helper()
	c := e.cmd(uid, stdin, args...)
	var out, errb bytes.Buffer
	c.Stdout, c.Stderr = &out, &errb
	err := c.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		e.t.Fatalf("sudo %v: %v", args, err)
	}
	return out.String(), errb.String(), code
}

// TestSudo: a member of the group sudo runs commands as root or another
// account through the agent, with its own streams, directory, exit code
// and the environment sudo gives; VAR=value and -E pass variables.
func TestSudo(t *testing.T) {
	e := newSudoEnv(t)
	for _, c := range []struct {
		args  []string
		stdin string
		want  string
		code  int
	}{
		{[]string{"id", "-u"}, "", "0\n", 0},
		{[]string{"-u", "other", "id", "-u"}, "", "2000\n", 0},
		{[]string{"--user=other", "sh", "-c", "id -g; echo $HOME"}, "", "2000\n/home/other\n", 0},
		{[]string{"sh", "-c", "exit 7"}, "", "", 7},
		{[]string{"cat"}, "from stdin\n", "from stdin\n", 0},
		{[]string{"pwd"}, "", "/tmp\n", 0},
		{[]string{"sh", "-c", `echo "$SUDO_USER $SUDO_UID $HOME $USER $TERM [$SECRET_OF_CALLER]"`}, "", "user 1000 /root root xterm-test []\n", 0},
		{[]string{"-E", "sh", "-c", `echo "$HOME [$SECRET_OF_CALLER]"`}, "", "/root [x]\n", 0},
		{[]string{"FOO=bar baz", "sh", "-c", `echo "$FOO [$SECRET_OF_CALLER]"`}, "", "bar baz []\n", 0},
		// -s and -i quote the command's words for the shell, as sudo does.
		{[]string{"-n", "-s", "echo", "$((6*7))", "a  b"}, "", "$((6*7)) a  b\n", 0},
		{[]string{"-i", "id", "-u"}, "", "0\n", 0},
		{[]string{"-l"}, "", "User", 0},
	} {
		out, errOut, code := e.run(1000, c.stdin, c.args...)
		if code != c.code || !strings.HasPrefix(out, c.want) || (c.want == "" && out != "") {
			t.Errorf("sudo %q: exit %d, stdout %q, stderr %q; want exit %d, stdout %q", c.args, code, out, errOut, c.code, c.want)
		}
	}
	// A signal killing the command is the client's death by it too.
	if _, _, code := e.run(1000, "", "sh", "-c", "kill -TERM $$"); code != -1 && code != 128+15 {
		t.Errorf("sudo of a command killed by SIGTERM: exit %d", code)
	}
}

// TestSudoRefused: whoever is not in the group sudo, an unknown user, the
// agent's own uid, a command that does not exist: one line on stderr,
// exit 1, nothing run.
func TestSudoRefused(t *testing.T) {
	e := newSudoEnv(t)
	marker := filepath.Join(t.TempDir(), "ran")
	for _, c := range []struct {
		uid  int
		args []string
		want string
	}{
		{2000, []string{"touch", marker}, "not in the sudoers file"},
		{1000, []string{"-u", "nobody-here", "touch", marker}, "unknown user"},
		{1000, []string{"-u", "cage-agent", "touch", marker}, "unknown user"},
		{1000, []string{"-u", "65533", "touch", marker}, "unknown user"},
		{1000, []string{"no-such-command-x"}, "command not found"},
	} {
		out, errOut, code := e.run(c.uid, "", c.args...)
		if code != 1 || out != "" || !strings.Contains(errOut, c.want) || strings.Count(strings.TrimSpace(errOut), "\n") != 0 {
			t.Errorf("uid %d sudo %q: exit %d, stdout %q, stderr %q; want exit 1 and %q", c.uid, c.args, code, out, errOut, c.want)
		}
	}
	if _, err := os.Stat(marker); err == nil {
		t.Error("a refused sudo ran its command")
	}
}

// TestSudoClientGone: a signal the client gets goes to the command, and a
// client killed takes its command with it.
func TestSudoClientGone(t *testing.T) {
	e := newSudoEnv(t)
	c := e.cmd(1000, "", "sh", "-c", `trap 'echo got-term; exit 3' TERM; echo $$; while :; do sleep 0.05; done`)
	stdout, _ := c.StdoutPipe()
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(stdout)
	line, _ := r.ReadString('\n')
	if _, err := strconv.Atoi(strings.TrimSpace(line)); err != nil {
		t.Fatalf("first line %q", line)
	}
	c.Process.Signal(syscall.SIGTERM)
	rest, _ := r.ReadString('\n')
	err := c.Wait()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 3 || rest != "got-term\n" {
		t.Errorf("SIGTERM to the client: %v, output %q; want the command's trap to answer, exit 3", err, rest)
	}

	c = e.cmd(1000, "", "sh", "-c", `echo $$; exec sleep 60`)
	stdout, _ = c.StdoutPipe()
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	line, _ = bufio.NewReader(stdout).ReadString('\n')
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		t.Fatalf("first line %q", line)
	}
	c.Process.Kill()
	c.Wait()
	deadline := time.Now().Add(10 * time.Second)
	for syscall.Kill(pid, 0) == nil {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("the command (pid %d) outlived its killed sudo client by 10 s", pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSudoHostileRequests: the socket takes one bounded request line whose
// first bytes carry exactly three descriptors; anything else is answered
// with an error and runs nothing.
func TestSudoHostileRequests(t *testing.T) {
	e := newSudoEnv(t)
	marker := filepath.Join(t.TempDir(), "ran")
	req, _ := json.Marshal(sudoRequest{Argv: []string{"touch", marker}})
	req = append(req, '\n')
	devnull, _ := os.Open(os.DevNull)
	defer devnull.Close()
	fd := int(devnull.Fd())
	three := []int{fd, fd, fd}
	huge := append(append([]byte(`{"argv":["touch","`+marker+`"],"env":["A=`), bytes.Repeat([]byte("a"), 600<<10)...), []byte("\"]}\n")...)
	for name, c := range map[string]struct {
		data  []byte
		fds   []int
		later []byte // sent after the first message, with three more descriptors
	}{
		"no descriptors":             {req, nil, nil},
		"two descriptors":            {req, []int{fd, fd}, nil},
		"four descriptors":           {req, []int{fd, fd, fd, fd}, nil},
		"descriptors only later":     {req[:5], nil, req[5:]},
		"not JSON":                   {[]byte("touch " + marker + "\n"), three, nil},
		"no command":                 {[]byte(`{"argv":[]}` + "\n"), three, nil},
		"NUL in an argument":         {[]byte(`{"argv":["touch","` + marker + `\u0000x"]}` + "\n"), three, nil},
		"a line longer than 256 KiB": {huge, three, nil},
		"no end of line":             {req[:len(req)-1], three, nil},
	} {
		conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: e.socket, Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		var oob []byte
		if c.fds != nil {
			oob = syscallRights(c.fds...)
		}
		go func() {
			// A stream may take part of a message: send the rest.
			if n, _, err := conn.WriteMsgUnix(c.data, oob, nil); err == nil && n < len(c.data) {
				conn.Write(c.data[n:])
			}
			if c.later != nil {
				// The later bytes go once the agent has read the first
				// ones: sent before that read, they would be read with
				// it, descriptors and all (a stream socket joins them),
				// and the request would be a good one.
				for deadline := time.Now().Add(10 * time.Second); unreadBytes(conn) > 0 && time.Now().Before(deadline); {
					time.Sleep(5 * time.Millisecond)
				}
				conn.WriteMsgUnix(c.later, syscallRights(three...), nil)
			}
			if name == "no end of line" {
				conn.CloseWrite()
			}
		}()
		conn.SetReadDeadline(time.Now().Add(15 * time.Second))
		line, rerr := bufio.NewReader(conn).ReadBytes('\n')
		conn.Close()
		var rep sudoReply
		if rerr != nil || json.Unmarshal(line, &rep) != nil || rep.Error == "" || rep.Code != nil {
			t.Errorf("%s: reply %q %v; want an error reply", name, line, rerr)
		}
	}
	if _, err := os.Stat(marker); err == nil {
		t.Error("a malformed request ran its command")
	}
}

func syscallRights(fds ...int) []byte { return syscall.UnixRights(fds...) }

// unreadBytes is how much of what was sent on c its peer has not read yet
// (SIOCOUTQ: a unix socket's sent messages not yet consumed).
func unreadBytes(c *net.UnixConn) int {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0
	}
	n := 0
	raw.Control(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.SIOCOUTQ) })
	return n
}

// TestGroupMember reads group membership as sudo needs it: the member
// list, or the group as a user's primary one; the first line of a name
// wins, and passwd-shaped lines are no groups.
func TestGroupMember(t *testing.T) {
	a := parseAccounts([]byte("sudo:x:27:alice, bob ,,carol\nsudo:x:28:mallory\nwheel:x:10:\n" +
		"staff:x:50\nbad:x:notanumber:eve\nuser:x:1000:1000::/home/user:/bin/bash\n"))
	for _, c := range []struct {
		group, user string
		gid         uint32
		want        bool
	}{
		{"sudo", "alice", 1000, true},
		{"sudo", "bob", 1000, true},
		{"sudo", "carol", 1000, true},
		{"sudo", "mallory", 1000, false}, // the second sudo line is ignored
		{"sudo", "dave", 27, true},       // primary group
		{"sudo", "dave", 1000, false},
		{"wheel", "alice", 1000, false},
		{"staff", "alice", 50, false}, // three fields: no group line
		{"bad", "eve", 1000, true},
		{"bad", "x", 0, false}, // an id that is no number is no primary group
		{"user", "user", 1000, false},
		{"nosuch", "alice", 27, false},
	} {
		if got := a.member(c.group, c.user, c.gid); got != c.want {
			t.Errorf("member(%q, %q, %d) = %v, want %v", c.group, c.user, c.gid, got, c.want)
		}
	}
	if (*accounts)(nil).member("sudo", "alice", 27) {
		t.Error("no group file: a member")
	}
}

// TestSudoSignalRightAfterRequest: a signal that reaches the sudo client
// just after it sent its request (the command already started and
// writing, the client not yet run again, as on a busy host) goes to the
// command as any other: here the client is held for half a second after
// its send, and SIGTERM comes as soon as the command has written. Before,
// the client caught signals only after that point, so SIGTERM killed the
// client itself (CI saw it: TestSudoClientGone under load).
func TestSudoSignalRightAfterRequest(t *testing.T) {
	e := newSudoEnv(t)
	// The client as is, with its socket.send_fds slowed down after the
	// send: what a preemption right after it does.
	prelude := `import socket, sys, time
_send = socket.send_fds
def _slow(*a, **k):
    r = _send(*a, **k)
    time.sleep(0.5)
    return r
socket.send_fds = _slow
sys.argv = sys.argv[1:]
exec(compile(open(sys.argv[0]).read(), sys.argv[0], "exec"), {"__name__": "__main__"})
`
	c := e.cmd(1000, "", "sh", "-c", `trap 'echo got-term; exit 3' TERM; echo $$; while :; do sleep 0.05; done`)
	c.Args = append([]string{c.Args[0], "-c", prelude}, c.Args[1:]...)
	stdout, _ := c.StdoutPipe()
	var stderr strings.Builder
	c.Stderr = &stderr
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(stdout)
	line, _ := r.ReadString('\n')
	if _, err := strconv.Atoi(strings.TrimSpace(line)); err != nil {
		t.Fatalf("first line %q, stderr %q", line, stderr.String())
	}
	c.Process.Signal(syscall.SIGTERM)
	rest, _ := r.ReadString('\n')
	err := c.Wait()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 3 || rest != "got-term\n" {
		t.Errorf("SIGTERM to the client right after its request: %v, output %q, stderr %q; want the command's trap to answer, exit 3",
			err, rest, stderr.String())
	}
}
