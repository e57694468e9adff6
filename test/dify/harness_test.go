// Package difytest runs `cage serve --dify` as Dify meets it: requests
// built as Dify's code executor builds them (its python3, nodejs and
// jinja2 runner templates around user code, X-Api-Key, enable_network
// true, <<RESULT>> parsed from stdout), its answers read as Dify reads
// them, and hostile code in the runs. The runner templates here are
// cage's own equivalents of Dify's, written from their description.
//
// Needs root, user namespaces, cgroups and a template store with base
// (CAGE_TEMPLATES, as scripts/test.sh builds it); nothing leaves the
// machine (testutil.World is the outside).
package difytest

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/testutil"
	"github.com/cagehq/cage/internal/testutil/cageserve"
)

func TestMain(m *testing.M) { os.Exit(testutil.InOwnNetwork(m)) }

const difyKey = "dify-test-key-6f1c"

// service is a cage serve with its Dify listener.
type service struct {
	d    *cageserve.Daemon
	url  string // http://ADDR of the Dify listener
	http *http.Client
}

// start runs cage serve with a Dify listener configured by dify (merged
// over the key) and extra flags, the test world's resolver and the
// template store of CAGE_TEMPLATES.
func start(t *testing.T, dify map[string]any, flags ...string) *service {
	t.Helper()
	store := os.Getenv("CAGE_TEMPLATES")
	if _, err := os.Stat(filepath.Join(store, "templates", "base.json")); store == "" || err != nil {
		t.Skipf("SKIP: the template store (CAGE_TEMPLATES=%q) has no base: scripts/test.sh (or make base) builds it", store)
	}
	w := testutil.SharedWorld(t)
	section := map[string]any{"key": difyKey}
	for k, v := range dify {
		section[k] = v
	}
	cfg, _ := json.Marshal(map[string]any{"templates": store, "network": map[string]any{"dns": w.Upstreams()}, "dify": section})
	path := filepath.Join(t.TempDir(), "cage.json")
	if err := os.WriteFile(path, cfg, 0o600); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	d := cageserve.Start(t, append([]string{"--config", path, "--dify", addr}, flags...)...)
	s := &service{d: d, url: "http://" + addr, http: &http.Client{Timeout: 2 * time.Minute,
		Transport: &http.Transport{MaxIdleConnsPerHost: 100}}}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if resp, err := http.Get(s.url + "/health"); err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the dify listener does not answer")
		}
	}
	return s
}

func freeAddr(t *testing.T) string {
	t.Helper()
	return testutil.FreeLoopback(t)
}

// runData is the data of a run's envelope.
type runData struct {
	Stdout   string `json:"stdout"`
	Stderr   string `json:"stderr"`
	Error    string `json:"error"`
	ExitCode int    `json:"exit_code"`
}

type envelope struct {
	Code    int             `json:"code"`
	Message string          `json:"message"`
	Data    json.RawMessage `json:"data"`
}

