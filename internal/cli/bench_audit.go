package cli

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/cagehq/cage/internal/bench"
	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/client"
)

// auditLoop is how many commands the loop measurement runs, and how many
// at a time.
const auditLoop, auditLoopWorkers = 10000, 4

// benchAudit measures what the audit trail costs: two daemons, one keeping
// the trail and one not (config audit.disabled), each with a pool of 4.
func benchAudit(ctx context.Context, t *bench.Table, runs int) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "cage-bench-audit-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	off := filepath.Join(dir, "off.json")
	if err := os.WriteFile(off, []byte(`{"audit": {"disabled": true}}`), 0o600); err != nil {
		return err
	}
	dOn, err := bench.StartDaemon(exe, 4)
	if err != nil {
		return err
	}
	defer dOn.Stop()
	dOff, err := bench.StartDaemon(exe, 4, "--config", off)
	if err != nil {
		return err
	}
	defer dOff.Stop()
	on, offS, err := bench.InterleavedTTI(ctx, dOn.Client(), dOff.Client(), runs)
	if err != nil {
		return err
	}
	r := stats.Ratio(on, offS)
	t.Set(bench.Row{ID: "audit.tti", What: "audit: create -> first output (API + proxy), trail kept", Cage: bench.Latency(on),
		PeerName: "no trail", Peer: bench.Latency(offS), Ratio: r, Target: "<= 1.05x", Status: bench.Judge(r <= 1.05)})
	for _, d := range []struct {
		name string
		d    *bench.Daemon
	}{{"trail kept", dOn}, {"no trail", dOff}} {
		rt, err := bench.ProxyRoundTrip(ctx, d.d.Client(), max(runs, 200))
		if err != nil {
			return err
		}
		t.Set(bench.Row{ID: "audit.roundtrip." + strings.ReplaceAll(d.name, " ", "-"), What: "audit: round trip through the proxy, " + d.name,
			Cage: bench.Latency(rt), Status: bench.NoTarget})
	}
	var tenants [2]bench.Tenant
	for i, d := range []*bench.Daemon{dOn, dOff} {
		key, err := d.NewKey(exe)
		if err != nil {
			return err
		}
		tenants[i] = bench.Tenant{Loop: d.Client(), Other: client.New(d.API, d.Proxy, key)}
	}
	lat, rate, err := bench.LoopLoad(ctx, tenants[0], tenants[1], auditLoop, auditLoopWorkers, 500)
	if err != nil {
		return err
	}
	for i, name := range []string{"trail kept", "no trail"} {
		t.Set(bench.Row{ID: "audit.loop." + strings.ReplaceAll(name, " ", "-"),
			What: fmt.Sprintf("audit: another tenant's GET while a sandbox runs %d commands (%d at a time), %s", auditLoop, auditLoopWorkers, name),
			Cage: bench.Latency(lat[i]), Status: bench.NoTarget, Note: fmt.Sprintf("%.0f commands/s", rate[i])})
	}
	return nil
}
