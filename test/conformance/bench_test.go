package conformance

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/bench/stats"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/network"
	"github.com/cagehq/cage/internal/proxy"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/testutil"
	cagewall "github.com/cagehq/cage/internal/wall"
)

// Go benchmarks of the same measurements `cage bench` takes; they report
// p50/p99 alongside ns/op. Run: go test -run - -bench . ./test/conformance/

func reportPercentiles(b *testing.B, samples []time.Duration) {
	s := stats.Summarize(samples)
	b.ReportMetric(float64(s.P50.Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(s.P99.Microseconds())/1000, "p99-ms")
}

// BenchmarkCreateToFirstOutput: create a sandbox and read the first byte of
// `echo` from it; destroying is not timed.
func BenchmarkCreateToFirstOutput(b *testing.B) {
	h := processHost(b)
	var samples []time.Duration
	for i := 0; i < b.N; i++ {
		samples = append(samples, firstOutput(b, h, sandbox.Options{}))
	}
	reportPercentiles(b, samples)
}

// firstOutput creates a sandbox with o and returns the time to the first
// byte of `echo` from it; destroying it is not timed.
func firstOutput(b *testing.B, h *sandbox.Host, o sandbox.Options) time.Duration {
	ctx := context.Background()
	start := time.Now()
	sb, err := h.Create(ctx, o)
	if err != nil {
		b.Fatal(err)
	}
	c := agentclient.New(sb.Dial, sb.Token())
	fw := &firstByte{}
	end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "echo", Args: []string{"x"}, Stdout: fw, Stderr: io.Discard})
	if err != nil {
		b.Fatal(err)
	}
	if end.GetExitCode() != 0 || fw.at.IsZero() {
		b.Fatalf("echo exited %d and printed nothing: no time to first output", end.GetExitCode())
	}
	d := fw.at.Sub(start)
	b.StopTimer()
	c.Close()
	_ = sb.Destroy()
	b.StartTimer()
	return d
}

// BenchmarkRoundTrip: Start -> end of `true` in one live sandbox.
func BenchmarkRoundTrip(b *testing.B) {
	h := processHost(b)
	ctx := context.Background()
	sb, err := h.Create(ctx, sandbox.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Destroy()
	c := agentclient.New(sb.Dial, sb.Token())
	defer c.Close()
	var samples []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "true", Stdout: io.Discard, Stderr: io.Discard})
		if err != nil {
			b.Fatal(err)
		}
		if end.GetExitCode() != 0 {
			b.Fatalf("true exited %d", end.GetExitCode())
		}
		samples = append(samples, time.Since(start))
	}
	reportPercentiles(b, samples)
}

type firstByte struct{ at time.Time }

func (f *firstByte) Write(p []byte) (int, error) {
	if f.at.IsZero() {
		f.at = time.Now()
	}
	return len(p), nil
}

// BenchmarkNetworkCreate: create -> first output of a sandbox without a
// network against one with the internet (a veth, its rules), interleaved,
// on the process wall. Reports both and the difference of the p50s.
func BenchmarkNetworkCreate(b *testing.B) {
	h, _ := netHost(b)
	var none, inet []time.Duration
	measure := func(p network.Policy) time.Duration { return firstOutput(b, h, sandbox.Options{Net: p}) }
	measure(network.Policy{Mode: network.Internet}) // sets the host's network up
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		none = append(none, measure(network.Policy{}))
		inet = append(inet, measure(network.Policy{Mode: network.Internet}))
	}
	sn, si := stats.Summarize(none), stats.Summarize(inet)
	b.ReportMetric(ms(sn.P50), "none-p50-ms")
	b.ReportMetric(ms(sn.P99), "none-p99-ms")
	b.ReportMetric(ms(si.P50), "internet-p50-ms")
	b.ReportMetric(ms(si.P99), "internet-p99-ms")
	b.ReportMetric(ms(si.P50-sn.P50), "diff-p50-ms")
	b.ReportMetric(ms(si.P99-sn.P99), "diff-p99-ms")
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// streamPy sends argv[3] bytes to argv[1]:argv[2] and prints the rate in
// MB/s once the receiver has counted them all.
const streamPy = `import socket, time, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buf = b"\0" * (1 << 20)
s = socket.create_connection((host, port))
t = time.perf_counter()
sent = 0
while sent < n:
    s.sendall(buf); sent += len(buf)
s.shutdown(socket.SHUT_WR)
got = int(s.recv(64).decode().strip())
print("%.1f" % (got / (time.perf_counter() - t) / 1e6))`

