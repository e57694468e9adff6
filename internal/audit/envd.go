package audit

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	fspb "github.com/cagehq/cage/api/gen/filesystem"
	pb "github.com/cagehq/cage/api/gen/process"
)

// The proxy's side: ObserveEnvd is given every request the proxy
// authorized for a sandbox's agent (port 49983) or code interpreter (port
// 49999) before it is forwarded, and records what it does: processes
// started (the request's argv, user, cwd, names of the environment
// variables) and how they ended (the agent's end event), signals,
// files written (their bytes hashed as they pass), read, moved, made and
// removed, and any other call that is not a read. Reads of state (Stat,
// ListDir, List, /health, /envs) and a process's input are not recorded.

// Ports the proxy serves that the trail reads.
const (
	envdPort   = 49983
	interpPort = 49999
)

// ObserveEnvd is the proxy's observer (see proxy.Proxy.Observe). It may
// replace r.Body; response is then called with the agent's response (nil
// when the agent was not reached), and done once the request is over.
// Both are nil for requests the trail does not record.
func (t *Trail) ObserveEnvd(r *http.Request, sandbox, owner string, port int) (response func(*http.Response), done func()) {
	if t == nil {
		return nil, nil
	}
	c := &envdCall{t: t, r: r, sandbox: sandbox, owner: owner, client: clientAddr(r), user: rpcUser(r)}
	switch {
	case port == interpPort:
		if r.Method != http.MethodPost || r.URL.Path != "/execute" {
			return nil, nil
		}
		c.kind = KindCodeRun
	case port != envdPort:
		return nil, nil
	default:
		c.kind = envdKind(r.Method, r.URL.Path)
		if c.kind == "" {
			return nil, nil
		}
	}
	switch c.kind {
	case KindFileWrite:
		c.user = r.URL.Query().Get("username")
		c.upload = newUploadTee(r)
	case KindFileRead:
		c.user = r.URL.Query().Get("username")
	case KindEnvdCall:
	default:
		c.req = newCapture(r.Body, maxDecoded+5)
		c.req.enveloped = c.kind != KindCodeRun && codecOf(r.Header).envelope
		c.req.whole = c.decodeRequest
		r.Body = c.req
	}
	return c.response, c.done
}

// envdKind is the kind of entry an agent request makes ("" for none).
func envdKind(method, path string) string {
	switch path {
	case "/process.Process/Start":
		return KindProcessStart
	case "/process.Process/Connect":
		return KindProcessEnd // only its end event, if it sees one
	case "/process.Process/SendSignal":
		return KindProcessSignal
	case "/filesystem.Filesystem/Remove":
		return KindFileRm
	case "/filesystem.Filesystem/Move":
		return KindFileMove
	case "/filesystem.Filesystem/MakeDir":
		return KindFileMkdir
	case "/files":
		switch method {
		case http.MethodPost:
			return KindFileWrite
		case http.MethodGet:
			return KindFileRead
		}
		return ""
	}
	if strings.HasPrefix(path, "/process.Process/") || strings.HasPrefix(path, "/filesystem.Filesystem/") || path == "/health" ||
		method == http.MethodGet || method == http.MethodHead || method == http.MethodOptions {
		return "" // reads of state, a process's input, PTY sizes
	}
	return KindEnvdCall
}

// envdCall is one recorded request.
type envdCall struct {
	t                            *Trail
	r                            *http.Request
	kind, sandbox, owner, client string
	user                         string
	req                          *capture
	upload                       *uploadTee
	resp                         *http.Response
	scan                         *scanner
	count                        *counter
	mu                           sync.Mutex
	id                           string
	pid                          uint32
	startLogged, endLogged       bool
	detail                       map[string]any
	connectPid                   uint32 // the process a Connect asked for
	connectDecoded               bool
	decodeOnce                   sync.Once
	inspected                    int // bytes of the response inflated and decoded (onMessage's goroutine only)
}

func (c *envdCall) event(kind, source string, status int, detail map[string]any) Event {
	return Event{Kind: kind, Source: source, KeyID: c.owner, SandboxID: c.sandbox, Route: c.r.Method + " " + c.r.URL.Path,
		Status: status, Client: c.client, Detail: detail}
}

// response is called with the agent's answer before its body is copied.
func (c *envdCall) response(resp *http.Response) {
	c.resp = resp
	if resp == nil {
		return
	}
	// What the entry needs of the request is decoded by now (the agent
	// has read it: it answers a call once it has its message).
	c.decodeRequest()
	switch c.kind {
	case KindProcessStart, KindProcessEnd:
		if resp.StatusCode != http.StatusOK {
			return
		}
		rc := codecOf(resp.Header)
		c.scan = &scanner{rc: resp.Body, on: func(flags byte, msg []byte) { c.onMessage(rc, flags, msg) }}
		resp.Body = c.scan
	case KindFileRead:
		c.count = &counter{rc: resp.Body}
		resp.Body = c.count
	}
}

