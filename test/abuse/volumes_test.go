package abuse

import (
	"encoding/json"
	"io"
	"net/http"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/apispec"
	"github.com/cagehq/cage/internal/testutil/cageserve"
)

// TestCrossKeyVolumes is the cross-key matrix of the volume routes: every
// route of api/openapi.yaml under /volumes/{volumeID} answers tenant B's
// key on A's volume exactly as on a volume that never existed (404, the
// same body), and changes nothing; every content route answers B's
// volume's token on A's volume as a token that opens nothing (401, the
// same body); B's name is B's own (a mount by A's volume's name gets B's
// volume, or none).
func TestCrossKeyVolumes(t *testing.T) {
	d := cageserve.Start(t)
	keyA, keyB := d.Key, d.NewKey(t, "tenant-b")
	volA, volB := newVolume(t, d, keyA, "shared-name"), newVolume(t, d, keyB, "b-only")
	writeFile(t, d, volA, "/secret.txt", "A's data\n")
	const ghost = "0123456789abcdef0123"

	doc, err := apispec.Doc()
	if err != nil {
		t.Fatal(err)
	}
	var control, content []string
	for path, item := range doc.Paths.Map() {
		for method := range item.Operations() {
			switch {
			case strings.HasPrefix(path, "/volumes/{volumeID}"):
				control = append(control, method+" "+path)
			case strings.HasPrefix(path, "/volumecontent/{volumeID}"):
				content = append(content, method+" "+path)
			}
		}
	}
	sort.Strings(control)
	sort.Strings(content)
	if len(control) < 2 || len(content) < 7 {
		t.Fatalf("the document lists %d volume and %d content routes: %v %v", len(control), len(content), control, content)
	}
	for _, route := range control {
		method, path, _ := strings.Cut(route, " ")
		status, got, err := d.Do(method, strings.ReplaceAll(path, "{volumeID}", volA.VolumeID), keyB, nil)
		if err != nil {
			t.Fatal(err)
		}
		gStatus, want, _ := d.Do(method, strings.ReplaceAll(path, "{volumeID}", ghost), keyB, nil)
		if status != http.StatusNotFound || gStatus != http.StatusNotFound {
			t.Errorf("%s with B's key on A's volume: %d %s (never existed: %d); want 404", route, status, got, gStatus)
		} else if strings.ReplaceAll(string(got), volA.VolumeID, ghost) != string(want) {
			t.Errorf("%s: B learns A's volume exists: %s, against %s", route, got, want)
		}
	}
	for _, route := range content {
		method, path, _ := strings.Cut(route, " ")
		var body io.Reader
		if method == http.MethodPut || method == http.MethodPatch {
			body = strings.NewReader(`{"mode":511}`)
		}
		status, got := contentDo(t, d, method, strings.ReplaceAll(path, "{volumeID}", volA.VolumeID)+"?path=/secret.txt", volB.Token, body)
		if method == http.MethodPut || method == http.MethodPatch {
			body = strings.NewReader(`{"mode":511}`)
		}
		gStatus, want := contentDo(t, d, method, strings.ReplaceAll(path, "{volumeID}", ghost)+"?path=/secret.txt", volB.Token, body)
		if status != http.StatusUnauthorized || gStatus != http.StatusUnauthorized {
			t.Errorf("%s with B's volume token on A's volume: %d %s (never existed: %d); want 401", route, status, got, gStatus)
		} else if strings.ReplaceAll(string(got), volA.VolumeID, ghost) != string(want) {
			t.Errorf("%s: B's token learns A's volume exists: %s, against %s", route, got, want)
		}
	}
	// A's volume is as A left it.
	if status, got := contentDo(t, d, "GET", "/volumecontent/"+volA.VolumeID+"/file?path=/secret.txt", volA.Token, nil); status != http.StatusOK || string(got) != "A's data\n" {
		t.Errorf("A's file after B's attempts: %d %q", status, got)
	}
	// Lists: each its own.
	_, out, _ := d.Do("GET", "/volumes", keyB, nil)
	if strings.Contains(string(out), volA.VolumeID) || !strings.Contains(string(out), volB.VolumeID) {
		t.Errorf("GET /volumes with B's key: %s", out)
	}
	// B mounting by A's volume's name: B has no volume of that name.
	_, status, msg := d.TryCreate(keyB, map[string]any{"volumeMounts": []map[string]string{{"name": "shared-name", "path": "/mnt/a"}}})
	if status != http.StatusBadRequest || strings.Contains(msg, volA.VolumeID) {
		t.Errorf("B mounting A's volume by name: %d %s; want 400 (B has no such volume), naming nothing of A's", status, msg)
	}
}

func newVolume(t *testing.T, d *cageserve.Daemon, key, name string) types.VolumeAndToken {
	t.Helper()
	status, b, err := d.Do("POST", "/volumes", key, map[string]any{"name": name})
	if err != nil || status != http.StatusCreated {
		t.Fatalf("POST /volumes %s: %d %s %v", name, status, b, err)
	}
	var v types.VolumeAndToken
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _, _ = d.Do("DELETE", "/volumes/"+v.VolumeID, key, nil) })
	return v
}

func writeFile(t *testing.T, d *cageserve.Daemon, v types.VolumeAndToken, path, data string) {
	t.Helper()
	if status, b := contentDo(t, d, "PUT", "/volumecontent/"+v.VolumeID+"/file?path="+path, v.Token, strings.NewReader(data)); status != http.StatusCreated {
		t.Fatalf("PUT %s: %d %s", path, status, b)
	}
}

