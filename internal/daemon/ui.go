package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/hostcheck"
	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/ui"
	"github.com/cagehq/cage/internal/units"
)

// UI configures the dashboard at /ui on the API listener (internal/ui).
type UI struct {
	// Disabled serves no dashboard (/ui is then the API's 404).
	Disabled bool `json:"disabled"`
	// SessionIdle and SessionMax end a dashboard session after that long
	// unused and that long after sign-in (defaults 30m and 12h).
	SessionIdle Duration `json:"session_idle"`
	SessionMax  Duration `json:"session_max"`
	// MaxUpload bounds one file uploaded through the file browser
	// (default 100M).
	MaxUpload string `json:"max_upload"`
}

// withUI mounts the dashboard beside the API (next serves the rest; api is
// the bare API handler the dashboard calls with a session's key), and
// returns what ends its streams at shutdown (nil when disabled).
func withUI(c UI, next, api http.Handler, st *store.Store, mgr *manager.Manager, host *sandbox.Host, trail *audit.Trail,
	proxyAddr net.Addr, proxyDial dialFunc, data, run string, log *slog.Logger) (http.Handler, func(), error) {
	if c.Disabled {
		return next, nil, nil
	}
	if c.SessionIdle < 0 || c.SessionMax < 0 {
		return nil, nil, fmt.Errorf("ui: negative session times")
	}
	var maxUpload int64
	if c.MaxUpload != "" {
		n, err := units.ParseSize(c.MaxUpload)
		if err != nil || n < 1 {
			return nil, nil, fmt.Errorf("ui.max_upload %q: want a size such as 100M", c.MaxUpload)
		}
		maxUpload = n
	}
	s := ui.New(ui.Config{API: api, Proxy: dialURL(proxyAddr), Dial: proxyDial, Log: log, MaxUpload: maxUpload,
		SessionIdle: time.Duration(c.SessionIdle), SessionMax: time.Duration(c.SessionMax),
		Verify: func(key string) (ui.Identity, error) {
			k, err := st.VerifyKey(key)
			if errors.Is(err, store.ErrNotFound) {
				return ui.Identity{}, ui.ErrBadKey
			}
			if err != nil {
				return ui.Identity{}, err
			}
			return ui.Identity{KeyID: k.ID, Name: k.Name, TeamID: k.TeamID, Admin: k.Admin}, nil
		},
		Record: func(r *http.Request, who ui.Identity, status int) { // as /mcp's calls are
			client := r.RemoteAddr
			if h, _, err := net.SplitHostPort(client); err == nil {
				client = h
			}
			trail.Record(audit.Event{Kind: audit.KindAPICall, KeyID: who.KeyID, TeamID: who.TeamID,
				Route: r.Method + " /ui/session", Status: status, Client: client})
		},
		Templates: func() ([]ui.Template, error) { return uiTemplates(host.Templates) },
		Host:      func(ctx context.Context) (any, error) { return hostReport(ctx, st, mgr, host, data, run), nil },
	})
	return ui.Mount(next, s), s.Shutdown, nil
}

func uiTemplates(ts *imgstore.Store) ([]ui.Template, error) {
	list, err := ts.List()
	if err != nil {
		return nil, err
	}
	out := []ui.Template{{Name: "host", Source: "built in: this host's /usr and a minimal /etc, read-only"}}
	for _, t := range list {
		x := ui.Template{Name: t.Name, ID: t.ID, Created: t.Created, Source: t.Source, Size: t.Size,
			Command: strings.Join(append(append([]string{}, t.Config.Entrypoint...), t.Config.Cmd...), " ")}
		sizes := ts.LayerSizes(&t)
		for i, l := range t.Layers {
			x.Layers = append(x.Layers, ui.Layer{ID: l, Size: sizes[i]})
		}
		out = append(out, x)
	}
	return out, nil
}

// hostChecks are what `cage doctor` says of the host without starting a
// sandbox (hostcheck: kernel, root, user namespaces, cgroups, landlock,
// the mount API, the agent), and the network's readiness with the
// daemon's own resolvers. Doctor's test sandbox on each wall is not run
// from a page: the walls' list says which are available and why not.
func hostChecks(host *sandbox.Host) []hostcheck.Check {
	out := hostcheck.Host()
	for _, f := range network.Readiness(host.NetConfig.Upstreams) {
		out = append(out, hostcheck.Check{Name: "network: " + f.Name, OK: f.OK, Info: f.Info})
	}
	return out
}

type wallReport struct {
	Name      string `json:"name"`
	Available bool   `json:"available"`
	Info      string `json:"info"`
}

// hostReport is the host page: the kernel, each wall (available or why
// not, and its warning: what `cage doctor` says of walls, without starting
// a sandbox), the pools and the capacity.
func hostReport(ctx context.Context, st *store.Store, mgr *manager.Manager, host *sandbox.Host, data, run string) any {
	kernel, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	walls := []wallReport{}
	for _, w := range sandbox.Walls {
		if err := host.WallMissing(w); err != nil {
			walls = append(walls, wallReport{Name: w, Info: err.Error()})
			continue
		}
		info := host.Describe(ctx, w)
		if warn := host.Warning(ctx, w); warn != "" {
			info = strings.TrimSpace(info + " (warning: " + warn + ")")
		}
		walls = append(walls, wallReport{Name: w, Available: true, Info: info})
	}
	memTotal, memAvail := meminfo()
	live, maxSandboxes, creating, maxCreating := mgr.Load()
	capacity := map[string]any{"cpus": runtime.NumCPU(), "memTotal": memTotal, "memAvailable": memAvail,
		"dataFree": freeBytes(data), "runFree": freeBytes(run), "liveSandboxes": live, "maxSandboxes": maxSandboxes,
		"createsInFlight": creating, "maxCreating": maxCreating}
	if u, err := st.TotalUsage(manager.PauseMemory); err == nil {
		capacity["committedCPUs"], capacity["committedMemory"], capacity["committedDisk"] = u.CPUs, u.Memory, u.Disk
	}
	return map[string]any{"kernel": strings.TrimSpace(string(kernel)), "checks": hostChecks(host), "walls": walls,
		"pools": host.PoolStats(), "capacity": capacity}
}