// BenchmarkNetworkThroughput: one TCP stream of 256 MiB from a sandbox
// (internet mode) to the test world's public host, against the same stream
// from the host itself, interleaved, on every wall.
func BenchmarkNetworkThroughput(b *testing.B) {
	for _, w := range walls() {
		b.Run(w.name, func(b *testing.B) {
			h, _ := netHost(b)
			if err := h.WallMissing(w.name); err != nil {
				b.Skip(err)
			}
			sb, err := h.Create(context.Background(), sandbox.Options{Wall: w.name, Net: network.Policy{Mode: network.Internet}, Memory: 256 << 20})
			if err != nil {
				b.Fatal(err)
			}
			defer sb.Destroy()
			c := agentclient.New(sb.Dial, sb.Token())
			defer c.Close()
			const size = 256 << 20
			args := []string{"-c", streamPy, testutil.PublicHost.String(), strconv.Itoa(testutil.SinkPort), strconv.Itoa(size)}
			var host, inside []float64
			for i := 0; i < b.N; i++ {
				out, err := exec.Command("python3", args...).Output()
				if err != nil {
					b.Fatal(err)
				}
				host = append(host, parseRate(b, string(out)))
				var so strings.Builder
				end, err := c.Run(context.Background(), agentclient.RunOptions{Cmd: "python3", Args: args, Stdout: &so, Stderr: io.Discard})
				if err != nil || end.GetExitCode() != 0 {
					b.Fatalf("stream from the sandbox: %v %+v", err, end)
				}
				inside = append(inside, parseRate(b, so.String()))
			}
			mh, mi := median(host), median(inside)
			b.ReportMetric(mh, "host-MB/s")
			b.ReportMetric(mi, "sandbox-MB/s")
			b.ReportMetric(mi/mh, "ratio")
		})
	}
}

