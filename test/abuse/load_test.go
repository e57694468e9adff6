package abuse

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/proxy"
	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// TestThousandRPCs: 1,000 RPCs and command streams at once into one
// sandbox through the proxy: every one answers correctly, the daemon and
// the agent stay within bounded memory.
func TestThousandRPCs(t *testing.T) {
	d := cageserve.Start(t)
	sb := d.Create(t, d.Key, map[string]any{"timeout": 600, "pids": 4096, "memoryMB": 1024})
	daemonRSS0, _, err := cageserve.Memory(d.PID())
	if err != nil {
		t.Fatal(err)
	}
	n := scale(1000)
	const clients = 20 // an h2c connection each, as many SDK processes would have
	acs := make([]*agentclient.Client, clients)
	for i := range acs {
		acs[i] = d.Agent(sb.SandboxID, sb.EnvdAccessToken)
		defer acs[i].Close()
	}
	var failed atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	t0 := time.Now()
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ac := acs[i%clients]
			<-start
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			var err error
			if i%5 < 3 { // three in five unary, two in five streams
				var res *connect.Response[fspb.StatResponse]
				res, err = ac.FS.Stat(ctx, connect.NewRequest(&fspb.StatRequest{Path: "/etc/hostname"}))
				if err == nil && res.Msg.GetEntry().GetName() != "hostname" {
					err = fmt.Errorf("stat answered %v", res.Msg.GetEntry())
				}
			} else {
				var out strings.Builder
				var end interface{ GetExitCode() int32 }
				end, err = ac.Run(ctx, agentclient.RunOptions{Cmd: "/bin/echo", Args: []string{strconv.Itoa(i)}, Stdout: &out, Stderr: io.Discard})
				if err == nil && (end.GetExitCode() != 0 || out.String() != strconv.Itoa(i)+"\n") {
					err = fmt.Errorf("echo %d: exit %d, %q", i, end.GetExitCode(), out.String())
				}
			}
			if err != nil && failed.Add(1) <= 5 {
				t.Errorf("operation %d: %v", i, err)
			}
		}()
	}
	close(start)
	wg.Wait()
	took := time.Since(t0)
	_, daemonPeak, _ := cageserve.Memory(d.PID())
	t.Logf("%d concurrent operations (%d clients) in %v; daemon RSS %.1f MiB before, peak %.1f MiB; %d failed",
		n, clients, took.Round(time.Millisecond), mib(daemonRSS0), mib(daemonPeak), failed.Load())
	if failed.Load() > 0 {
		t.Errorf("%d of %d operations failed", failed.Load(), n)
	}
	if daemonPeak-daemonRSS0 > 256<<20 {
		t.Errorf("the daemon grew by %.1f MiB for %d operations (bound 256 MiB)", mib(daemonPeak-daemonRSS0), n)
	}
}

// TestPortSweep: a client asks the proxy for every port of a sandbox
// (nothing listens on them). Each gets E2B's 502 (the code interpreter's
// 49999 a 401 first: running code there takes the access token), and the daemon's memory
// stays bounded: before the fix it kept a connection pool and a goroutine
// per port ever asked for, 65,535 of them per sandbox.
func TestPortSweep(t *testing.T) {
	d := cageserve.Start(t)
	sb, status, msg := d.TryCreate(d.Key, map[string]any{"timeout": 600, "network": map[string]any{"allowPublicTraffic": true}})
	if status != http.StatusCreated {
		t.Fatalf("create: %d %s", status, msg)
	}
	rss0, _, err := cageserve.Memory(d.PID())
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: time.Minute}
	ports := make(chan int)
	var wrong atomic.Int64
	var wg sync.WaitGroup
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for port := range ports {
				req, _ := http.NewRequest(http.MethodGet, "http://"+d.Proxy+"/", nil)
				req.Header.Set("E2b-Sandbox-Id", sb.SandboxID)
				req.Header.Set("E2b-Sandbox-Port", strconv.Itoa(port))
				resp, err := hc.Do(req)
				if err != nil {
					wrong.Add(1)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				want := http.StatusBadGateway
				if port == proxy.InterpPort {
					want = http.StatusUnauthorized // the code interpreter's port: GET / needs the access token
				}
				if resp.StatusCode != want {
					t.Logf("port %d: %d, want %d", port, resp.StatusCode, want)
					wrong.Add(1)
				}
			}
		}()
	}
	t0 := time.Now()
	last := min(65535, scale(65535))
	for port := 1; port <= last; port++ {
		if port == 49983 {
			continue
		}
		ports <- port
	}
	close(ports)
	wg.Wait()
	rss, peak, err := cageserve.Memory(d.PID())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("swept %d ports in %v; daemon RSS %.1f MiB before, %.1f MiB after, peak %.1f MiB; %d answers were not as expected",
		last-1, time.Since(t0).Round(time.Millisecond), mib(rss0), mib(rss), mib(peak), wrong.Load())
	if wrong.Load() > 0 {
		t.Errorf("%d ports did not get E2B's 502 (or 401 on 49999)", wrong.Load())
	}
	if peak-rss0 > 128<<20 {
		t.Errorf("a port sweep grew the daemon by %.1f MiB (bound 128 MiB)", mib(peak-rss0))
	}
	// The sandbox still answers.
	ac := d.Agent(sb.SandboxID, sb.EnvdAccessToken)
	defer ac.Close()
	if out, err := runSh(ac, "echo alive"); err != nil || out != "alive\n" {
		t.Errorf("the sandbox after the sweep: %q %v", out, err)
	}
}

