package bench

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/bench/stats"
)

func TestTable(t *testing.T) {
	var tb Table
	tb.Expect(Row{ID: "a", What: "figure a", Target: "p50 <= 10 ms"}, Row{ID: "b", What: "figure b", PeerName: "peer b"})
	if tb.Failed() {
		t.Fatal("a table of expected rows has failed")
	}
	for _, r := range tb.Rows() {
		if r.Status != NotMeasured {
			t.Errorf("expected row %s: status %q, want %q", r.ID, r.Status, NotMeasured)
		}
	}
	s := stats.Summarize([]time.Duration{5 * time.Millisecond, 7 * time.Millisecond, 20 * time.Millisecond})
	tb.Set(Row{ID: "a", Cage: Latency(s), Status: Judge(s.P50 <= 10*time.Millisecond)})
	r, _ := tb.Get("a")
	if r.What != "figure a" || r.Target != "p50 <= 10 ms" || r.Status != Met || r.Cage.P50ms != 7 || r.Cage.N != 3 {
		t.Errorf("filled row a: %+v %+v, want its name and target kept, met, p50 7 ms of 3", r, r.Cage)
	}
	tb.Fail("b", "", errors.New("sample 3: sandbox died"))
	if !tb.Failed() {
		t.Error("a table with a failed row has not failed")
	}
	r, _ = tb.Get("b")
	if r.What != "figure b" || r.PeerName != "peer b" || r.Status != Failed || r.Note != "sample 3: sandbox died" {
		t.Errorf("failed row b: %+v", r)
	}
	tb.Set(Row{ID: "c", What: "figure c", Cage: Quantity(212.5, "creates/s"), Status: Judge(false)})
	if rows := tb.Rows(); len(rows) != 3 || rows[2].ID != "c" || rows[2].Status != NotMet {
		t.Errorf("rows %+v, want a, b, then c not met", rows)
	}

	var text bytes.Buffer
	tb.Print(&text, Machine{CPUs: 2, Kernel: "6.1"})
	out := text.String()
	for _, want := range []string{"2 CPUs", "figure a", "7.00 / 20.00 / 20.00 ms", "met", "figure b", "failed", "(sample 3: sandbox died)", "212.5 creates/s", "not met"} {
		if !strings.Contains(out, want) {
			t.Errorf("the printed table lacks %q:\n%s", want, out)
		}
	}
	var js bytes.Buffer
	if err := tb.JSON(&js, Machine{CPUs: 2}); err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Machine Machine `json:"machine"`
		Rows    []Row   `json:"rows"`
		Failed  bool    `json:"failed"`
	}
	if err := json.Unmarshal(js.Bytes(), &doc); err != nil {
		t.Fatalf("--json output does not parse: %v\n%s", err, js.String())
	}
	if !doc.Failed || doc.Machine.CPUs != 2 || len(doc.Rows) != 3 || doc.Rows[0].Cage.P95ms != 20 || doc.Rows[2].Cage.Value != 212.5 {
		t.Errorf("--json: %+v", doc)
	}
}

func TestDescribeMachine(t *testing.T) {
	m := DescribeMachine("v2")
	if m.CPUs < 1 || m.Kernel == "" || m.MemoryGiB < 1 || m.Cgroups != "v2" {
		t.Errorf("machine %+v: want CPUs, a kernel release, memory and the cgroup mode given", m)
	}
}
