// Package kube is cage's own narrow client of a Kubernetes API server
// (issue 20: k8s.io/client-go cost every cage process ~5 ms of package
// init). It speaks JSON over HTTP/2 and knows exactly what cluster mode
// uses: typed get/list/create/update/updateStatus/patch/delete/watch of a
// few resources (typed.go, with client-go's call shapes), kubeconfig
// files (config.go), an informer-like watched cache (informer.go), a
// work queue (queue.go), Lease leader election (elect.go) and the API
// server's errors (errors.go). The object types are k8s.io/api's plain
// structs; no scheme or serializer of apimachinery is used.
package kube

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Client is a client of one API server as one user.
type Client struct {
	base  *url.URL
	hc    *http.Client
	ua    string
	creds *credentials
	limit *bucket
}

// Options are a client's settings besides its Config.
type Options struct {
	UserAgent  string  // sent with every request ("" : Go's)
	QPS        float64 // requests per second, on average (0: 5, as client-go)
	Burst      int     // requests at once above QPS (0: 10)
	HTTPClient *http.Client
}

// New makes a client of cfg's server.
func New(cfg *Config, o Options) (*Client, error) {
	u, err := url.Parse(cfg.Server)
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
		return nil, fmt.Errorf("kube: server %q is not an http(s) URL", cfg.Server)
	}
	hc := o.HTTPClient
	if hc == nil {
		tc, err := cfg.tlsConfig()
		if err != nil {
			return nil, err
		}
		d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
		// As client-go's transport: HTTP/2, a ping after 30 s without a
		// frame and the connection dropped 15 s later without an answer
		// (a watch on a dead connection ends instead of hanging).
		tr := &http.Transport{Proxy: http.ProxyFromEnvironment, DialContext: d.DialContext,
			TLSClientConfig: tc, TLSHandshakeTimeout: 10 * time.Second, ForceAttemptHTTP2: true,
			MaxIdleConnsPerHost: 25, IdleConnTimeout: 90 * time.Second,
			HTTP2: &http.HTTP2Config{SendPingTimeout: 30 * time.Second, PingTimeout: 15 * time.Second}}
		hc = &http.Client{Transport: tr}
	}
	if o.QPS == 0 {
		o.QPS = 5
	}
	if o.Burst == 0 {
		o.Burst = 10
	}
	return &Client{base: u, hc: hc, ua: o.UserAgent, creds: &credentials{token: cfg.Token, file: cfg.TokenFile},
		limit: newBucket(o.QPS, o.Burst)}, nil
}

// credentials is the bearer token, re-read from its file every minute
// (a projected token rotates).
type credentials struct {
	token, file string
	mu          sync.Mutex
	read        time.Time
	cached      string
}

func (c *credentials) bearer() (string, error) {
	if c.file == "" {
		return c.token, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if time.Since(c.read) > time.Minute || c.cached == "" {
		b, err := os.ReadFile(c.file)
		if err != nil {
			if c.cached != "" {
				return c.cached, nil
			}
			return "", fmt.Errorf("kube: token file: %w", err)
		}
		c.cached, c.read = strings.TrimSpace(string(b)), time.Now()
	}
	return c.cached, nil
}

// request is one call of the API.
type request struct {
	method, path string
	query        url.Values
	contentType  string
	body         []byte
}

// maxRetries is how many times a request the API server asks to be sent
// again (Retry-After: priority and fairness' 429, a 5xx to a GET) is
// sent again, after the seconds it says (at most 10 each), as client-go
// does.
const maxRetries = 10

// send makes the request and returns the response of a 2xx status; any
// other status is the API server's error (errors.go).
func (c *Client) send(ctx context.Context, r request) (*http.Response, error) {
	for try := 0; ; try++ {
		resp, wait, err := c.sendOnce(ctx, r)
		if wait == 0 || try == maxRetries {
			return resp, err
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, err
		case <-t.C:
		}
	}
}

// sendOnce makes the request once; a wait > 0 says to send it again then.
func (c *Client) sendOnce(ctx context.Context, r request) (*http.Response, time.Duration, error) {
	err := c.limit.wait(ctx)
	if err != nil {
		return nil, 0, err
	}
	u := *c.base // r.path is escaped (a name's characters are its own)
	u.RawPath = strings.TrimSuffix(c.base.EscapedPath(), "/") + r.path
	if u.Path, err = url.PathUnescape(u.RawPath); err != nil {
		return nil, 0, err
	}
	u.RawQuery = r.query.Encode()
	var body io.Reader = http.NoBody
	if r.body != nil {
		body = bytes.NewReader(r.body)
	}
	req, err := http.NewRequestWithContext(ctx, r.method, u.String(), body)
	if err != nil {
		return nil, 0, err
	}
	req.Header.Set("Accept", "application/json")
	if r.body != nil {
		req.Header.Set("Content-Type", r.contentType)
	}
	if c.ua != "" {
		req.Header.Set("User-Agent", c.ua)
	}
	tok, err := c.creds.bearer()
	if err != nil {
		return nil, 0, err
	}
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, 0, err
	}
	if resp.StatusCode/100 == 2 {
		return resp, 0, nil
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return nil, retryAfter(resp, r.method), statusError(resp.StatusCode, r.method, b)
}

// retryAfter is the wait an answer asks for before the request is sent
// again (0: not again).
func retryAfter(resp *http.Response, method string) time.Duration {
	code := resp.StatusCode
	if code != http.StatusTooManyRequests && (code < 500 || method != "GET") {
		return 0
	}
	secs, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	if err != nil || secs < 0 {
		return 0
	}
	return time.Duration(min(max(secs, 1), 10)) * time.Second
}

// call makes the request and decodes its answer into out (nil: dropped).
func (c *Client) call(ctx context.Context, r request, out any) error {
	resp, err := c.send(ctx, r)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("kube: %s %s: decoding the answer: %w", r.method, r.path, err)
	}
	return nil
}

// bucket is a token bucket: qps tokens a second, at most burst at once.
type bucket struct {
	mu     sync.Mutex
	qps    float64
	burst  float64
	tokens float64
	last   time.Time
}

func newBucket(qps float64, burst int) *bucket {
	return &bucket{qps: qps, burst: float64(burst), tokens: float64(burst), last: time.Now()}
}

// wait takes a token, waiting for one as long as ctx allows.
func (b *bucket) wait(ctx context.Context) error {
	b.mu.Lock()
	now := time.Now()
	b.tokens = min(b.burst, b.tokens+now.Sub(b.last).Seconds()*b.qps)
	b.last = now
	b.tokens--
	short := -b.tokens
	b.mu.Unlock()
	if short <= 0 {
		return nil
	}
	t := time.NewTimer(time.Duration(short / b.qps * float64(time.Second)))
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		b.mu.Lock()
		b.tokens++ // not taken after all
		b.mu.Unlock()
		return ctx.Err()
	}
}
