package interp

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// countedKernel is a kernel that counts the live ones.
type countedKernel struct{ live *atomic.Int64 }

func (k countedKernel) Execute(context.Context, string, map[string]string, Output) error { return nil }
func (k countedKernel) Restart(context.Context) error                                    { return nil }
func (k countedKernel) Close() error                                                     { k.live.Add(-1); return nil }
func (k countedKernel) Exited() error                                                    { return nil }

// TestContextsBoundAtOnce: 100 context creates at once (the route needs
// no token on a sandbox open to the public) start no more kernels than
// MaxContexts, at any moment; the rest are refused before they start one
// (before, all 100 started, the surplus closed afterwards: enough at once
// to take the sandbox past its memory limit and OOM-kill its kernels).
func TestContextsBoundAtOnce(t *testing.T) {
	var live, peak atomic.Int64
	lang := Language{Start: func(ctx context.Context, cwd string) (Kernel, error) {
		n := live.Add(1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		time.Sleep(100 * time.Millisecond) // a kernel's start
		return countedKernel{&live}, nil
	}}
	_, url := testServer(t, Config{MaxContexts: 8, Languages: map[string]Language{"python": lang}})
	var wg sync.WaitGroup
	var ok atomic.Int64
	for range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Post(url+"/contexts", "application/json", strings.NewReader(`{"language":"python"}`))
			if err != nil {
				return
			}
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				ok.Add(1)
			}
		}()
	}
	wg.Wait()
	if peak.Load() > 8 || ok.Load() != 8 {
		t.Errorf("100 creates at once: %d kernels at most at once, %d contexts made; want 8 and 8", peak.Load(), ok.Load())
	}
}
