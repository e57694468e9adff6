package vm

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// qmp is a client of QEMU's machine protocol: one JSON object a line each
// way, replies in the order of the commands, and asynchronous events
// anywhere between them.
type qmp struct {
	conn   *net.UnixConn
	r      *bufio.Reader
	events []qmpEvent // events read while waiting for replies, oldest first (at most maxQMPEvents)
	stop   func() bool
}

// Bounds of what the host reads of QEMU, which a guest that escaped into
// it controls: a message is a line of at most maxQMPLine bytes (an
// endless one took 1.5 GiB of the daemon's heap), and at most
// maxQMPEvents events wait for their reader (the oldest go).
const (
	maxQMPLine   = 1 << 20
	maxQMPEvents = 256
)

// next reads one message (a line) into v.
func (q *qmp) next(v any) error {
	var line []byte
	for {
		b, err := q.r.ReadSlice('\n')
		if len(line)+len(b) > maxQMPLine {
			return fmt.Errorf("a message longer than %d bytes", maxQMPLine)
		}
		line = append(line, b...)
		if err == nil {
			break
		}
		if !errors.Is(err, bufio.ErrBufferFull) {
			return err
		}
	}
	return json.Unmarshal(line, v)
}

// keep queues an event for a later reader.
func (q *qmp) keep(e qmpEvent) {
	if len(q.events) >= maxQMPEvents {
		q.events = q.events[1:]
	}
	q.events = append(q.events, e)
}

type qmpEvent struct {
	Event string          `json:"event"`
	Data  json.RawMessage `json:"data"`
}

type qmpMessage struct {
	Event  string          `json:"event"`
	Data   json.RawMessage `json:"data"`
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
}

// newQMP takes a connection to QEMU's QMP socket, reads the greeting and
// leaves the capabilities negotiation. ctx bounds every later call too.
func newQMP(ctx context.Context, c net.Conn) (*qmp, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		c.Close()
		return nil, errors.New("qmp: not a unix socket")
	}
	q := &qmp{conn: uc, r: bufio.NewReaderSize(uc, 64<<10)}
	q.stop = context.AfterFunc(ctx, func() { uc.SetDeadline(time.Now()) })
	var greeting map[string]json.RawMessage
	if err := q.next(&greeting); err != nil {
		q.Close()
		return nil, q.ctxErr(ctx, err)
	}
	if _, ok := greeting["QMP"]; !ok {
		q.Close()
		return nil, errors.New("qmp: no greeting")
	}
	if _, err := q.call(ctx, "qmp_capabilities", nil); err != nil {
		q.Close()
		return nil, err
	}
	return q, nil
}

func (q *qmp) Close() {
	q.stop()
	q.conn.Close()
}

func (q *qmp) ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return fmt.Errorf("qmp: %w", err)
}

// send writes one command, with f's descriptor attached when f is not nil
// (getfd takes it from the message that carries the command).
func (q *qmp) send(name string, args any, f *os.File) error {
	cmd := map[string]any{"execute": name}
	if args != nil {
		cmd["arguments"] = args
	}
	b, err := json.Marshal(cmd)
	if err != nil {
		return err
	}
	b = append(b, '\n')
	if f == nil {
		_, err = q.conn.Write(b)
		return err
	}
	_, _, err = q.conn.WriteMsgUnix(b, unix.UnixRights(int(f.Fd())), nil)
	return err
}

// reply reads up to the next reply, keeping the events before it.
func (q *qmp) reply(name string) (json.RawMessage, error) {
	for {
		var m qmpMessage
		if err := q.next(&m); err != nil {
			return nil, err
		}
		switch {
		case m.Event != "":
			q.keep(qmpEvent{m.Event, m.Data})
		case m.Error != nil:
			return nil, &qmpError{name, m.Error.Desc}
		default:
			return m.Return, nil
		}
	}
}

// call runs one command and returns its reply.
func (q *qmp) call(ctx context.Context, name string, args any) (json.RawMessage, error) {
	if err := q.send(name, args, nil); err != nil {
		return nil, q.ctxErr(ctx, err)
	}
	r, err := q.reply(name)
	var qe *qmpError
	if err != nil && !errors.As(err, &qe) {
		return nil, q.ctxErr(ctx, err)
	}
	return r, err
}

// pipeline sends commands at once and then reads their replies: one round
// trip instead of one each, for the restore's critical path.
func (q *qmp) pipeline(ctx context.Context, cmds ...qmpCommand) error {
	for _, c := range cmds {
		if err := q.send(c.name, c.args, c.file); err != nil {
			return q.ctxErr(ctx, err)
		}
	}
	var first error
	for _, c := range cmds {
		_, err := q.reply(c.name)
		var qe *qmpError
		if err != nil && !errors.As(err, &qe) {
			// The stream is broken: no later reply will come.
			return q.ctxErr(ctx, err)
		}
		if err != nil && first == nil {
			first = err
		}
	}
	return first
}

// qmpError is QEMU's answer that a command failed.
type qmpError struct{ cmd, desc string }

func (e *qmpError) Error() string { return "qmp " + e.cmd + ": " + e.desc }

type qmpCommand struct {
	name string
	args any
	file *os.File
}

// waitMigration waits for the MIGRATION event that ends a migration and
// says how it ended. The "events" capability must be on.
func (q *qmp) waitMigration(ctx context.Context) error {
	for {
		for len(q.events) > 0 {
			e := q.events[0]
			q.events = q.events[1:]
			if e.Event != "MIGRATION" {
				continue
			}
			var st struct {
				Status string `json:"status"`
			}
			_ = json.Unmarshal(e.Data, &st)
			switch st.Status {
			case "completed":
				return nil
			case "failed", "cancelled":
				return fmt.Errorf("migration %s", st.Status)
			}
		}
		var m qmpMessage
		if err := q.next(&m); err != nil {
			return q.ctxErr(ctx, err)
		}
		if m.Event != "" {
			q.keep(qmpEvent{m.Event, m.Data})
		}
	}
}
