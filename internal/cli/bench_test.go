package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/cagehq/cage/internal/bench"
)

// TestBenchFailedSample: a measurement whose sample failed still prints
// the whole table, its row failed with the reason, and the bench exits
// 125; a table without one exits 0, unmet targets included.
func TestBenchFailedSample(t *testing.T) {
	for _, asJSON := range []bool{false, true} {
		tb := &bench.Table{}
		tb.Expect(expectedRows["create"]...)
		tb.Set(bench.Row{ID: "create.pool", Status: bench.NotMet, Cage: bench.Quantity(1, "x")})
		var out bytes.Buffer
		if err := finishBench(&out, tb, bench.Machine{CPUs: 2}, asJSON); err != nil {
			t.Fatalf("json %v: a table without a failed row: %v", asJSON, err)
		}
		tb.Fail("create.cold", "", errors.New("sandbox sb-1 failed: agent exited"))
		out.Reset()
		err := finishBench(&out, tb, bench.Machine{CPUs: 2}, asJSON)
		if code, _ := exitCode(err); code != ExitInternal {
			t.Errorf("json %v: a failed row exits %d (%v), want %d", asJSON, code, err, ExitInternal)
		}
		if !asJSON {
			for _, want := range []string{"create -> first output, in process, cold", "failed", "agent exited", "not met"} {
				if !strings.Contains(out.String(), want) {
					t.Errorf("the table lacks %q:\n%s", want, out.String())
				}
			}
			continue
		}
		var doc struct {
			Failed bool
			Rows   []bench.Row
		}
		if err := json.Unmarshal(out.Bytes(), &doc); err != nil || !doc.Failed || len(doc.Rows) != 2 || doc.Rows[0].Status != bench.Failed {
			t.Errorf("--json of a failed bench: %v %+v", err, doc)
		}
	}
}

// TestBenchBadOnly: an unknown measurement is a usage error, before
// anything is measured.
func TestBenchBadOnly(t *testing.T) {
	err := runBench(t.Context(), &globals{}, &bytes.Buffer{}, benchOptions{runs: 1, idle: 1, alive: 2, only: "run,nope"})
	if code, msg := exitCode(err); code != ExitUsage || !strings.Contains(msg, `"nope"`) {
		t.Errorf("--only run,nope: %d %q, want %d naming it", code, msg, ExitUsage)
	}
	err = runBench(t.Context(), &globals{}, &bytes.Buffer{}, benchOptions{runs: 0, idle: 1, alive: 2, only: "run"})
	if code, _ := exitCode(err); code != ExitUsage {
		t.Errorf("--runs 0: exit %d, want %d", code, ExitUsage)
	}
}

// TestBlocksNote: the microvm row's note gives the median count of the
// samples read, says nothing without one (KVM, or none read), and joins
// the wall's warning without empty parts.
func TestBlocksNote(t *testing.T) {
	if got := blocksNote(nil); got != "" {
		t.Errorf("blocksNote(nil) = %q, want none", got)
	}
	if got := blocksNote([]int{47000, 45000, 52000}); !strings.Contains(got, "translated 47000 blocks") || !strings.Contains(got, "median of 3") {
		t.Errorf("blocksNote = %q, want the median 47000 of 3", got)
	}
	if got := joinNotes("", "TCG warning", "", "blocks"); got != "TCG warning; blocks" {
		t.Errorf("joinNotes = %q", got)
	}
	if got := joinNotes("", ""); got != "" {
		t.Errorf("joinNotes of nothing = %q", got)
	}
}
