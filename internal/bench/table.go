package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/cagehq/cage/internal/bench/stats"
	"golang.org/x/sys/unix"
)

// A bench prints one table: every figure with its peer from the same run,
// its target and whether it is met. Rows a measurement was asked for but
// did not fill read "not measured"; a row whose samples failed reads
// "failed", and a table with one fails the bench.

// Status is where a row stands.
type Status string

const (
	Met         Status = "met"
	NotMet      Status = "not met"
	NoTarget    Status = "-" // a figure without a target of its own
	NotMeasured Status = "not measured"
	Failed      Status = "failed"
)

// Figure is one measured figure: latency percentiles, or a quantity.
type Figure struct {
	N     int     `json:"n,omitempty"`
	P50ms float64 `json:"p50_ms,omitempty"`
	P95ms float64 `json:"p95_ms,omitempty"`
	P99ms float64 `json:"p99_ms,omitempty"`
	MinMs float64 `json:"min_ms,omitempty"`
	MaxMs float64 `json:"max_ms,omitempty"`
	Value float64 `json:"value,omitempty"` // a quantity (Unit says of what)
	Unit  string  `json:"unit,omitempty"`
}

// Latency is a figure of timing samples.
func Latency(s stats.Stats) *Figure {
	return &Figure{N: s.N, P50ms: ms(s.P50), P95ms: ms(s.P95), P99ms: ms(s.P99), MinMs: ms(s.Min), MaxMs: ms(s.Max)}
}

// Quantity is a figure of one value, e.g. 212.5 "creates/s".
func Quantity(v float64, unit string) *Figure { return &Figure{Value: v, Unit: unit} }

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func (f *Figure) String() string {
	if f == nil {
		return ""
	}
	if f.Unit != "" || f.N == 0 {
		return fmt.Sprintf("%.4g %s", f.Value, f.Unit)
	}
	return fmt.Sprintf("%.2f / %.2f / %.2f ms", f.P50ms, f.P95ms, f.P99ms)
}

// Row is one line of the table.
type Row struct {
	ID       string  `json:"id"` // stable, for tracking across runs
	What     string  `json:"what"`
	Cage     *Figure `json:"cage,omitempty"`
	PeerName string  `json:"peer_name,omitempty"`
	Peer     *Figure `json:"peer,omitempty"`
	Ratio    float64 `json:"ratio,omitempty"` // cage over peer (medians, or values)
	Target   string  `json:"target,omitempty"`
	Status   Status  `json:"status"`
	Note     string  `json:"note,omitempty"`
}

// Table is the rows of one bench run, safe for concurrent use.
type Table struct {
	mu   sync.Mutex
	rows []Row
}

// Expect adds rows that a measurement asked for will fill; until then
// they read "not measured" (with why, when given).
func (t *Table) Expect(rows ...Row) {
	for _, r := range rows {
		if r.Status == "" {
			r.Status = NotMeasured
		}
		t.Set(r)
	}
}

// Set puts r in place of the row of the same id, or appends it.
func (t *Table) Set(r Row) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range t.rows {
		if t.rows[i].ID == r.ID {
			if r.Target == "" {
				r.Target = t.rows[i].Target
			}
			if r.What == "" {
				r.What = t.rows[i].What
			}
			if r.PeerName == "" {
				r.PeerName = t.rows[i].PeerName
			}
			t.rows[i] = r
			return
		}
	}
	t.rows = append(t.rows, r)
}

// Get is the row of an id.
func (t *Table) Get(id string) (Row, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range t.rows {
		if r.ID == id {
			return r, true
		}
	}
	return Row{}, false
}

// Fail marks a row failed with the error that ended its samples.
func (t *Table) Fail(id, what string, err error) {
	t.Set(Row{ID: id, What: what, Status: Failed, Note: err.Error()})
}

// Skip leaves a row unmeasured, saying why.
func (t *Table) Skip(id, what, why string) {
	t.Set(Row{ID: id, What: what, Status: NotMeasured, Note: why})
}

// Failed reports whether any row failed.
func (t *Table) Failed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range t.rows {
		if r.Status == Failed {
			return true
		}
	}
	return false
}

