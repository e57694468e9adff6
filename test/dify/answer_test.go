package difytest

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestDifyAnswerBounded: a run whose stdout and stderr are control bytes
// (6 bytes each once JSON-escaped: \u0001) and which exits 1 (so that
// stderr is repeated in error) gets an answer bounded by what max_output
// says, measured as sent: each stream's JSON at most max_output, error's
// copy of stderr at most 64 KiB (here max_output) more. Before, the answer
// was some 18 times max_output (72 MiB at the default 4 MiB). Dify still
// reads it: stdout is a prefix of what the code wrote, error names the
// exit code and the cut, stderr's last bytes are in error. Found by review,
// 2026-12-03.
func TestDifyAnswerBounded(t *testing.T) {
	const maxOutput = 64 << 10
	s := start(t, map[string]any{"timeout": "20s", "max_output": "64K"})
	code := "import sys\n" +
		"sys.stdout.write('\\x01' * 70000)\n" +
		"sys.stderr.write('<' * 20000 + 'Traceback: the end\\n')\n" +
		"sys.exit(1)\n"
	body, _ := json.Marshal(map[string]any{"language": "python3", "code": code, "preload": "", "enable_network": true})
	status, b, err := s.post("/v1/sandbox/run", difyKey, "application/json", body)
	if err != nil || status != 200 {
		t.Fatalf("run: %d %v %.200s", status, err, b)
	}
	var env envelope
	var data runData
	if err := json.Unmarshal(b, &env); err != nil || env.Code != 0 || json.Unmarshal(env.Data, &data) != nil {
		t.Fatalf("answer: %v %.300s", err, b)
	}
	t.Logf("answer: %d bytes; stdout %d, stderr %d, error %d bytes", len(b), len(data.Stdout), len(data.Stderr), len(data.Error))
	field := func(v string) int { j, _ := json.Marshal(v); return len(j) }
	if n := field(data.Stdout); n > maxOutput+2 {
		t.Errorf("stdout is %d bytes as JSON, want at most max_output (%d)", n, maxOutput)
	}
	if n := field(data.Stderr); n > maxOutput+2 {
		t.Errorf("stderr is %d bytes as JSON, want at most max_output (%d)", n, maxOutput)
	}
	if n := field(data.Error); n > maxOutput+512 {
		t.Errorf("error is %d bytes as JSON, want at most max_output (%d) and its lines", n, maxOutput)
	}
	if len(b) > 3*maxOutput+1024 {
		t.Errorf("the answer is %d bytes, want at most 3 × max_output and the envelope", len(b))
	}
	if data.ExitCode != 1 || !strings.HasPrefix(data.Error, "process exited with code 1\n") ||
		!strings.Contains(data.Error, "error: output truncated at 64KiB per stream\n") ||
		!strings.HasSuffix(data.Error, "<<<Traceback: the end\n") {
		t.Errorf("exit %d, error %.200q…%.100q: want exit 1, the cut named and stderr's end", data.ExitCode, data.Error, data.Error[max(0, len(data.Error)-100):])
	}
	if data.Stdout == "" || strings.Trim(data.Stdout, "\x01") != "" {
		t.Errorf("stdout is not a prefix of what the code wrote: %.100q", data.Stdout)
	}
	if data.Stderr == "" || !strings.HasPrefix(strings.Repeat("<", 20000)+"Traceback: the end\n", data.Stderr) {
		t.Errorf("stderr is not a prefix of what the code wrote: %.100q", data.Stderr)
	}
}
