package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/cagehq/cage/internal/bench"
	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/client"
)

// auditLoop is how many commands the loop measurement runs, and how many
// at a time.
const auditLoop, auditLoopWorkers = 10000, 4

// benchAudit measures what the audit trail costs: two daemons, one keeping
// the trail and one not (config audit.disabled), each with a pool of 4.
func benchAudit(ctx context.Context, w io.Writer, runs int) error {
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
		return exitf(ExitInternal, "audit: %v", err)
	}
	defer dOn.Stop()
	dOff, err := bench.StartDaemon(exe, 4, "--config", off)
	if err != nil {
		return exitf(ExitInternal, "audit: %v", err)
	}
	defer dOff.Stop()
	on, offS, err := bench.InterleavedTTI(ctx, dOn.Client(), dOff.Client(), runs)
	if err != nil {
		return exitf(ExitInternal, "audit: %v", err)
	}
	fmt.Fprintf(w, "audit: create -> first output, trail kept     %s\n", on)
	fmt.Fprintf(w, "audit: create -> first output, no trail       %s\n", offS)
	fmt.Fprintf(w, "audit: ratio of medians kept/none             %.3fx (target <= 1.05)\n", stats.Ratio(on, offS))
	for _, d := range []struct {
		name string
		d    *bench.Daemon
	}{{"trail kept", dOn}, {"no trail  ", dOff}} {
		rt, err := bench.ProxyRoundTrip(ctx, d.d.Client(), max(runs, 200))
		if err != nil {
			return exitf(ExitInternal, "audit: %v", err)
		}
		fmt.Fprintf(w, "audit: round trip through the proxy, %s %s\n", d.name, rt)
	}
	var tenants [2]bench.Tenant
	for i, d := range []*bench.Daemon{dOn, dOff} {
		key, err := d.NewKey(exe)
		if err != nil {
			return exitf(ExitInternal, "audit: %v", err)
		}
		tenants[i] = bench.Tenant{Loop: d.Client(), Other: client.New(d.API, d.Proxy, key)}
	}
	lat, rate, err := bench.LoopLoad(ctx, tenants[0], tenants[1], auditLoop, auditLoopWorkers, 500)
	if err != nil {
		return exitf(ExitInternal, "audit: %v", err)
	}
	for i, name := range []string{"trail kept", "no trail  "} {
		fmt.Fprintf(w, "audit: %d commands in a loop (%d at a time, chunks of 500 in turn), %s: %.0f commands/s; another tenant's GET %s\n",
			auditLoop, auditLoopWorkers, name, rate[i], lat[i])
	}
	return nil
}
