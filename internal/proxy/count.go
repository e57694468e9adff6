package proxy

import (
	"io"
	"net/http"
)

// Counting for the daemon's metrics (Proxy.Count): the status a request
// got and the bytes of its body and of its answer, as they pass. A
// connection taken over by an upgrade (WebSocket) is counted up to the
// upgrade.

// countingWriter counts what is written to the client.
type countingWriter struct {
	http.ResponseWriter
	status int
	n      int64
}

func (w *countingWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *countingWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	n, err := w.ResponseWriter.Write(b)
	w.n += int64(n)
	return n, err
}

func (w *countingWriter) Flush() { _ = http.NewResponseController(w.ResponseWriter).Flush() }

func (w *countingWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// countingBody counts what is read of the request's body.
type countingBody struct {
	io.ReadCloser
	n int64
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n += int64(n)
	return n, err
}

// ServeHTTP routes a request to its sandbox (serve), counting it when the
// daemon asked (Count).
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if p.Count == nil {
		p.serve(w, r)
		return
	}
	cw := &countingWriter{ResponseWriter: w}
	var body *countingBody
	if r.Body != nil && r.Body != http.NoBody {
		body = &countingBody{ReadCloser: r.Body}
		r.Body = body
	}
	// Deferred: the reverse proxy aborts the handler with a panic when the
	// client goes mid-answer (a stream cancelled once the client had what
	// it wanted), and the request still counts.
	defer func() {
		_, port, _ := p.route(r)
		var in int64
		if body != nil {
			in = body.n
		}
		status := cw.status
		if status == 0 {
			status = http.StatusOK
		}
		p.Count(port, r.URL.Path, status, in, cw.n)
	}()
	p.serve(cw, r)
}