// decodeRequest decodes, once, what the entry needs of the request, and
// lets go of its bytes: as soon as its message is whole (the capture
// calls it), else at the agent's answer or the request's end. Found by
// review, 2026-12-04: the bytes were kept until the answer, so requests
// of 1 MiB to a server that reads them and never answers (code in the
// sandbox listening on the interpreter's port) held up to 2 MiB of the
// daemon each, 200 of them 376 MiB, one key's sandbox 1,024.
func (c *envdCall) decodeRequest() {
	c.decodeOnce.Do(func() {
		if c.req == nil {
			return
		}
		var d map[string]any
		var pid uint32
		var pidOK bool
		switch c.kind {
		case KindProcessStart:
			d = c.startDetail()
		case KindProcessEnd:
			var sel pb.ConnectRequest
			if decodeCaptured(c.req, codecOf(c.r.Header), &sel) == nil {
				pid, pidOK = sel.GetProcess().GetPid(), true
			}
		case KindCodeRun:
			d = c.codeDetail()
		default:
			d = c.unaryDetail()
		}
		c.req.release()
		c.mu.Lock()
		c.detail, c.connectPid, c.connectDecoded = d, pid, pidOK
		c.mu.Unlock()
	})
}

// done records the call once the request is over.
func (c *envdCall) done() {
	c.decodeRequest()
	status := http.StatusBadGateway // the agent was not reached
	if c.resp != nil {
		status = c.resp.StatusCode
	}
	switch c.kind {
	case KindProcessStart:
		c.mu.Lock()
		logged := c.startLogged
		c.mu.Unlock()
		if !logged { // refused, or ended before its start event
			d := c.detail
			if d == nil {
				d = c.startDetail()
			}
			d["started"] = false
			c.t.Record(c.event(KindProcessStart, SourceHost, status, d))
		}
	case KindProcessEnd:
	case KindFileWrite:
		for _, f := range c.upload.finish() {
			f["user"] = userOrDefault(c.user)
			c.t.Record(c.event(KindFileWrite, SourceHost, status, f))
		}
	case KindFileRead:
		d := map[string]any{"path": c.r.URL.Query().Get("path"), "user": userOrDefault(c.user)}
		if c.count != nil {
			d["bytes"] = c.count.n
		}
		c.t.Record(c.event(KindFileRead, SourceHost, status, d))
	case KindEnvdCall:
		c.t.Record(c.event(KindEnvdCall, SourceHost, status, map[string]any{"method": c.r.Method, "path": c.r.URL.Path}))
	case KindCodeRun:
		d := c.detail
		if d == nil {
			d = c.codeDetail()
		}
		c.t.Record(c.event(KindCodeRun, SourceHost, status, d))
	default:
		d := c.detail
		if d == nil {
			d = c.unaryDetail()
		}
		c.t.Record(c.event(c.kind, SourceHost, status, d))
	}
}

// startDetail is what a Start request asks for, as the host read it.
func (c *envdCall) startDetail() map[string]any {
	d := map[string]any{"user": userOrDefault(c.user)}
	var req pb.StartRequest
	if err := decodeCaptured(c.req, codecOf(c.r.Header), &req); err != nil {
		d["undecoded"] = err.Error()
		return d
	}
	p := req.GetProcess()
	argv := append([]string{p.GetCmd()}, p.GetArgs()...)
	d["argv"], d["argv_sha256"] = boundedArgv(argv)
	if p.Cwd != nil {
		d["cwd"] = p.GetCwd()
	}
	if len(p.GetEnvs()) > 0 {
		names := make([]string, 0, len(p.GetEnvs()))
		for k := range p.GetEnvs() {
			names = append(names, k)
		}
		sort.Strings(names)
		d["env_names"] = names // names only: values may be secrets
	}
	if req.Pty != nil {
		d["pty"] = true
	}
	if req.Tag != nil {
		d["tag"] = req.GetTag()
	}
	return d
}

// maxCompressedEvent bounds a compressed stream message the trail inflates
// to see which event it is: a start or an end event is tens of bytes.
const maxCompressedEvent = 1 << 10

// maxArgvBytes bounds the argv kept in an entry; the hash covers all of it.
const maxArgvBytes = 16 << 10

