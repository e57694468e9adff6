package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/bench/stats"
	"github.com/cagehq/cage/internal/client"
)

// InterpTemplate is the code interpreter's template (@e2b/code-interpreter's
// default).
const InterpTemplate = "code-interpreter-v1"

// sandboxHTTP is a client for what a sandbox answers through the proxy (its
// interpreter's port, its agent's /files): a redirect is never followed,
// since whatever serves those ports inside may answer one, and following
// it sent the sandbox's access and traffic tokens (and the code) to an
// address of the sandbox's choosing, from the machine running the bench.
func sandboxHTTP(timeout time.Duration) *http.Client {
	return &http.Client{Timeout: timeout, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

// interp is a code interpreter sandbox reached as @e2b/code-interpreter
// reaches it: POST /execute on port 49999 through the daemon's proxy.
type interp struct {
	proxy string
	sb    *types.Sandbox
	http  *http.Client
}

// run runs code in the default Python context and returns the text of its
// main result, once that line has arrived.
func (i *interp) run(ctx context.Context, code string) (string, error) {
	body, _ := json.Marshal(map[string]string{"code": code})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, i.proxy+"/execute", strings.NewReader(string(body)))
	if err != nil {
		return "", err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("E2b-Sandbox-Id", i.sb.SandboxID)
	req.Header.Set("E2b-Sandbox-Port", "49999")
	req.Header.Set("X-Access-Token", i.sb.EnvdAccessToken)
	if i.sb.TrafficAccessToken != nil && *i.sb.TrafficAccessToken != "" {
		req.Header.Set("E2B-Traffic-Access-Token", *i.sb.TrafficAccessToken)
	}
	resp, err := i.http.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return "", fmt.Errorf("POST /execute: %s: %s", resp.Status, msg)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		var l struct {
			Type   string `json:"type"`
			Text   string `json:"text"`
			IsMain bool   `json:"is_main_result"`
			Name   string `json:"name"`
			Value  string `json:"value"`
		}
		if json.Unmarshal(sc.Bytes(), &l) != nil {
			continue
		}
		switch {
		case l.Type == "result" && l.IsMain:
			_, _ = io.Copy(io.Discard, resp.Body)
			return l.Text, nil
		case l.Type == "error":
			return "", fmt.Errorf("%s: %s", l.Name, l.Value)
		}
	}
	return "", fmt.Errorf("the run of %q ended without a result", code)
}

// InterpCreateToFirstResult is what @e2b/code-interpreter's users feel first:
// Sandbox.create() through the API, then runCode('1+1') through the proxy,
// timed from the create's call to its result. pause between samples lets
// a pool refill; pooled counts the samples served by a started sandbox
// from the pool (its kernel older than the create).
func InterpCreateToFirstResult(ctx context.Context, c *client.Client, proxy string, runs int, pause time.Duration) (s stats.Stats, pooled int, err error) {
	var samples []time.Duration
	timeout := int64(120)
	for n := -2; n < runs; n++ { // two to warm up
		called := time.Now()
		sb, err := c.Create(ctx, types.NewSandboxV2{TemplateID: InterpTemplate, Timeout: &timeout})
		if err != nil {
			return s, pooled, err
		}
		i := &interp{proxy: proxy, sb: sb, http: sandboxHTTP(0)}
		text, err := i.run(ctx, "1+1")
		took := time.Since(called)
		if err == nil && text != "2" {
			err = fmt.Errorf("1+1 gave %q", text)
		}
		var started string
		if err == nil {
			started, err = i.run(ctx, "import os\nos.stat('/proc/self').st_ctime")
		}
		_ = c.Kill(ctx, sb.SandboxID)
		if err != nil {
			return s, pooled, err
		}
		if n >= 0 {
			samples = append(samples, took)
			if at, perr := strconv.ParseFloat(started, 64); perr == nil && at < float64(called.UnixNano())/1e9 {
				pooled++
			}
		}
		select {
		case <-time.After(pause):
		case <-ctx.Done():
			return s, pooled, ctx.Err()
		}
	}
	return stats.Summarize(samples), pooled, nil
}

// InterpRoundTrip times runCode('1+1') in a live context: the request
// through the proxy to its result line.
func InterpRoundTrip(ctx context.Context, c *client.Client, proxy string, runs int) (stats.Stats, error) {
	timeout := int64(600)
	sb, err := c.Create(ctx, types.NewSandboxV2{TemplateID: InterpTemplate, Timeout: &timeout})
	if err != nil {
		return stats.Stats{}, err
	}
	defer c.Kill(ctx, sb.SandboxID)
	i := &interp{proxy: proxy, sb: sb, http: sandboxHTTP(0)}
	var samples []time.Duration
	for n := -10; n < runs; n++ {
		start := time.Now()
		if _, err := i.run(ctx, "1+1"); err != nil {
			return stats.Stats{}, err
		}
		if n >= 0 {
			samples = append(samples, time.Since(start))
		}
	}
	return stats.Summarize(samples), nil
}