func parseRate(b *testing.B, s string) float64 {
	v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil {
		b.Fatalf("rate %q: %v", s, err)
	}
	return v
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// oneSandbox is the proxy's view of a single public sandbox.
type oneSandbox struct{ sb cagewall.Sandbox }

func (o oneSandbox) Lookup(id string) (proxy.Access, bool) {
	return proxy.Access{Token: o.sb.Token(), Public: true}, id == o.sb.ID()
}

func (o oneSandbox) Ready(context.Context, string, bool) (cagewall.Sandbox, error) { return o.sb, nil }

// BenchmarkExposedPort: an HTTP request (keep-alive) to a server inside a
// sandbox through the daemon's proxy (which reaches it through the agent's
// port forward), against the same request sent straight to the sandbox's
// address from the host, interleaved.
func BenchmarkExposedPort(b *testing.B) {
	h, _ := netHost(b)
	ctx := context.Background()
	sb, err := h.Create(ctx, sandbox.Options{Net: network.Policy{Mode: network.Internet}})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Destroy()
	c := agentclient.New(sb.Dial, sb.Token())
	defer c.Close()
	const server = `cd /tmp && echo hello > x && (nohup python3 -c 'import http.server as h; h.BaseHTTPRequestHandler.protocol_version = "HTTP/1.1"; h.BaseHTTPRequestHandler.disable_nagle_algorithm = True; h.ThreadingHTTPServer(("0.0.0.0", 8000), h.SimpleHTTPRequestHandler).serve_forever()' >/dev/null 2>&1 &)`
	if end, err := c.Run(ctx, agentclient.RunOptions{Cmd: "/bin/sh", Args: []string{"-c", server}, Stdout: io.Discard, Stderr: io.Discard}); err != nil || end.GetExitCode() != 0 {
		b.Fatalf("start the server: %v %+v", err, end)
	}
	srv := httptest.NewServer(proxy.New(oneSandbox{sb}, "", nil))
	defer srv.Close()
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}, Timeout: 10 * time.Second}
	get := func(url string, proxied bool) (time.Duration, error) {
		req, _ := http.NewRequest(http.MethodGet, url, nil)
		if proxied {
			req.Header.Set("E2b-Sandbox-Id", sb.ID())
			req.Header.Set("E2b-Sandbox-Port", "8000")
		}
		start := time.Now()
		resp, err := hc.Do(req)
		if err != nil {
			return 0, err
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || string(body) != "hello\n" {
			return 0, fmt.Errorf("%s: %d %q", url, resp.StatusCode, body)
		}
		return time.Since(start), nil
	}
	direct := "http://" + sb.Network().IP.String() + ":8000/x"
	for deadline := time.Now().Add(20 * time.Second); ; {
		if _, err := get(direct, false); err == nil {
			break
		} else if time.Now().After(deadline) {
			b.Fatalf("the sandbox's server never answered: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	var viaProxy, straight []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		d, err := get(srv.URL+"/x", true)
		if err != nil {
			b.Fatal(err)
		}
		viaProxy = append(viaProxy, d)
		if d, err = get(direct, false); err != nil {
			b.Fatal(err)
		}
		straight = append(straight, d)
	}
	sp, sd := stats.Summarize(viaProxy), stats.Summarize(straight)
	b.ReportMetric(ms(sp.P50), "proxy-p50-ms")
	b.ReportMetric(ms(sp.P99), "proxy-p99-ms")
	b.ReportMetric(ms(sd.P50), "direct-p50-ms")
	b.ReportMetric(ms(sd.P99), "direct-p99-ms")
	b.ReportMetric(float64(sp.P50)/float64(sd.P50), "p50-ratio")
}

// BenchmarkTemplateCreate: create -> first output of `echo` from the test
// image's template against the host template, interleaved in one run
// (process wall); and the host disk each sandbox of the template takes
// before it writes (the filesystem of the store and run directory, with
// 20 sandboxes alive).
func BenchmarkTemplateCreate(b *testing.B) {
	h := processHost(b)
	importTestImage(b)
	ctx := context.Background()
	// The base template when the store has it (scripts/test.sh, make base),
	// else the small test image.
	image := testTemplate
	if _, err := h.Templates.Get("base"); err == nil {
		image = "base"
	}
	b.Logf("image template: %s", image)
	measure := func(tmpl string) time.Duration { return firstOutput(b, h, sandbox.Options{Template: tmpl}) }
	measure(image)
	var hostT, imageT []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		hostT = append(hostT, measure("host"))
		imageT = append(imageT, measure(image))
	}
	b.StopTimer()
	sh, si := stats.Summarize(hostT), stats.Summarize(imageT)
	for _, m := range []struct {
		name string
		d    time.Duration
	}{{"host-p50-ms", sh.P50}, {"host-p95-ms", sh.P95}, {"host-p99-ms", sh.P99},
		{"image-p50-ms", si.P50}, {"image-p95-ms", si.P95}, {"image-p99-ms", si.P99},
		{"diff-p50-ms", si.P50 - sh.P50}, {"diff-p99-ms", si.P99 - sh.P99}} {
		b.ReportMetric(ms(m.d), m.name)
	}
	// Host disk per sandbox, before it writes.
	var before, after syscall.Statfs_t
	_ = syscall.Statfs(h.Templates.Dir(), &before)
	var boxes []interface{ Destroy() error }
	for i := 0; i < 20; i++ {
		sb, err := h.Create(ctx, sandbox.Options{Template: image})
		if err != nil {
			b.Fatal(err)
		}
		boxes = append(boxes, sb)
	}
	_ = syscall.Statfs(h.Templates.Dir(), &after)
	used := (int64(before.Bfree) - int64(after.Bfree)) * before.Bsize
	b.ReportMetric(float64(used)/20/1024, "disk-KiB-per-sandbox")
	for _, sb := range boxes {
		_ = sb.Destroy()
	}
}
