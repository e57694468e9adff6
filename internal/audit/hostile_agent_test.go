package audit

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "github.com/cagehq/cage/api/gen/process"
)

// frame is one Connect stream message.
func frame(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]byte, 5+len(b))
	binary.BigEndian.PutUint32(out[1:5], uint32(len(b)))
	copy(out[5:], b)
	return out
}

// TestHostileAgentEvents: an agent (not trusted) answers one Start with
// 50,000 start events and 50,000 end events. The stream's call is one
// process.start and one process.end entry. (Before: every start event
// wrote again the detail map an earlier entry had handed to the writer's
// goroutine, a concurrent map write that ends the daemon, and every end
// event was an entry of its own in the queue every tenant shares.)
func TestHostileAgentEvents(t *testing.T) {
	tr := startTrail(t, Limits{})
	envs := map[string]string{}
	for i := range 300 { // a detail slow enough to marshal to overlap
		envs["NAME_"+itoa(int64(i))] = "v"
	}
	req := frame(t, &pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/true", Envs: envs}})
	start := frame(t, &pb.StartResponse{Event: &pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: 7}}}})
	end := frame(t, &pb.StartResponse{Event: &pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: &pb.ProcessEvent_EndEvent{Exited: true}}}})
	var stream bytes.Buffer
	for range 50_000 {
		stream.Write(start)
		stream.Write(end)
	}
	r := httptest.NewRequest(http.MethodPost, "/process.Process/Start", bytes.NewReader(req))
	r.Header.Set("Content-Type", "application/connect+proto")
	observed, done := tr.ObserveEnvd(r, "sb1", "key1", envdPort)
	_, _ = io.Copy(io.Discard, r.Body)
	resp := &http.Response{StatusCode: http.StatusOK, Header: http.Header{"Content-Type": {"application/connect+proto"}},
		Body: io.NopCloser(&stream)}
	observed(resp)
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		t.Fatal(err)
	}
	done()
	tr.Flush()
	es, err := tr.DB().Query(Filter{KeyID: "key1", SandboxID: "sb1"})
	if err != nil {
		t.Fatal(err)
	}
	if k := kinds(es); k[KindProcessStart] != 1 || k[KindProcessEnd] != 1 || len(es) != 2 {
		t.Errorf("entries of one hostile stream: %v, want one process.start and one process.end", k)
	}
}

// TestEntryStringsBounded: what a tenant chooses (a path, here 60 KiB)
// is kept to 4 KiB in an entry, so no tenant can make every entry large.
func TestEntryStringsBounded(t *testing.T) {
	tr := startTrail(t, Limits{})
	long := "/" + strings.Repeat("a", 60<<10)
	names := make([]string, 1000)
	for i := range names {
		names[i] = "N" + itoa(int64(i))
	}
	tr.Record(Event{Kind: KindFileRead, KeyID: "key1", SandboxID: "sb1",
		Detail: map[string]any{"path": long, "env_names": names, "nested": map[string]any{"cwd": long}}})
	tr.Flush()
	es, err := tr.DB().Query(Filter{KeyID: "key1", SandboxID: "sb1"})
	if err != nil || len(es) != 1 {
		t.Fatalf("entries %v %v", es, err)
	}
	if len(es[0].Detail) > 12<<10 {
		t.Errorf("an entry with a 60 KiB path and 1,000 names is %d bytes", len(es[0].Detail))
	}
	var d struct {
		Path    string         `json:"path"`
		Names   []string       `json:"env_names"`
		NotKept int            `json:"env_names_not_kept"`
		Nested  map[string]any `json:"nested"`
	}
	if err := json.Unmarshal([]byte(es[0].Detail), &d); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(d.Path, long[:4096]) || !strings.HasSuffix(d.Path, "(truncated)") || len(d.Names) != maxListKept ||
		d.NotKept != 1000-maxListKept || len(d.Nested["cwd"].(string)) > 4200 {
		t.Errorf("path %d bytes, %d names (%d not kept), nested cwd %d bytes", len(d.Path), len(d.Names), d.NotKept,
			len(d.Nested["cwd"].(string)))
	}
}
