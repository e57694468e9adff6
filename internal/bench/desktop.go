package bench

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/client"
)

// DesktopTemplate is @e2b/desktop's default template.
const DesktopTemplate = "desktop"

// desktop is a desktop sandbox driven as @e2b/desktop 2.4.0 drives it:
// every step is a command through the daemon's proxy, as the user "user",
// with DISPLAY from the create's environment.
type desktop struct {
	c     *client.Client
	sb    *types.Sandbox
	agent *agentclient.Client
	http  *http.Client
}

// sh runs a command as the SDK's commands.run does (bash -l -c, as user)
// and returns its stdout and exit code.
func (d *desktop) sh(ctx context.Context, cmd string) (string, int32, error) {
	var out bytes.Buffer
	end, err := d.agent.Run(ctx, agentclient.RunOptions{Cmd: "/bin/bash", Args: []string{"-l", "-c", cmd}, User: "user",
		Stdout: &out, Stderr: io.Discard})
	if err != nil {
		return "", 0, err
	}
	return out.String(), end.GetExitCode(), nil
}

// waitAndVerify is the SDK's: run cmd until it exits 0, every 500 ms, for
// at most timeout.
func (d *desktop) waitAndVerify(ctx context.Context, cmd string, timeout time.Duration) error {
	for start := time.Now(); time.Since(start) < timeout; time.Sleep(500 * time.Millisecond) {
		if _, code, err := d.sh(ctx, cmd); err != nil {
			return err
		} else if code == 0 {
			return nil
		}
	}
	return fmt.Errorf("%q did not succeed within %v", cmd, timeout)
}

// newDesktop is Sandbox.create() of @e2b/desktop: the create through the
// API with DISPLAY, then Xvfb and XFCE started in the background and
// polled for as the SDK polls.
func newDesktop(ctx context.Context, c *client.Client, timeout int64) (*desktop, error) {
	sb, err := c.Create(ctx, types.NewSandboxV2{TemplateID: DesktopTemplate, Timeout: &timeout, EnvVars: types.EnvVars{"DISPLAY": ":0"}})
	if err != nil {
		return nil, err
	}
	ac, err := c.Agent(sb.SandboxID, sb.EnvdAccessToken)
	if err != nil {
		_ = c.Kill(ctx, sb.SandboxID)
		return nil, err
	}
	d := &desktop{c: c, sb: sb, agent: ac, http: sandboxHTTP(time.Minute)}
	err = func() error {
		if _, _, err := d.sh(ctx, "Xvfb :0 -ac -screen 0 1024x768x24 -retro -dpi 96 -nolisten tcp -nolisten unix >/dev/null 2>&1 &"); err != nil {
			return err
		}
		if err := d.waitAndVerify(ctx, "xdpyinfo -display :0", 10*time.Second); err != nil {
			return fmt.Errorf("could not start Xvfb: %w", err)
		}
		if _, _, err := d.sh(ctx, "startxfce4 >/dev/null 2>&1 &"); err != nil {
			return err
		}
		if err := d.waitAndVerify(ctx, "pgrep -x xfce4-session >/dev/null && pgrep -x xfwm4 >/dev/null && pgrep -x xfdesktop >/dev/null", time.Minute); err != nil {
			return fmt.Errorf("could not start XFCE: %w", err)
		}
		return nil
	}()
	if err != nil {
		d.close(ctx)
		return nil, fmt.Errorf("sandbox %s: %w", sb.SandboxID, err)
	}
	return d, nil
}

func (d *desktop) close(ctx context.Context) {
	d.agent.Close()
	_ = d.c.Kill(ctx, d.sb.SandboxID)
}

