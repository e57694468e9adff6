package interp

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"
	"unicode/utf8"
)

// Output receives what a run produces, in order. Kernels call it from
// one goroutine at a time.
type Output interface {
	// Count is the run's execution count (number_of_executions).
	Count(n int)
	// Stream is text the run wrote: name is "stdout" or "stderr".
	Stream(name, text string, at time.Time)
	// Result is a value displayed (main: the run's own value, the last
	// expression's) as a MIME bundle.
	Result(data map[string]json.RawMessage, main bool)
	// Error is the run's exception; only the first of a run is kept.
	Error(name, value, traceback string)
}

// KeepaliveEvery is how long a run's stream may be silent before a
// keepalive line is written (E2B's 5 s): a client gone away is noticed.
var KeepaliveEvery = 5 * time.Second

// stream writes a run's lines to its HTTP response as E2B's NDJSON, each
// flushed at once, with at most budget bytes of output (then one note
// that the rest was dropped).
type stream struct {
	mu        sync.Mutex
	w         http.ResponseWriter
	rc        *http.ResponseController
	limit     int64 // bytes of output a run may send
	budget    int64 // what is left of it
	truncated bool
	errored   bool
	last      time.Time
	stop      chan struct{}
}

func newStream(w http.ResponseWriter, limit int64) *stream {
	s := &stream{w: w, rc: http.NewResponseController(w), limit: limit, budget: limit, last: time.Now(), stop: make(chan struct{})}
	go s.keepalive()
	return s
}

func (s *stream) keepalive() {
	t := time.NewTicker(KeepaliveEvery / 5)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
			s.mu.Lock()
			if time.Since(s.last) >= KeepaliveEvery {
				s.writeLocked(map[string]string{"type": "keepalive"})
			}
			s.mu.Unlock()
		}
	}
}

// close ends the stream with end_of_execution.
func (s *stream) close() {
	close(s.stop)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.writeLocked(map[string]string{"type": "end_of_execution"})
}

func (s *stream) writeLocked(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		return
	}
	s.last = time.Now()
	_, _ = s.w.Write(append(b, '\n'))
	_ = s.rc.Flush()
}

// spend takes n bytes from the budget; once it is spent, output is
// dropped and a note says so on stderr.
func (s *stream) spend(n int) bool {
	if s.truncated {
		return false
	}
	if int64(n) <= s.budget {
		s.budget -= int64(n)
		return true
	}
	s.truncated = true
	s.writeLocked(streamLine{Type: "stderr", Text: fmt.Sprintf("\n[cage: this run's output passed the interpreter's limit of %s; the rest was dropped]\n",
		sizeText(s.limit)), Timestamp: time.Now().UTC().Format(time.RFC3339Nano)})
	return false
}

func sizeText(n int64) string {
	if n%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d bytes", n)
}

type streamLine struct {
	Type      string `json:"type"`
	Text      string `json:"text"`
	Timestamp string `json:"timestamp"`
}

func (s *stream) Count(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.writeLocked(map[string]any{"type": "number_of_executions", "execution_count": n})
}

func (s *stream) Stream(name, text string, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if text == "" || s.truncated {
		return
	}
	if int64(len(text)) > s.budget { // what fits goes, then the note
		cut := int(s.budget)
		for cut > 0 && !utf8.RuneStart(text[cut]) {
			cut--
		}
		if cut > 0 {
			s.budget -= int64(cut)
			s.writeLocked(streamLine{Type: name, Text: text[:cut], Timestamp: at.UTC().Format(time.RFC3339Nano)})
		}
	}
	if !s.spend(len(text)) {
		return
	}
	s.writeLocked(streamLine{Type: name, Text: text, Timestamp: at.UTC().Format(time.RFC3339Nano)})
}

func (s *stream) Result(data map[string]json.RawMessage, main bool) {
	line := resultLine(data, main)
	b, err := json.Marshal(line)
	if err != nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.spend(len(b)) {
		return
	}
	s.last = time.Now()
	_, _ = s.w.Write(append(b, '\n'))
	_ = s.rc.Flush()
}

func (s *stream) Error(name, value, traceback string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.errored {
		return
	}
	s.errored = true
	s.writeLocked(map[string]string{"type": "error", "name": name, "value": value, "traceback": traceback})
}

// result is E2B's result line: the MIME types it knows as fields, every
// other one in extra.
type result struct {
	Type       string                     `json:"type"`
	IsMain     bool                       `json:"is_main_result"`
	Text       json.RawMessage            `json:"text,omitempty"`
	HTML       json.RawMessage            `json:"html,omitempty"`
	Markdown   json.RawMessage            `json:"markdown,omitempty"`
	SVG        json.RawMessage            `json:"svg,omitempty"`
	PNG        json.RawMessage            `json:"png,omitempty"`
	JPEG       json.RawMessage            `json:"jpeg,omitempty"`
	PDF        json.RawMessage            `json:"pdf,omitempty"`
	LaTeX      json.RawMessage            `json:"latex,omitempty"`
	JSON       json.RawMessage            `json:"json,omitempty"`
	JavaScript json.RawMessage            `json:"javascript,omitempty"`
	Data       json.RawMessage            `json:"data,omitempty"`
	Chart      json.RawMessage            `json:"chart,omitempty"`
	Extra      map[string]json.RawMessage `json:"extra"`
}

// resultLine maps a MIME bundle to E2B's result fields (api/models/result.py).
func resultLine(data map[string]json.RawMessage, main bool) *result {
	r := &result{Type: "result", IsMain: main, Extra: map[string]json.RawMessage{}}
	fields := map[string]*json.RawMessage{
		"text/plain": &r.Text, "text/html": &r.HTML, "text/markdown": &r.Markdown, "image/svg+xml": &r.SVG,
		"image/png": &r.PNG, "image/jpeg": &r.JPEG, "application/pdf": &r.PDF, "text/latex": &r.LaTeX,
		"application/json": &r.JSON, "application/javascript": &r.JavaScript, "e2b/data": &r.Data, "e2b/chart": &r.Chart,
	}
	for mime, v := range data {
		if f, ok := fields[mime]; ok {
			*f = v
		} else {
			r.Extra[mime] = v
		}
	}
	if r.Text != nil {
		r.Text = stripQuotes(r.Text)
	}
	for _, f := range []*json.RawMessage{&r.PNG, &r.JPEG, &r.PDF} {
		*f = unwrapLines(*f)
	}
	return r
}

// stripQuotes removes one pair of surrounding quotes from a text/plain
// value, as E2B does (a Python str's repr is 'text').
func stripQuotes(raw json.RawMessage) json.RawMessage {
	var s string
	if json.Unmarshal(raw, &s) != nil || len(s) < 2 {
		return raw
	}
	if (s[0] == '\'' && s[len(s)-1] == '\'') || (s[0] == '"' && s[len(s)-1] == '"') {
		b, _ := json.Marshal(s[1 : len(s)-1])
		return b
	}
	return raw
}

// unwrapLines removes the line breaks some kernels put into base64 (it
// decodes the same without them).
func unwrapLines(raw json.RawMessage) json.RawMessage {
	if raw == nil || !bytes.Contains(raw, []byte(`\n`)) {
		return raw
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return raw
	}
	b, _ := json.Marshal(strings.ReplaceAll(s, "\n", ""))
	return b
}