// Rows is a copy of the rows in order.
func (t *Table) Rows() []Row {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]Row(nil), t.rows...)
}

// Judge is Met when ok, else NotMet.
func Judge(ok bool) Status {
	if ok {
		return Met
	}
	return NotMet
}

// Print writes the table as aligned text, notes below their row.
func (t *Table) Print(w io.Writer, m Machine) {
	fmt.Fprintf(w, "machine: %s\n\n", m)
	head := []string{"measurement", "cage (p50 / p95 / p99)", "peer (same run)", "ratio", "target", "status"}
	cells := [][]string{head}
	for _, r := range t.Rows() {
		peer := r.PeerName
		if r.Peer != nil {
			peer += ": " + r.Peer.String()
		}
		ratio := ""
		if r.Ratio != 0 {
			ratio = fmt.Sprintf("%.2fx", r.Ratio)
		}
		cells = append(cells, []string{r.What, r.Cage.String(), peer, ratio, r.Target, string(r.Status)})
	}
	width := make([]int, len(head))
	for _, c := range cells {
		for i, s := range c {
			width[i] = max(width[i], len([]rune(s)))
		}
	}
	rows := t.Rows()
	for k, c := range cells {
		var b strings.Builder
		for i, s := range c {
			b.WriteString(s)
			if i < len(c)-1 {
				b.WriteString(strings.Repeat(" ", width[i]-len([]rune(s))+2))
			}
		}
		fmt.Fprintln(w, strings.TrimRight(b.String(), " "))
		if k > 0 && rows[k-1].Note != "" {
			fmt.Fprintf(w, "    (%s)\n", rows[k-1].Note)
		}
	}
}

// JSON writes the machine and the rows as one JSON document.
func (t *Table) JSON(w io.Writer, m Machine) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false) // "->" and "<=" as written
	return enc.Encode(struct {
		Machine Machine `json:"machine"`
		Rows    []Row   `json:"rows"`
		Failed  bool    `json:"failed"`
	}{m, t.Rows(), t.Failed()})
}

// Machine describes the host a bench ran on: figures compare only on the
// same kind of machine.
type Machine struct {
	CPUs       int    `json:"cpus"`
	CPUModel   string `json:"cpu_model,omitempty"`
	MemoryGiB  int64  `json:"memory_gib"`
	Kernel     string `json:"kernel"`
	Cgroups    string `json:"cgroups"`
	Virtual    bool   `json:"virtualised"` // a hypervisor runs this host
	KVM        bool   `json:"kvm"`         // /dev/kvm: the microvm wall runs without TCG
	LoadBefore string `json:"load_before,omitempty"`
}

// DescribeMachine reads this host's description; cgroups is the layout
// cage found (cgroups.Mode's text).
func DescribeMachine(cgroups string) Machine {
	m := Machine{CPUs: runtime.NumCPU(), Cgroups: cgroups}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			k, v, _ := strings.Cut(line, ":")
			k, v = strings.TrimSpace(k), strings.TrimSpace(v)
			if k == "model name" && m.CPUModel == "" {
				m.CPUModel = v
			}
			if k == "flags" && strings.Contains(" "+v+" ", " hypervisor ") {
				m.Virtual = true
			}
		}
	}
	if avail, err := memTotal(); err == nil {
		m.MemoryGiB = (avail + 512<<20) >> 30
	}
	_, err := os.Stat("/dev/kvm")
	m.KVM = err == nil
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		m.LoadBefore = strings.Join(strings.Fields(string(b))[:3], " ")
	}
	return m
}

func (m Machine) String() string {
	virt, kvm := "bare metal", "no /dev/kvm (microvm under TCG)"
	if m.Virtual {
		virt = "virtualised (nested)"
	}
	if m.KVM {
		kvm = "/dev/kvm"
	}
	return fmt.Sprintf("%d CPUs (%s), %d GiB, %s, kernel %s, cgroups %s, %s; load average before %s",
		m.CPUs, m.CPUModel, m.MemoryGiB, virt, m.Kernel, m.Cgroups, kvm, m.LoadBefore)
}

func memTotal() (int64, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
			return parseKB(v)
		}
	}
	return 0, fmt.Errorf("no MemTotal in /proc/meminfo")
}
