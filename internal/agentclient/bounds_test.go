package agentclient

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	pb "github.com/cagehq/cage/api/gen/process"
)

// hostileAgent answers every unary RPC with the bytes body(path) gives,
// written in chunks of what it returns, as many times as times says.
func hostileAgent(t *testing.T, answer func(w http.ResponseWriter, r *http.Request)) *Client {
	t.Helper()
	srv := httptest.NewUnstartedServer(http.HandlerFunc(answer))
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	c := New(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", strings.TrimPrefix(srv.URL, "http://"))
	}, "tok")
	t.Cleanup(c.Close)
	return c
}

// repeated answers a unary RPC with chunk written n times.
func repeated(chunk []byte, n int) func(w http.ResponseWriter, r *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/proto")
		for range n {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	}
}

// allocated runs f and returns the bytes it allocated (the whole
// process's: the test's server too).
func allocated(f func()) uint64 {
	var a, b runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&a)
	f()
	runtime.ReadMemStats(&b)
	return b.TotalAlloc - a.TotalAlloc
}

// TestHostileAnswersBounded: a compromised agent's answer of empty list
// items (two bytes each on the wire, some 200 in memory) costs the host
// an error, not memory. Before: 2 MiB of them made a ListDir of a million
// entries, 228 MiB of the daemon's memory, and a process list alike; a
// message could be 64 MiB (some 7 GiB decoded), and the dashboard's and
// MCP's listings and the dashboard's process list (every 2 s a live
// page) are a tenant's to ask for.
func TestHostileAnswersBounded(t *testing.T) {
	empties := bytes.Repeat([]byte{0x0a, 0x00}, 1<<20) // field 1, length 0: 2 MiB
	c := hostileAgent(t, repeated(empties, 1))
	var err error
	n := allocated(func() {
		_, err = c.FS.ListDir(context.Background(), connect.NewRequest(&fspb.ListDirRequest{Path: "/"}))
	})
	if err == nil || n > 32<<20 {
		t.Errorf("a listing of a million empty entries: %v, %d MiB allocated; want an error, little memory", err, n>>20)
	}
	n = allocated(func() {
		_, err = c.Process.List(context.Background(), connect.NewRequest(&pb.ListRequest{}))
	})
	if err == nil || n > 32<<20 {
		t.Errorf("a process list of a million empty processes: %v, %d MiB allocated; want an error, little memory", err, n>>20)
	}
	// A message is at most maxMessage, whatever it holds.
	c = hostileAgent(t, repeated(bytes.Repeat([]byte{0x08, 0x01}, 1<<20), 4)) // 8 MiB of an int field
	if _, err := c.FS.Stat(context.Background(), connect.NewRequest(&fspb.StatRequest{Path: "/"})); connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Errorf("an answer of 8 MiB: %v, want resource_exhausted", err)
	}
}