func boundedArgv(argv []string) ([]string, string) {
	h := sha256.New()
	out, n := []string{}, 0
	for _, a := range argv {
		h.Write([]byte(a))
		h.Write([]byte{0})
		if n >= maxArgvBytes {
			continue
		}
		if n+len(a) > maxArgvBytes {
			a = a[:maxArgvBytes-n] + "…(truncated)"
		}
		n += len(a)
		out = append(out, a)
	}
	return out, hex.EncodeToString(h.Sum(nil))
}

// onMessage handles one message of a Start or Connect stream: the start
// event names the pid (and the start is recorded), the end event how the
// process ended (as the agent says), an end-of-stream error a start that
// failed.
//
// Once nothing is left to learn (the start seen, on a Start stream, and
// the end), messages are passed unread; what is inflated and decoded of
// one stream is at most maxInspected.
func (c *envdCall) onMessage(cd codec, flags byte, msg []byte) {
	c.mu.Lock()
	wantStart, wantEnd := c.kind == KindProcessStart && !c.startLogged, !c.endLogged
	c.mu.Unlock()
	if !wantStart && !wantEnd || c.inspected >= maxInspected {
		return
	}
	if flags&0x02 != 0 && cd.endJSON { // Connect's end of stream
		if !wantStart { // it only explains a start that failed
			return
		}
		if flags&1 != 0 {
			var err error
			if msg, err = c.inflate(msg); err != nil {
				return
			}
		}
		if !c.spend(len(msg)) {
			return
		}
		var eos struct {
			Error *struct{ Code, Message string } `json:"error"`
		}
		if json.Unmarshal(msg, &eos) == nil && eos.Error != nil {
			c.mu.Lock()
			if c.detail != nil && !c.startLogged { // once recorded, the writer owns it
				c.detail["error"] = eos.Error.Code + ": " + eos.Error.Message
			}
			c.mu.Unlock()
		}
		return
	}
	if flags&0x80 != 0 { // gRPC-web trailers
		return
	}
	field := processEventField(cd, msg)
	if flags&1 != 0 && field == 0 { // compressed: look inside the small ones
		if len(msg) > maxCompressedEvent {
			return // output: a start or end event is far smaller
		}
		var err error
		if msg, err = c.inflate(msg); err != nil {
			return
		}
		field = processEventField(cd, msg)
	}
	if !(field == 1 && wantStart || field == 3 && wantEnd) || !c.spend(len(msg)) {
		return
	}
	var resp pb.StartResponse // ConnectResponse has the same shape
	if cd.unmarshal(msg, &resp) != nil {
		return
	}
	ev := resp.GetEvent()
	switch {
	case ev.GetStart() != nil && c.kind == KindProcessStart:
		// The first start event only: the map goes to the writer, which
		// reads it on its own goroutine, and the agent (not trusted) may
		// send any number of start events on one stream.
		c.mu.Lock()
		if c.startLogged {
			c.mu.Unlock()
			return
		}
		c.pid, c.startLogged = ev.GetStart().GetPid(), true
		d := c.detail
		d["agent"] = map[string]any{"pid": c.pid}
		c.id = callID()
		d["call"] = c.id
		c.mu.Unlock()
		c.t.Record(c.event(KindProcessStart, SourceHost, http.StatusOK, d))
	case ev.GetEnd() != nil:
		c.recordEnd(ev.GetEnd())
	}
}

// inflate inflates a compressed message of the response, within what is
// left of the stream's maxInspected (and at most maxScanned).
func (c *envdCall) inflate(msg []byte) ([]byte, error) {
	out, err := gunzip(msg, min(maxScanned, maxInspected-c.inspected))
	c.inspected += len(out)
	return out, err
}

// spend counts n bytes about to be decoded against the stream's
// maxInspected, and says whether they fit.
func (c *envdCall) spend(n int) bool {
	if c.inspected+n > maxInspected {
		c.inspected = maxInspected
		return false
	}
	c.inspected += n
	return true
}

// recordEnd records a process's end as its agent reported it; an end seen
// by several streams of the same process (Start and Connect) is recorded
// once.
//
// One end per stream: the agent (not trusted) may send any number, and a
// flood of them would fill the writer's queue, shared by every tenant.
func (c *envdCall) recordEnd(end *pb.ProcessEvent_EndEvent) {
	c.mu.Lock()
	pid, id, seen := c.pid, c.id, c.endLogged
	c.endLogged = true
	c.mu.Unlock()
	if seen {
		return
	}
	if c.kind == KindProcessEnd && c.connectDecoded {
		pid = c.connectPid
	}
	if !c.t.endOnce(c.sandbox, pid, c.kind == KindProcessStart) {
		return
	}
	d := map[string]any{"pid": pid, "exit_code": end.GetExitCode(), "exited": end.GetExited(), "status": end.GetStatus()}
	if end.GetReason() != "" {
		d["reason"] = end.GetReason()
	}
	if end.Error != nil {
		d["error"] = end.GetError()
	}
	if end.GetTruncated() {
		d["output_truncated"] = true
	}
	if id != "" {
		d["call"] = id
	}
	c.t.Record(c.event(KindProcessEnd, SourceAgent, http.StatusOK, d))
}

