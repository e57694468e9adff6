package mcp

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sort"
	"strings"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
)

// run_code: code through the code interpreter (cage-interp, port 49999 of
// template code-interpreter-v1), reached through the daemon's proxy with
// the sandbox's access token, as @e2b/code-interpreter reaches it.

const (
	interpPort  = "49999"
	maxImages   = 8
	maxImage    = 4 << 20 // decoded bytes of one image returned
	maxLineSize = 24 << 20
	// What a run's answer keeps of its results (the daemon holds it for
	// as long as the run lasts, up to an hour): the first maxResults, and
	// of their text, HTML and JSON maxResultBytes in all; a result's JSON
	// only if it is at most 64 KiB written out; maxDropped reasons.
	maxResults     = 64
	maxResultBytes = 1 << 20
	maxDropped     = 32
	// What the answer keeps of the run's error (its first): the
	// exception's name, its value and its traceback.
	maxErrorName  = 256
	maxErrorValue = 64 << 10
	maxTraceback  = 16 << 10
)

type codeIn struct {
	SandboxID      string            `json:"sandbox_id" jsonschema:"the sandbox (of template code-interpreter-v1, or one built from it)"`
	Code           string            `json:"code" jsonschema:"the code to run; state (variables, imports) stays between runs in the same context"`
	Language       string            `json:"language,omitempty" jsonschema:"python (default), javascript, typescript, r or bash; runs in that language's default context"`
	ContextID      string            `json:"context_id,omitempty" jsonschema:"a code context made with the code interpreter's API instead of a language's default one"`
	Envs           map[string]string `json:"envs,omitempty" jsonschema:"environment variables for this run only"`
	TimeoutS       int64             `json:"timeout_s,omitempty" jsonschema:"interrupt the run after this many seconds (the context keeps its state)"`
	MaxOutputBytes int               `json:"max_output_bytes,omitempty" jsonschema:"bytes kept of stdout and of stderr each; beyond, the head and the tail are kept and truncated is set"`
}

var codeSchema = lazySchema[codeIn](func(p props) {
	p.sandboxID().minLen("code", 1).maxLen("code", maxCodeLen).
		enum("language", "python", "javascript", "typescript", "r", "bash").maxLen("context_id", 128).
		maxProps("envs", maxEnvs).def("timeout_s", defaultExecTimeout).rng("timeout_s", 1, maxExecTimeout).
		def("max_output_bytes", defaultOutput).rng("max_output_bytes", minOutput, maxOutput)
})

type codeResult struct {
	IsMain  bool     `json:"is_main" jsonschema:"the value of the run's last expression (else: something displayed)"`
	Text    string   `json:"text,omitempty" jsonschema:"its text/plain form"`
	Formats []string `json:"formats" jsonschema:"the forms it came in (png and jpeg are returned as image content)"`
	HTML    string   `json:"html,omitempty"`
	JSON    any      `json:"json,omitempty"`
}

type codeError struct {
	Name      string `json:"name"`
	Value     string `json:"value"`
	Traceback string `json:"traceback,omitempty"`
}

type codeOut struct {
	Stdout    string       `json:"stdout"`
	Stderr    string       `json:"stderr"`
	Results   []codeResult `json:"results"`
	Error     *codeError   `json:"error,omitempty" jsonschema:"the exception the code raised, if it did"`
	Images    int          `json:"images" jsonschema:"images returned as image content"`
	Truncated bool         `json:"truncated" jsonschema:"output or images were left out (said in the text)"`
}

func checkCode(in codeIn) error {
	if err := checkID(in.SandboxID); err != nil {
		return err
	}
	switch {
	case strings.TrimSpace(in.Code) == "":
		return errors.New("code is empty")
	case len(in.Code) > maxCodeLen:
		return fmt.Errorf("code is %d bytes, over %d: write it to a file with file_write and run that", len(in.Code), maxCodeLen)
	case in.Language != "" && in.ContextID != "":
		return errors.New("give language or context_id, not both")
	case in.TimeoutS < 0 || in.TimeoutS > maxExecTimeout:
		return fmt.Errorf("timeout_s %d: want 1 to %d", in.TimeoutS, maxExecTimeout)
	case in.MaxOutputBytes != 0 && (in.MaxOutputBytes < minOutput || in.MaxOutputBytes > maxOutput):
		return fmt.Errorf("max_output_bytes %d: want %d to %d", in.MaxOutputBytes, minOutput, maxOutput)
	}
	return checkEnvs(in.Envs)
}