// TestListDirKeepsWhatItIsAskedFor: ListDir reads a listing as it comes
// and keeps only the entries asked for, counting the rest: 64 MiB of
// entries (32 Mi of them, the agent's worst) cost the host its kept
// entries, not the listing; an honest listing comes back whole and as
// sent.
func TestListDirKeepsWhatItIsAskedFor(t *testing.T) {
	t.Run("hostile", func(t *testing.T) {
		c := hostileAgent(t, repeated(bytes.Repeat([]byte{0x0a, 0x00}, 1<<19), 256)) // 256 MiB sent
		var l *Listing
		var err error
		n := allocated(func() {
			l, err = c.ListDir(context.Background(), connect.NewRequest(&fspb.ListDirRequest{Path: "/"}), 2000)
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(l.Entries) != 2000 || !l.Truncated || l.Total != maxListBytes/2 {
			t.Errorf("kept %d of %d, truncated %v; want 2000 of %d, truncated", len(l.Entries), l.Total, l.Truncated, maxListBytes/2)
		}
		if n > 32<<20 {
			t.Errorf("%d MiB allocated to keep 2000 entries", n>>20)
		}
	})
	t.Run("metadata", func(t *testing.T) { // entries of many small map entries each
		var e []byte
		for i := range 2000 {
			kv := protoMapEntry(strings.Repeat("k", 1+i%7)+string(rune('a'+i%26))+string(rune('a'+i/26%26))+string(rune('a'+i/676)), "")
			e = append(e, kv...)
		}
		entry := append(append([]byte{0x0a}, varint(len(e))...), e...)
		c := hostileAgent(t, repeated(entry, 500))
		l, err := c.ListDir(context.Background(), connect.NewRequest(&fspb.ListDirRequest{Path: "/"}), 2000)
		if err != nil {
			t.Fatal(err)
		}
		items := 0
		for _, e := range l.Entries {
			items += 1 + len(e.Metadata)
		}
		if items > maxItems || !l.Truncated || l.Total != 500 {
			t.Errorf("kept %d entries of %d items in all, truncated %v; want at most %d items, truncated", len(l.Entries), items, l.Truncated, maxItems)
		}
	})
	t.Run("honest", func(t *testing.T) {
		target := "/etc"
		want := &fspb.ListDirResponse{Entries: []*fspb.EntryInfo{
			{Name: "a", Path: "/d/a", Type: fspb.FileType_FILE_TYPE_FILE, Size: 3, ModifiedTime: timestamppb.New(time.Unix(1e9, 0)), Metadata: map[string]string{"k": "v"}},
			{Name: "b", Path: "/d/b", Type: fspb.FileType_FILE_TYPE_DIRECTORY, Owner: "user"},
			{Name: "c", Path: "/d/c", Type: fspb.FileType_FILE_TYPE_SYMLINK, SymlinkTarget: &target},
		}}
		b, _ := proto.Marshal(want)
		var got http.Header
		c := hostileAgent(t, func(w http.ResponseWriter, r *http.Request) {
			got = r.Header.Clone()
			repeated(b, 1)(w, r)
		})
		req := connect.NewRequest(&fspb.ListDirRequest{Path: "/d"})
		req.Header().Set("Authorization", UserHeader("root"))
		l, err := c.ListDir(context.Background(), req, 10)
		if err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(&fspb.ListDirResponse{Entries: l.Entries}, want) || l.Total != 3 || l.Truncated {
			t.Errorf("got %v (total %d, truncated %v), want %v", l.Entries, l.Total, l.Truncated, want.Entries)
		}
		if got.Get("Authorization") != UserHeader("root") || got.Get("X-Access-Token") != "tok" || got.Get("Accept-Encoding") != "identity" {
			t.Errorf("headers sent: %v", got)
		}
		l, err = c.ListDir(context.Background(), req, 2)
		if err != nil || len(l.Entries) != 2 || l.Total != 3 || !l.Truncated {
			t.Errorf("keeping 2: %v, %+v", err, l)
		}
	})
	t.Run("errors", func(t *testing.T) {
		c := hostileAgent(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusNotFound)
			_, _ = w.Write([]byte(`{"code":"not_found","message":"no such directory"}`))
		})
		_, err := c.ListDir(context.Background(), connect.NewRequest(&fspb.ListDirRequest{Path: "/x"}), 10)
		var ce *connect.Error
		if !errors.As(err, &ce) || ce.Code() != connect.CodeNotFound || ce.Message() != "no such directory" {
			t.Errorf("a not_found answer: %v", err)
		}
		c = hostileAgent(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/proto")
			_, _ = w.Write([]byte{0x0a, 0x05, 0x0a}) // an entry cut short
		})
		if _, err := c.ListDir(context.Background(), connect.NewRequest(&fspb.ListDirRequest{Path: "/x"}), 10); err == nil {
			t.Error("a listing cut short: no error")
		}
	})
}

func varint(n int) []byte {
	var b []byte
	for n >= 0x80 {
		b = append(b, byte(n)|0x80)
		n >>= 7
	}
	return append(b, byte(n))
}

// protoMapEntry is one entry of EntryInfo's metadata (field 11).
func protoMapEntry(k, v string) []byte {
	e := append(append([]byte{0x0a}, varint(len(k))...), k...)
	e = append(append(append(e, 0x12), varint(len(v))...), v...)
	return append(append([]byte{0x5a}, varint(len(e))...), e...)
}

// TestUnreadStreamHoldsLittle: what an agent (or the proxy, for the
// daemon's clients through it) may send on a stream the host does not
// read is bounded by the windows the host grants, not by net/http's
// 4 MiB a stream and 1 GiB a connection. Before: the dashboard's
// terminal, whose browser read nothing, held 4 MiB of the daemon's heap
// a terminal (7.5 MiB of RSS), a key's 512 terminals some 4 GiB.
func TestUnreadStreamHoldsLittle(t *testing.T) {
	for name, mk := range map[string]func(DialFunc, string) *Client{
		"New": New,
		"NewHostSide": func(d DialFunc, tok string) *Client {
			return NewHostSide(d, tok, http.Header{"E2b-Sandbox-Id": {"x"}})
		},
	} {
		t.Run(name, func(t *testing.T) {
			var sent atomic.Int64
			srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				rc := http.NewResponseController(w)
				chunk := make([]byte, 16<<10)
				for sent.Load() < 64<<20 {
					if _, err := w.Write(chunk); err != nil || rc.Flush() != nil {
						return
					}
					sent.Add(int64(len(chunk)))
				}
			}))
			srv.Config.Protocols = new(http.Protocols)
			srv.Config.Protocols.SetUnencryptedHTTP2(true)
			srv.Start()
			defer srv.Close()
			c := mk(func(ctx context.Context) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "tcp", strings.TrimPrefix(srv.URL, "http://"))
			}, "tok")
			defer c.Close()
			// Four streams on the one connection, none read.
			for range 4 {
				resp, err := c.HTTP.Get(BaseURL + "/files?path=/dev/zero")
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
			}
			var last int64 = -1
			for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
				if n := sent.Load(); n == last {
					break
				} else {
					last = n
				}
			}
			if n := sent.Load(); n > 2*maxConnWindow {
				t.Errorf("the agent sent %d KiB on four unread streams; want at most %d KiB", n>>10, 2*maxConnWindow>>10)
			} else {
				t.Logf("the agent sent %d KiB on four unread streams before it was held", n>>10)
			}
		})
	}
}