// post sends a raw request to the Dify listener.
func (s *service) post(path, key, ctype string, body []byte) (int, []byte, error) {
	req, err := http.NewRequest(http.MethodPost, s.url+path, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	if key != "" {
		req.Header.Set("X-Api-Key", key)
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	resp, err := s.http.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// errNotDify marks an answer Dify could not read at all.
type errNotDify struct{ error }

// run is one request as Dify's code executor sends it (httpx json=:
// Content-Type application/json; enable_network always true), and the
// answer as it reads it: 503 is "unavailable", another status is a
// failure, then a non-zero code, then a non-empty data.error. An answer
// that is not Dify's envelope is an errNotDify.
func (s *service) run(language, code, preload string) (runData, error) {
	body, _ := json.Marshal(map[string]any{"language": language, "code": code, "preload": preload, "enable_network": true})
	status, b, err := s.post("/v1/sandbox/run", difyKey, "application/json", body)
	var data runData
	switch {
	case err != nil:
		return data, errNotDify{err}
	case status == http.StatusServiceUnavailable:
		return data, fmt.Errorf("Code execution service is unavailable")
	case status != http.StatusOK:
		return data, fmt.Errorf("Failed to execute code, got status code %d, please check if the sandbox service is running", status)
	}
	var env envelope
	if err := json.Unmarshal(b, &env); err != nil {
		return data, errNotDify{fmt.Errorf("not Dify's envelope: %v: %s", err, b)}
	}
	if env.Code != 0 {
		return data, fmt.Errorf("Got error code: %d. Got error msg: %s", env.Code, env.Message)
	}
	if err := json.Unmarshal(env.Data, &data); err != nil {
		return data, errNotDify{fmt.Errorf("data is not a run result: %v: %s", err, b)}
	}
	if data.Error != "" {
		return data, fmt.Errorf("%s", data.Error)
	}
	return data, nil
}

// mustRun is run in the test's goroutine: an answer Dify cannot read
// fails the test at once.
func (s *service) mustRun(t *testing.T, language, code, preload string) (runData, error) {
	t.Helper()
	out, err := s.run(language, code, preload)
	var nd errNotDify
	if errors.As(err, &nd) {
		t.Fatal(nd.error)
	}
	return out, err
}

// The runner templates: user code wrapped as Dify wraps it, the inputs
// as base64 of their JSON, the output between <<RESULT>> markers.

func b64JSON(inputs map[string]any) string {
	b, _ := json.Marshal(inputs)
	return base64.StdEncoding.EncodeToString(b)
}

func pythonRunner(code string, inputs map[string]any) string {
	return code + `

import json
from base64 import b64decode

# the node's inputs
inputs_obj = json.loads(b64decode('` + b64JSON(inputs) + `').decode('utf-8'))

# the user's main, called with them
output_obj = main(**inputs_obj)

# the result, where Dify looks for it
output_json = json.dumps(output_obj, indent=4)
print(f'''<<RESULT>>{output_json}<<RESULT>>''')
`
}

func nodeRunner(code string, inputs map[string]any) string {
	return code + `

// the node's inputs
var inputs_obj = JSON.parse(Buffer.from('` + b64JSON(inputs) + `', 'base64').toString('utf-8'))

// the user's main, called with them
var output_obj = main(inputs_obj)

// the result, where Dify looks for it
var output_json = JSON.stringify(output_obj)
console.log(` + "`<<RESULT>>${output_json}<<RESULT>>`" + `)
`
}

// jinjaRunner renders a Jinja2 template with the inputs in python3, as
// Dify's template nodes do.
func jinjaRunner(template string, inputs map[string]any) string {
	return `
def main(**inputs):
    import jinja2
    template = jinja2.Template('''` + template + `''')
    return template.render(**inputs)

import json
from base64 import b64decode

inputs_obj = json.loads(b64decode('` + b64JSON(inputs) + `').decode('utf-8'))
output = main(**inputs_obj)
print(f'''<<RESULT>>{output}<<RESULT>>''')
`
}

// jinjaPreload is what Dify sends as preload with a template (it warms
// jinja2; dify-sandbox, and cage, do not run it).
const jinjaPreload = `
import jinja2
from base64 import b64decode

def _jinja2_preload_():
    jinja2.Template('{{s}}').render(s='a')

if __name__ == '__main__':
    _jinja2_preload_()
`

var resultRE = regexp.MustCompile(`(?s)<<RESULT>>(.*)<<RESULT>>`)

// result is how Dify reads a python3 or nodejs node's output: the text
// between the markers, a JSON object with string keys.
func result(t *testing.T, stdout string) map[string]any {
	t.Helper()
	m := resultRE.FindStringSubmatch(stdout)
	if m == nil {
		t.Fatalf("Failed to parse result: no <<RESULT>> in %q", stdout)
	}
	var out map[string]any
	if err := json.Unmarshal([]byte(m[1]), &out); err != nil {
		t.Fatalf("Failed to parse result: %v: %q", err, m[1])
	}
	return out
}