func (t *tools) runCode(ctx context.Context, _ *sdk.CallToolRequest, in codeIn) (*sdk.CallToolResult, codeOut, error) {
	if err := checkCode(in); err != nil {
		return nil, codeOut{}, err
	}
	sb, err := t.reach(ctx, in.SandboxID)
	if err != nil {
		return nil, codeOut{}, err
	}
	sb.release() // run_code goes to the interpreter's port, not the agent
	timeout := in.TimeoutS
	if timeout == 0 {
		timeout = defaultExecTimeout
	}
	limit := in.MaxOutputBytes
	if limit == 0 {
		limit = defaultOutput
	}
	rctx, cancel := context.WithTimeout(ctx, time.Duration(timeout)*time.Second)
	defer cancel()
	body, err := t.execute(rctx, sb, in)
	if err != nil {
		return nil, codeOut{}, err
	}
	defer body.Close()
	r := &codeRun{stdout: newCapture(limit), stderr: newCapture(limit)}
	if err := r.read(body); err != nil {
		if rctx.Err() != nil && ctx.Err() == nil {
			return nil, codeOut{}, fmt.Errorf("the code ran past timeout_s=%d seconds and was interrupted (its context keeps its state)", timeout)
		}
		return nil, codeOut{}, t.failure(err)
	}
	return r.answer()
}

// execute POSTs the run to the interpreter and returns the streamed answer.
func (t *tools) execute(ctx context.Context, sb *sandbox, in codeIn) (io.ReadCloser, error) {
	req := map[string]any{"code": in.Code}
	if in.ContextID != "" {
		req["context_id"] = in.ContextID
	} else if in.Language != "" {
		req["language"] = in.Language
	}
	if len(in.Envs) > 0 {
		req["env_vars"] = in.Envs
	}
	b, _ := json.Marshal(req)
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, t.c.Proxy+"/execute", bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	hr.Header.Set("Content-Type", "application/json")
	hr.Header.Set("E2b-Sandbox-Id", sb.SandboxID)
	hr.Header.Set("E2b-Sandbox-Port", interpPort)
	hr.Header.Set("X-Access-Token", sb.EnvdAccessToken)
	if tok := sb.TrafficAccessToken; tok != nil && *tok != "" {
		hr.Header.Set("E2b-Traffic-Access-Token", *tok)
	}
	resp, err := codeHTTP.Do(hr)
	if err != nil {
		return nil, t.failure(err)
	}
	if resp.StatusCode == http.StatusOK {
		return resp.Body, nil
	}
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	resp.Body.Close()
	text := strings.TrimSpace(string(msg))
	var e struct {
		Message string `json:"message"`
	}
	if json.Unmarshal(msg, &e) == nil && e.Message != "" {
		text = e.Message
	}
	if resp.StatusCode == http.StatusBadGateway {
		return nil, fmt.Errorf("sandbox %s (template %s) has no code interpreter: nothing listens on port %s. run_code needs a sandbox of template code-interpreter-v1 (sandbox_create with template code-interpreter-v1); use exec to run scripts here (%s)",
			sb.SandboxID, sb.TemplateID, interpPort, clip(text, 200))
	}
	return nil, fmt.Errorf("the code interpreter refused the run: %s (HTTP %d)", clip(text, 500), resp.StatusCode)
}

// codeHTTP reaches the proxy; runs last as long as their timeout_s. What
// answers is the sandbox's port 49999, which its own code may serve: a
// redirect is never followed (it had the daemon, or the machine of `cage
// mcp`, send the code and the sandbox's tokens to an address the sandbox
// chose, from the host's network, and return the answer); it is an error
// like any other answer but 200.
var codeHTTP = &http.Client{
	Transport:     &http.Transport{MaxIdleConnsPerHost: 16, IdleConnTimeout: 90 * time.Second},
	CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
}

// codeRun gathers one run's stream of NDJSON lines.
type codeRun struct {
	stdout, stderr *capture
	results        []codeResult
	images         []*sdk.ImageContent
	dropped        []string // why images or results were left out
	kept           int      // bytes of the results kept
	err            *codeError
}

// codeLine is one line of the interpreter's stream (E2B's shapes).
type codeLine struct {
	Type      string          `json:"type"`
	Text      json.RawMessage `json:"text"`
	IsMain    bool            `json:"is_main_result"`
	Name      string          `json:"name"`
	Value     string          `json:"value"`
	Traceback string          `json:"traceback"`
	HTML      string          `json:"html"`
	PNG       string          `json:"png"`
	JPEG      string          `json:"jpeg"`
	JSON      resultJSON      `json:"json"`
	SVG       string          `json:"svg"`
	Markdown  string          `json:"markdown"`
	Extra     extraKeys       `json:"extra"`
}