// TestSlowloris: from one address, slow clients (headers a byte at a time)
// and idle keep-alive connections hold both listeners, and more connections
// than a client may have are opened. The server closes the slow ones once
// the header time runs out and refuses the surplus at once, while a
// bystander tenant from another address keeps creating, running and
// listing. Its latencies, with and without the attack, are logged.
func TestSlowloris(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "cage.json")
	if err := os.WriteFile(cfg, []byte(`{"limits": {"conns_per_client": 200}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	d := cageserve.Start(t, "--config", cfg)
	sb := d.Create(t, d.Key, map[string]any{"timeout": 600})
	ac := d.Agent(sb.SandboxID, sb.EnvdAccessToken)
	defer ac.Close()
	bystander := func(rounds int) (exec, api []time.Duration) {
		for range rounds {
			t0 := time.Now()
			if out, err := runSh(ac, "echo ok"); err != nil || out != "ok\n" {
				t.Errorf("bystander command: %q %v", out, err)
			}
			exec = append(exec, time.Since(t0))
			t0 = time.Now()
			if status, _, err := d.Do(http.MethodGet, "/v2/sandboxes", d.Key, nil); err != nil || status != http.StatusOK {
				t.Errorf("bystander list: %d %v", status, err)
			}
			api = append(api, time.Since(t0))
		}
		return exec, api
	}
	quietExec, quietAPI := bystander(30)

	attacker := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}, Timeout: 5 * time.Second}
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	// The API's share of the attack fills the attacker's cap (200) exactly,
	// the proxy's nearly.
	for addr, n := range map[string]int{d.API: 200, d.Proxy: 150} {
		for i := range n {
			c, err := attacker.Dial("tcp", addr)
			if err != nil {
				t.Fatalf("attacker connection %d to %s: %v", i, addr, err)
			}
			if i%2 == 0 { // slow: a request line, then nothing
				_, _ = c.Write([]byte("GET /v2/sandboxes HTTP/1.1\r\nHost: x\r\nX-Slow: "))
			} // else idle: connected, never a byte
			conns = append(conns, c)
		}
	}
	// Over the cap: each closed at once by the server.
	var surplusClosed atomic.Int64
	var swg sync.WaitGroup
	for range 20 {
		swg.Add(1)
		go func() {
			defer swg.Done()
			c, err := attacker.Dial("tcp", d.API)
			if err != nil {
				surplusClosed.Add(1)
				return
			}
			defer c.Close()
			_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
			if _, err := c.Read(make([]byte, 1)); err == io.EOF || isReset(err) {
				surplusClosed.Add(1)
			}
		}()
	}
	swg.Wait()
	t0 := time.Now()
	attackExec, attackAPI := bystander(30)
	// Every held connection is closed by the server within the header time
	// (10 s) and a margin: reads end in EOF, not in our own deadline.
	var held int
	var wg sync.WaitGroup
	var mu sync.Mutex
	for _, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = c.SetReadDeadline(t0.Add(30 * time.Second))
			r := bufio.NewReader(c)
			for {
				if _, err := r.ReadByte(); err != nil {
					if ne, ok := err.(net.Error); ok && ne.Timeout() {
						mu.Lock()
						held++
						mu.Unlock()
					}
					return
				}
			}
		}()
	}
	wg.Wait()
	q, a := pct(quietExec), pct(attackExec)
	qa, aa := pct(quietAPI), pct(attackAPI)
	t.Logf("bystander command through the proxy: p50 %v p99 %v quiet, p50 %v p99 %v under attack (%.2fx p50)", q[0], q[1], a[0], a[1], float64(a[0])/float64(q[0]))
	t.Logf("bystander API list: p50 %v p99 %v quiet, p50 %v p99 %v under attack (%.2fx p50)", qa[0], qa[1], aa[0], aa[1], float64(aa[0])/float64(qa[0]))
	t.Logf("%d slow and idle connections; %d still open 30 s on; %d of 20 over the cap closed at once", len(conns), held, surplusClosed.Load())
	if held > 0 {
		t.Errorf("%d of %d slow or idle connections were still open 30 s later (header time 10 s)", held, len(conns))
	}
	if surplusClosed.Load() != 20 {
		t.Errorf("%d of 20 connections over the per-client cap (200, all held) were closed at once, want all", surplusClosed.Load())
	}
}

func isReset(err error) bool {
	return err != nil && strings.Contains(err.Error(), "connection reset")
}

// pct is the p50 and p99 of ds.
func pct(ds []time.Duration) [2]time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return [2]time.Duration{s[len(s)/2], s[(len(s)*99)/100]}
}