// screenshot is the SDK's screenshot(): scrot to a file, the file read
// through the proxy's /files, then removed. It returns the PNG's size.
func (d *desktop) screenshot(ctx context.Context, n int) (w, h uint32, err error) {
	path := fmt.Sprintf("/tmp/screenshot-%d.png", n)
	if _, code, err := d.sh(ctx, "scrot --pointer "+path); err != nil || code != 0 {
		return 0, 0, fmt.Errorf("scrot: exit %d, %v", code, err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, d.c.Proxy+"/files?path="+url.QueryEscape(path), nil)
	if err != nil {
		return 0, 0, err
	}
	req.Header.Set("E2b-Sandbox-Id", d.sb.SandboxID)
	req.Header.Set("E2b-Sandbox-Port", "49983")
	req.Header.Set("X-Access-Token", d.sb.EnvdAccessToken)
	req.Header.Set("Authorization", agentclient.UserHeader("user"))
	resp, err := d.http.Do(req)
	if err != nil {
		return 0, 0, err
	}
	png, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	resp.Body.Close()
	if err != nil {
		return 0, 0, err
	}
	if resp.StatusCode != http.StatusOK {
		return 0, 0, fmt.Errorf("GET /files: %s: %.200s", resp.Status, png)
	}
	if _, _, err := d.sh(ctx, "rm -f "+path); err != nil {
		return 0, 0, err
	}
	if len(png) < 24 || string(png[1:4]) != "PNG" || string(png[12:16]) != "IHDR" {
		return 0, 0, fmt.Errorf("the screenshot is not a PNG (%d bytes)", len(png))
	}
	return binary.BigEndian.Uint32(png[16:20]), binary.BigEndian.Uint32(png[20:24]), nil
}

// DesktopCreateToScreenshot times @e2b/desktop's Sandbox.create() (the
// create, Xvfb and XFCE up as the SDK polls for them) and its first
// screenshot(), from the create's call to the PNG in hand; each sandbox
// is killed before the next.
func DesktopCreateToScreenshot(ctx context.Context, c *client.Client, runs int) (stats.Stats, error) {
	var samples []time.Duration
	for i := -1; i < runs; i++ { // one warm-up: the template's files into the page cache
		start := time.Now()
		d, err := newDesktop(ctx, c, 300)
		if err != nil {
			return stats.Stats{}, err
		}
		w, h, err := d.screenshot(ctx, i+1)
		took := time.Since(start)
		d.close(ctx)
		if err != nil {
			return stats.Stats{}, err
		}
		if w != 1024 || h != 768 {
			return stats.Stats{}, fmt.Errorf("the first screenshot is %dx%d, want 1024x768", w, h)
		}
		if i >= 0 {
			samples = append(samples, took)
		}
	}
	return stats.Summarize(samples), nil
}

// DesktopIdle is what one idle desktop sandbox holds on the host.
type DesktopIdle struct {
	MemUsed, MemCache int64 // the sandbox's cgroup, from the API's metrics
	Screenshot        stats.Stats
}

// DesktopScreenshots starts one desktop, times runs screenshots in a row
// (the round trip), then leaves it idle for 12 s and reads its memory from
// the daemon's metrics (sampled from its cgroup every 5 s).
func DesktopScreenshots(ctx context.Context, c *client.Client, runs int) (DesktopIdle, error) {
	var out DesktopIdle
	d, err := newDesktop(ctx, c, 600)
	if err != nil {
		return out, err
	}
	defer d.close(ctx)
	var samples []time.Duration
	for i := -3; i < runs; i++ {
		start := time.Now()
		if _, _, err := d.screenshot(ctx, 100+i); err != nil {
			return out, err
		}
		if i >= 0 {
			samples = append(samples, time.Since(start))
		}
	}
	out.Screenshot = stats.Summarize(samples)
	time.Sleep(12 * time.Second)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.API+"/sandboxes/"+d.sb.SandboxID+"/metrics", nil)
	if err != nil {
		return out, err
	}
	req.Header.Set("X-API-Key", c.Key)
	resp, err := d.http.Do(req)
	if err != nil {
		return out, err
	}
	defer resp.Body.Close()
	var m []struct {
		MemUsed  int64 `json:"memUsed"`
		MemCache int64 `json:"memCache"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil || len(m) == 0 {
		return out, fmt.Errorf("GET /sandboxes/%s/metrics: %s, %d samples, %v", d.sb.SandboxID, resp.Status, len(m), err)
	}
	last := m[len(m)-1]
	out.MemUsed, out.MemCache = last.MemUsed, last.MemCache
	if out.MemUsed <= 0 {
		return out, fmt.Errorf("metrics of %s: no memory figure", d.sb.SandboxID)
	}
	return out, nil
}