// A result's json and extra are kept as the sandbox wrote them, never
// decoded into a tree: a line of 24 MiB of `[0,0,...]` decoded into an
// `any` took 380 MiB of the daemon's heap for as long as the line was
// read (1 GiB allocated), and 4 run_code calls at once took the daemon
// from 35 MiB to 2.4 GiB (found by review, 2026-12-03).

// resultJSON is a result's json: present, and its bytes when they are at
// most 1 MiB (compacted, it is kept if at most 64 KiB).
type resultJSON struct {
	present bool
	raw     []byte
}

func (j *resultJSON) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return nil
	}
	j.present = true
	if len(b) <= 1<<20 {
		j.raw = append([]byte(nil), b...)
	}
	return nil
}

// extraKeys is the names of a result's other MIME types (the extra
// object's keys), the first maxExtraKeys of them, found by a walk over the
// object's bytes (which the line's decoding has already checked): nothing
// of the values is decoded or copied.
type extraKeys []string

const maxExtraKeys = 32

func (e *extraKeys) UnmarshalJSON(b []byte) error {
	if len(b) == 0 || b[0] != '{' {
		return nil // not an object: no extra forms
	}
	depth, key := 0, false
	for i := 0; i < len(b); i++ {
		switch c := b[i]; c {
		case '"':
			j := i + 1
			for j < len(b) && b[j] != '"' {
				if b[j] == '\\' {
					j++
				}
				j++
			}
			if depth == 1 && key && len(*e) < maxExtraKeys && j < len(b) {
				var k string
				if json.Unmarshal(b[i:j+1], &k) == nil {
					*e = append(*e, clip(k, 64))
				}
			}
			key, i = false, j
		case '{', '[':
			depth++
			key = depth == 1
		case '}', ']':
			depth--
		case ',':
			key = depth == 1
		}
	}
	return nil
}

func (r *codeRun) read(body io.Reader) error {
	lines := &lineReader{br: bufio.NewReaderSize(body, 64<<10), max: maxLineSize}
	for {
		line, err := lines.next()
		if err == io.EOF {
			return errors.New("the code interpreter's answer ended before the run did")
		}
		if err != nil {
			return err
		}
		var l codeLine
		if json.Unmarshal(line, &l) != nil {
			continue
		}
		switch l.Type {
		case "stdout", "stderr":
			var s string
			_ = json.Unmarshal(l.Text, &s)
			w := r.stdout
			if l.Type == "stderr" {
				w = r.stderr
			}
			_, _ = w.Write([]byte(s))
		case "error":
			if r.err == nil {
				// Copies of clipped strings: the sandbox writes them, up
				// to a whole line each (24 MiB), and the answer holds
				// them for as long as the run lasts.
				r.err = &codeError{Name: strings.Clone(clip(l.Name, maxErrorName)), Value: strings.Clone(clip(l.Value, maxErrorValue)),
					Traceback: strings.Clone(clip(l.Traceback, maxTraceback))}
			}
		case "result":
			r.result(&l)
		case "end_of_execution":
			return nil
		}
	}
}

// lineReader reads a stream's lines of at most max bytes. A line longer
// than its reader's buffer is gathered in memory of its own, let go once
// the next line is asked for: a bufio.Scanner keeps the buffer its
// longest line grew to, so one line of 24 MiB held that much of the
// daemon for the rest of the run, up to its hour, while the sandbox sent
// nothing more (found by review, 2026-12-04).
type lineReader struct {
	br  *bufio.Reader
	max int
}

var errLineTooLong = errors.New("the code interpreter sent a line over 24 MiB")

// next is the next line without its end of line; io.EOF at the end (a
// last line without one is a line). A long line's fragments are copied
// once each, and once more into the line: growing one buffer by doubling
// allocated twice as much, line after line.
func (lr *lineReader) next() ([]byte, error) {
	var frags [][]byte
	n := 0
	for {
		frag, err := lr.br.ReadSlice('\n')
		if n += len(frag); n > lr.max+1 {
			return nil, errLineTooLong
		}
		switch {
		case err == bufio.ErrBufferFull:
			frags = append(frags, append([]byte(nil), frag...))
			continue
		case err == io.EOF && n == 0:
			return nil, io.EOF
		case err != nil && err != io.EOF:
			return nil, err
		}
		line := frag
		if frags != nil {
			line = make([]byte, 0, n)
			for _, f := range frags {
				line = append(line, f...)
			}
			line = append(line, frag...)
		}
		return bytes.TrimSuffix(bytes.TrimSuffix(line, []byte("\n")), []byte("\r")), nil
	}
}

