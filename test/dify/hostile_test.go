package difytest

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil"
)

// Hostile code in Dify's runs: each states its outcome, and the service
// goes on.

// alive checks that the service answers and runs code.
func (s *service) alive(t *testing.T) {
	t.Helper()
	out, err := s.mustRun(t, "python3", pythonRunner("def main() -> dict:\n    return {'alive': True}\n", map[string]any{}), "")
	if err != nil || result(t, out.Stdout)["alive"] != true {
		t.Fatalf("the next run: %v %+v", err, out)
	}
}

func (s *service) testMemoryBomb(t *testing.T) {
	bomb := "hold = []\nwhile True:\n    hold.append(b'x' * (16 << 20))\n"
	out, err := s.mustRun(t, "python3", bomb, "")
	if err == nil || out.ExitCode != -1 || !strings.Contains(out.Error, "out of memory (the limit is 128MiB)") {
		t.Fatalf("memory bomb: %v %+v; want killed, out of memory", err, out)
	}
	s.alive(t)
}

func (s *service) testForkBomb(t *testing.T) {
	bomb := `import os
while True:
    try:
        os.fork()
    except OSError:
        pass
`
	out, err := s.mustRun(t, "python3", bomb, "")
	if err == nil || out.ExitCode == 0 {
		t.Fatalf("fork bomb: %v %+v; want a failure", err, out)
	}
	t.Logf("fork bomb: exit %d, %q", out.ExitCode, firstLine(out.Error, 2))
	s.alive(t)
	if status, _, err := s.d.Do(http.MethodGet, "/health", "", nil); err != nil || status != 200 {
		t.Fatalf("the control API after the fork bomb: %d %v", status, err)
	}
}

func firstLine(s string, n int) string {
	lines := strings.SplitN(s, "\n", n+1)
	return strings.Join(lines[:min(n, len(lines))], " | ")
}

// testHostFiles: code that looks for the host's files finds the
// sandbox's own (the host's secret is nowhere, /proc/1 is the agent's).
func (s *service) testHostFiles(t *testing.T) {
	name := fmt.Sprintf("cage-dify-%d", time.Now().UnixNano())
	secret := "secret content " + name // what must not come out
	path := filepath.Join(os.TempDir(), name)
	if err := os.WriteFile(path, []byte(secret), 0o644); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(path)
	if err := os.WriteFile("/root/"+name, []byte(secret), 0o600); err == nil {
		defer os.Remove("/root/" + name)
	}
	probe := `import json, os
def main(path: str, name: str) -> dict:
    out = {"uid": os.getuid()}
    for p in [path, "/proc/1/root" + path, "/root/" + name, "/etc/shadow", "/proc/1/environ"]:
        try:
            with open(p) as f:
                out[p] = "read: " + f.read(200)
        except Exception as e:
            out[p] = "refused: " + type(e).__name__
    return out
`
	out, err := s.mustRun(t, "python3", pythonRunner(probe, map[string]any{"path": path, "name": name}), "")
	if err != nil {
		t.Fatal(err)
	}
	r := result(t, out.Stdout)
	if strings.Contains(out.Stdout+out.Stderr, secret) {
		t.Fatalf("the host's file was read: %v", r)
	}
	for k, v := range r {
		if k != "uid" && !strings.HasPrefix(fmt.Sprint(v), "refused") {
			t.Errorf("%s: %v, want refused", k, v)
		}
	}
	if r["uid"] != float64(1000) {
		t.Errorf("the code ran as uid %v, want the sandbox's user (1000)", r["uid"])
	}
}

// testNetwork: enable_network (Dify always sends it) is the internet
// minus the always-denied: the test world's public host answers; cloud
// metadata, the host itself and private ranges are refused, and the
// metadata services see nothing. Without it, there is no network.
func (s *service) testNetwork(t *testing.T) {
	w := testutil.SharedWorld(t)
	metaHits := 0
	for _, a := range testutil.MetadataAddrs {
		metaHits += w.Hits("metadata " + a.String())
	}
	probe := `import urllib.request
def main(urls: list) -> dict:
    out = {}
    for u in urls:
        try:
            out[u] = urllib.request.urlopen(u, timeout=5).read().decode()
        except Exception as e:
            out[u] = "refused: " + type(e).__name__
    return out
`
	public := "http://allowed.example.com/"
	urls := []string{public, "http://metadata.google.internal/computeMetadata/v1/", "http://" + w.HostHTTP.String() + "/"}
	for _, a := range testutil.MetadataAddrs {
		urls = append(urls, "http://"+a.String()+"/latest/meta-data/")
	}
	out, err := s.mustRun(t, "python3", pythonRunner(probe, map[string]any{"urls": urls}), "")
	if err != nil {
		t.Fatal(err)
	}
	r := result(t, out.Stdout)
	if r[public] != "public "+testutil.PublicHost.String() {
		t.Fatalf("the public host: %v (the internet policy does not work, so refusals below prove nothing)", r[public])
	}
	for _, u := range urls[1:] {
		if v := fmt.Sprint(r[u]); !strings.HasPrefix(v, "refused") {
			t.Errorf("%s: %q, want refused", u, v)
		}
	}
	after := 0
	for _, a := range testutil.MetadataAddrs {
		after += w.Hits("metadata " + a.String())
	}
	if after != metaHits {
		t.Errorf("the metadata services were reached %d times", after-metaHits)
	}
	// enable_network false: no network at all.
	body, _ := json.Marshal(map[string]any{"language": "python3", "code": pythonRunner(probe, map[string]any{"urls": []string{public}}), "enable_network": false})
	status, b, err := s.post("/v1/sandbox/run", difyKey, "application/json", body)
	if err != nil {
		t.Fatal(err)
	}
	var env struct{ Data runData }
	_ = json.Unmarshal(b, &env)
	if status != 200 || !strings.Contains(result(t, env.Data.Stdout)[public].(string), "refused") {
		t.Fatalf("enable_network false reached the public host: %d %s", status, b)
	}
}