// contentDo sends a content API request with a bearer token.
func contentDo(t *testing.T, d *cageserve.Daemon, method, path, token string, body io.Reader) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, "http://"+d.API+path, body)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := d.HTTP.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// TestVolumeContentRate: the content routes take a volume's token, not a
// key, so they get a bucket per volume owner at the owner's request rate:
// a team at 5 requests a second gets a burst of 10 content requests over
// all its volumes, then 429 in the content API's shape with Retry-After
// (before an upload's body is read), and is served again after it. Its
// keys' API requests and another owner's volumes are not held by it.
func TestVolumeContentRate(t *testing.T) {
	d := cageserve.Start(t)
	admin := d.NewKeyIn(t, "ops", "admin")
	st, _, out := call(t, d, "POST", "/admin/teams", admin, map[string]any{"name": "slowvol",
		"rateLimits": map[string]any{"requestsPerSecond": 5}})
	if st != http.StatusCreated {
		t.Fatalf("POST /admin/teams: %d %s", st, out)
	}
	key := d.NewKeyIn(t, "v1", "slowvol")
	v1, v2 := newVolume(t, d, key, "one"), newVolume(t, d, key, "two")
	other := newVolume(t, d, d.Key, "elsewhere")

	// The bucket refills at 5 a second while they go: one by one, on a
	// slow host, they earn more than the burst, so they go until three
	// are refused, and what is served is bounded by the time they took.
	ok, limited, retry := 0, 0, ""
	start := time.Now()
	for i := 0; limited < 3 && i < 200; i++ {
		v := v1
		if i%2 == 1 {
			v = v2 // one bucket for all the team's volumes
		}
		req, _ := http.NewRequest("GET", "http://"+d.API+"/volumecontent/"+v.VolumeID+"/dir?path=/", nil)
		req.Header.Set("Authorization", "Bearer "+v.Token)
		resp, err := d.HTTP.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusOK:
			ok++
		case http.StatusTooManyRequests:
			limited++
			retry = resp.Header.Get("Retry-After")
			var e types.VolumeContentError
			if json.Unmarshal(b, &e) != nil || e.Code != "rate_limited" || !strings.Contains(e.Message, "rate limit") {
				t.Errorf("429 body: %s", b)
			}
		default:
			t.Fatalf("GET dir: %d %s", resp.StatusCode, b)
		}
	}
	took := time.Since(start)
	if most := 11 + int(5*took.Seconds()); ok < 10 || ok > most || limited < 3 || retry != "1" {
		t.Errorf("content requests at 5/s for %v: %d served, %d refused (Retry-After %q); want 10 to %d served (the burst and what %v earns), then 429 with Retry-After 1",
			took.Round(time.Millisecond), ok, limited, retry, most, took.Round(time.Millisecond))
	}
	// Refused before the body is read: an upload of 8 MiB is answered at
	// once, and nothing is written. Not to slowvol's volumes: a refusal
	// leaves their bucket up to a token short, and it refills at 5 a
	// second, so an upload sent a moment later could find a token (then
	// its body is read and written). A team at 0.01 a second (a burst of
	// 1) earns none for 100 s.
	st, _, out = call(t, d, "POST", "/admin/teams", admin, map[string]any{"name": "glacial",
		"rateLimits": map[string]any{"requestsPerSecond": 0.01}})
	var glacial types.Team
	if st != http.StatusCreated || json.Unmarshal([]byte(out), &glacial) != nil || glacial.TeamID == "" {
		t.Fatalf("POST /admin/teams: %d %s", st, out)
	}
	cold := newVolume(t, d, d.NewKeyIn(t, "g1", "glacial"), "cold")
	if st, b := contentDo(t, d, "GET", "/volumecontent/"+cold.VolumeID+"/dir?path=/", cold.Token, nil); st != http.StatusOK {
		t.Fatalf("a volume at 0.01/s, its first content request: %d %s", st, b)
	}
	if st, b := contentDo(t, d, "PUT", "/volumecontent/"+cold.VolumeID+"/file?path=/big", cold.Token, strings.NewReader(strings.Repeat("x", 8<<20))); st != http.StatusTooManyRequests {
		t.Errorf("an upload over the rate: %d %s; want 429", st, b)
	}
	// Not the team's keys' API requests, nor another owner's volumes.
	if st, _, body := call(t, d, "GET", "/v2/sandboxes", key, nil); st != http.StatusOK {
		t.Errorf("the team's key's API request while its volumes are limited: %d %s", st, body)
	}
	if st, b := contentDo(t, d, "GET", "/volumecontent/"+other.VolumeID+"/dir?path=/", other.Token, nil); st != http.StatusOK {
		t.Errorf("another owner's volume while the team's are limited: %d %s", st, b)
	}
	time.Sleep(time.Second)
	if st, b := contentDo(t, d, "GET", "/volumecontent/"+v1.VolumeID+"/dir?path=/", v1.Token, nil); st != http.StatusOK {
		t.Errorf("after Retry-After: %d %s", st, b)
	}
	// The refused upload wrote nothing: once glacial's rate is raised
	// (at once, through the admin API), its file is not there.
	if st, _, out := call(t, d, "PATCH", "/admin/teams/"+glacial.TeamID, admin,
		map[string]any{"rateLimits": map[string]any{"requestsPerSecond": 1000}}); st != http.StatusOK {
		t.Fatalf("PATCH /admin/teams/%s: %d %s", glacial.TeamID, st, out)
	}
	time.Sleep(20 * time.Millisecond) // 20 tokens at 1,000 a second
	if st, b := contentDo(t, d, "GET", "/volumecontent/"+cold.VolumeID+"/file?path=/big", cold.Token, nil); st != http.StatusNotFound {
		t.Errorf("the refused upload's file: %d %s; want 404 (served, never written)", st, b)
	}
}