// result records a result line: its text forms, and its images.
func (r *codeRun) result(l *codeLine) {
	var text string
	_ = json.Unmarshal(l.Text, &text)
	if len(r.results) >= maxResults {
		r.drop(fmt.Sprintf("results past the first %d", maxResults))
		return
	}
	// Copies: a clipped string would keep its whole line (up to 24 MiB).
	cr := codeResult{IsMain: l.IsMain, Text: strings.Clone(clip(text, 64<<10)), HTML: strings.Clone(clip(l.HTML, 64<<10)),
		Formats: []string{}}
	hasJSON := l.JSON.present
	if hasJSON {
		var b bytes.Buffer
		if l.JSON.raw != nil && json.Compact(&b, l.JSON.raw) == nil && b.Len() <= 64<<10 {
			cr.JSON = json.RawMessage(b.Bytes())
		} else {
			r.drop("a result's JSON over 64 KiB")
		}
	}
	size := len(cr.Text) + len(cr.HTML)
	if j, ok := cr.JSON.(json.RawMessage); ok {
		size += len(j)
	}
	if r.kept+size > maxResultBytes {
		r.drop(fmt.Sprintf("results past the first %d bytes", maxResultBytes))
		return
	}
	r.kept += size
	for name, v := range map[string]string{"text": text, "html": l.HTML, "png": l.PNG, "jpeg": l.JPEG, "svg": l.SVG, "markdown": l.Markdown} {
		if v != "" {
			cr.Formats = append(cr.Formats, name)
		}
	}
	if hasJSON {
		cr.Formats = append(cr.Formats, "json")
	}
	for _, k := range l.Extra {
		if len(cr.Formats) < 32 {
			cr.Formats = append(cr.Formats, k)
		}
	}
	sort.Strings(cr.Formats)
	r.image("image/png", l.PNG)
	r.image("image/jpeg", l.JPEG)
	r.results = append(r.results, cr)
}

// drop records why something was left out: each reason once, at most
// maxDropped of them.
func (r *codeRun) drop(why string) {
	if len(r.dropped) >= maxDropped || slices.Contains(r.dropped, why) {
		return
	}
	r.dropped = append(r.dropped, why)
}

func (r *codeRun) image(mime, b64 string) {
	if b64 == "" {
		return
	}
	data, err := base64.StdEncoding.DecodeString(b64)
	switch {
	case err != nil:
		r.drop(mime + " that is not base64")
	case len(r.images) >= maxImages:
		r.drop(fmt.Sprintf("%s past the first %d images", mime, maxImages))
	case len(data) > maxImage:
		r.drop(fmt.Sprintf("%s of %d bytes (over %d)", mime, len(data), maxImage))
	default:
		r.images = append(r.images, &sdk.ImageContent{Data: data, MIMEType: mime})
	}
}

// answer is the tool's answer: a text a model reads first, the images,
// and the structured output.
func (r *codeRun) answer() (*sdk.CallToolResult, codeOut, error) {
	out := codeOut{Results: r.results, Error: r.err, Images: len(r.images)}
	if out.Results == nil {
		out.Results = []codeResult{}
	}
	var cut1, cut2 bool
	out.Stdout, cut1 = r.stdout.text("stdout")
	out.Stderr, cut2 = r.stderr.text("stderr")
	out.Truncated = cut1 || cut2 || len(r.dropped) > 0
	var b strings.Builder
	if out.Stdout != "" {
		fmt.Fprintf(&b, "stdout:\n%s\n", strings.TrimRight(out.Stdout, "\n"))
	}
	if out.Stderr != "" {
		fmt.Fprintf(&b, "stderr:\n%s\n", strings.TrimRight(out.Stderr, "\n"))
	}
	for _, res := range out.Results {
		what := "displayed"
		if res.IsMain {
			what = "result"
		}
		fmt.Fprintf(&b, "%s (%s): %s\n", what, strings.Join(res.Formats, ", "), res.Text)
	}
	if r.err != nil {
		fmt.Fprintf(&b, "error: %s: %s\n%s\n", r.err.Name, r.err.Value, r.err.Traceback)
	}
	for _, d := range r.dropped {
		fmt.Fprintf(&b, "cage: left out: %s\n", d)
	}
	if len(r.images) > 0 {
		fmt.Fprintf(&b, "%d image(s) follow\n", len(r.images))
	}
	if b.Len() == 0 {
		b.WriteString("(no output)\n")
	}
	content := []sdk.Content{&sdk.TextContent{Text: b.String()}}
	for _, img := range r.images {
		content = append(content, img)
	}
	return &sdk.CallToolResult{Content: content}, out, nil
}
