package cli

import (
	"context"
	"fmt"
	"os"

	"github.com/cagehq/cage/internal/bench"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/units"
)

func init() {
	expectedRows["desktop"] = []bench.Row{
		{ID: "desktop.create", What: "desktop: @e2b/desktop create (Xvfb, XFCE up) -> first screenshot, 1024x768",
			PeerName: "E2B Desktop: no start time published (E2B: about 150 ms for a sandbox, before Xvfb and XFCE)"},
		{ID: "desktop.screenshot", What: "desktop: screenshot() round trip (scrot, read, remove)"},
		{ID: "desktop.memory", What: "desktop: host memory of an idle desktop sandbox (its cgroup's charge)"},
	}
}

// benchDesktop measures the desktop template as @e2b/desktop uses it,
// through a cage serve it starts (process wall): create -> first
// screenshot, the screenshot round trip, and an idle desktop's memory.
func benchDesktop(ctx context.Context, t *bench.Table, h *sandbox.Host, runs int) error {
	if ok, err := haveTemplate(t, h, bench.DesktopTemplate, "desktop", "desktop: @e2b/desktop's template", "make desktop builds it"); !ok {
		return err
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	d, err := bench.StartDaemon(exe, 0)
	if err != nil {
		return err
	}
	defer d.Stop()
	c := d.Client()
	s, err := bench.DesktopCreateToScreenshot(ctx, c, runs)
	if err != nil {
		t.Fail("desktop.create", "", err)
	} else {
		t.Set(bench.Row{ID: "desktop.create", Cage: bench.Latency(s), Status: bench.NoTarget,
			Note: "the SDK's own polls (every 500 ms) included"})
	}
	idle, err := bench.DesktopScreenshots(ctx, c, max(runs, 50))
	if err != nil {
		t.Fail("desktop.screenshot", "", err)
		return nil
	}
	t.Set(bench.Row{ID: "desktop.screenshot", Cage: bench.Latency(idle.Screenshot), Status: bench.NoTarget})
	t.Set(bench.Row{ID: "desktop.memory", Cage: bench.Quantity(float64(idle.MemUsed)/(1<<20), "MiB"), Status: bench.NoTarget,
		Note: fmt.Sprintf("of which page cache %s; the template's default limit is 2 GiB", units.FormatSize(idle.MemCache))})
	return nil
}
