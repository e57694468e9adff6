package vm

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestQMPClient: against a fake QEMU, the client negotiates, pipelines
// commands, keeps events that come between replies, hands a descriptor
// over with getfd, reports QMP errors as such and waits for the end of a
// migration.
func TestQMPClient(t *testing.T) {
	path := filepath.Join(t.TempDir(), "qmp.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	got := make(chan string, 16)
	gotFD := make(chan bool, 1)
	go func() {
		c, err := l.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		w := func(s string) { c.Write([]byte(s + "\r\n")) }
		w(`{"QMP": {"version": {}, "capabilities": []}}`)
		for {
			// Read one line, with any descriptor that came with it.
			buf, oob := make([]byte, 4096), make([]byte, 64)
			n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
			if err != nil {
				return
			}
			if oobn > 0 {
				msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
				for _, m := range msgs {
					if fds, err := unix.ParseUnixRights(&m); err == nil {
						gotFD <- len(fds) == 1
						for _, fd := range fds {
							unix.Close(fd)
						}
					}
				}
			}
			for _, line := range strings.Split(strings.TrimSpace(string(buf[:n])), "\n") {
				var cmd struct {
					Execute string `json:"execute"`
				}
				if err := json.Unmarshal([]byte(line), &cmd); err != nil {
					return
				}
				got <- cmd.Execute
				switch cmd.Execute {
				case "bad":
					w(`{"error": {"class": "GenericError", "desc": "no such thing"}}`)
				case "migrate":
					w(`{"event": "MIGRATION", "data": {"status": "setup"}}`)
					w(`{"return": {}}`)
					w(`{"event": "STOP"}`)
					w(`{"event": "MIGRATION", "data": {"status": "completed"}}`)
				default:
					w(`{"return": {}}`)
				}
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	q, err := newQMP(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := q.pipeline(ctx,
		qmpCommand{name: "migrate-set-capabilities", args: migrationCaps},
		qmpCommand{name: "getfd", args: map[string]any{"fdname": stateFD}, file: f},
		qmpCommand{name: "migrate", args: map[string]any{"uri": "fd:" + stateFD}},
	); err != nil {
		t.Fatal(err)
	}
	if err := q.waitMigration(ctx); err != nil {
		t.Fatalf("wait for the migration: %v", err)
	}
	select {
	case ok := <-gotFD:
		if !ok {
			t.Error("getfd came with the wrong number of descriptors")
		}
	case <-time.After(5 * time.Second):
		t.Error("getfd came without a descriptor")
	}
	// A QMP error is an answer: later replies still come.
	err = q.pipeline(ctx, qmpCommand{name: "bad"}, qmpCommand{name: "cont"})
	var qe *qmpError
	if err == nil || !strings.Contains(err.Error(), "no such thing") || !errors.As(err, &qe) {
		t.Errorf("a failed command: %v", err)
	}
	if _, err := q.call(ctx, "query-status", nil); err != nil {
		t.Errorf("after a failed command: %v", err)
	}
	close(got)
	var cmds []string
	for c := range got {
		cmds = append(cmds, c)
	}
	if want := "qmp_capabilities migrate-set-capabilities getfd migrate bad cont query-status"; strings.Join(cmds, " ") != want {
		t.Errorf("commands %q, want %q", strings.Join(cmds, " "), want)
	}
}