// unaryDetail is what a unary call asked for: paths, a signal.
func (c *envdCall) unaryDetail() map[string]any {
	d := map[string]any{"user": userOrDefault(c.user)}
	cd := codecOf(c.r.Header)
	var err error
	switch c.kind {
	case KindFileRm:
		var m fspb.RemoveRequest
		if err = decodeCaptured(c.req, cd, &m); err == nil {
			d["path"] = m.GetPath()
		}
	case KindFileMkdir:
		var m fspb.MakeDirRequest
		if err = decodeCaptured(c.req, cd, &m); err == nil {
			d["path"] = m.GetPath()
		}
	case KindFileMove:
		var m fspb.MoveRequest
		if err = decodeCaptured(c.req, cd, &m); err == nil {
			d["source"], d["destination"] = m.GetSource(), m.GetDestination()
		}
	case KindProcessSignal:
		var m pb.SendSignalRequest
		if err = decodeCaptured(c.req, cd, &m); err == nil {
			d["signal"] = m.GetSignal().String()
			if m.GetProcess().GetTag() != "" {
				d["tag"] = m.GetProcess().GetTag()
			} else {
				d["pid"] = m.GetProcess().GetPid()
			}
		}
	}
	if err != nil {
		d["undecoded"] = err.Error()
	}
	return d
}

// maxCodeKept bounds the code kept in a code interpreter's entry; its hash
// and size cover all of it.
const maxCodeKept = 4 << 10

// codeDetail is what POST /execute of the code interpreter asked to run.
func (c *envdCall) codeDetail() map[string]any {
	d := map[string]any{}
	b, over, n := c.req.bytes()
	var body struct {
		Code      string `json:"code"`
		Language  string `json:"language"`
		ContextID string `json:"context_id"`
	}
	if over {
		d["undecoded"] = "a request of " + itoa(n) + " bytes or more"
		return d
	}
	if err := json.Unmarshal(b, &body); err != nil {
		d["undecoded"] = err.Error()
		return d
	}
	sum := sha256.Sum256([]byte(body.Code))
	d["code_sha256"], d["code_bytes"] = hex.EncodeToString(sum[:]), len(body.Code)
	code := body.Code
	if len(code) > maxCodeKept {
		code = code[:maxCodeKept] + "…(truncated)"
	}
	d["code"] = code
	if body.Language != "" {
		d["language"] = body.Language
	}
	if body.ContextID != "" {
		d["context_id"] = body.ContextID
	}
	return d
}

// endOnce says whether to record the end of process pid of a sandbox:
// always from its Start stream (which remembers it), from a Connect stream
// only when no stream recorded it in the last ten minutes. The last
// maxEnds ends are remembered, the oldest forgotten first.
func (t *Trail) endOnce(sandbox string, pid uint32, fromStart bool) bool {
	k := sandbox + "/" + itoa(int64(pid))
	now := time.Now()
	t.endsMu.Lock()
	defer t.endsMu.Unlock()
	if t.ends == nil {
		t.ends, t.endsRing = map[string]time.Time{}, make([]string, maxEnds)
	}
	at, ok := t.ends[k]
	if ok && !fromStart && now.Sub(at) < 10*time.Minute {
		return false
	}
	if !ok {
		if old := t.endsRing[t.endsNext]; old != "" {
			delete(t.ends, old)
		}
		t.endsRing[t.endsNext] = k
		t.endsNext = (t.endsNext + 1) % maxEnds
	}
	t.ends[k] = now
	return true
}

// maxEnds is how many process ends endOnce remembers.
const maxEnds = 4096

// ProxyDenied records a request the proxy refused for want of a valid
// token (see proxy.Proxy.Denied). Its entries are the operator's alone,
// and bounded with the other requests without a valid credential.
func (t *Trail) ProxyDenied(r *http.Request, sandbox string, port, status int, why string) {
	t.Record(Event{Kind: KindProxyDenied, SandboxID: sandbox, Route: r.Method + " " + r.URL.Path, Status: status,
		Client: clientAddr(r), Detail: map[string]any{"port": port, "why": why}})
}
