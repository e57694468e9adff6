package conformance

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/cagehq/cage/internal/agentclient"
	"github.com/cagehq/cage/internal/bench"
	"github.com/cagehq/cage/internal/sandbox"
)

// Go benchmarks of the same measurements `cage bench` takes; they report
// p50/p99 alongside ns/op. Run: go test -run - -bench . ./test/conformance/

func reportPercentiles(b *testing.B, samples []time.Duration) {
	s := bench.Summarize(samples)
	b.ReportMetric(float64(s.P50.Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(s.P99.Microseconds())/1000, "p99-ms")
}

// BenchmarkCreateToFirstOutput: create a sandbox and read the first byte of
// `echo` from it; destroying is not timed.
func BenchmarkCreateToFirstOutput(b *testing.B) {
	h := processHost(b)
	ctx := context.Background()
	var samples []time.Duration
	for i := 0; i < b.N; i++ {
		start := time.Now()
		sb, err := h.Create(ctx, sandbox.Options{})
		if err != nil {
			b.Fatal(err)
		}
		c := agentclient.New(sb.Dial, sb.Token())
		fw := &firstByte{}
		if _, err := c.Run(ctx, agentclient.RunOptions{Cmd: "echo", Args: []string{"x"}, Stdout: fw, Stderr: io.Discard}); err != nil {
			b.Fatal(err)
		}
		samples = append(samples, fw.at.Sub(start))
		b.StopTimer()
		c.Close()
		_ = sb.Destroy()
		b.StartTimer()
	}
	reportPercentiles(b, samples)
}

// BenchmarkRoundTrip: Start -> end of `true` in one live sandbox.
func BenchmarkRoundTrip(b *testing.B) {
	h := processHost(b)
	ctx := context.Background()
	sb, err := h.Create(ctx, sandbox.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Destroy()
	c := agentclient.New(sb.Dial, sb.Token())
	defer c.Close()
	var samples []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		if _, err := c.Run(ctx, agentclient.RunOptions{Cmd: "true", Stdout: io.Discard, Stderr: io.Discard}); err != nil {
			b.Fatal(err)
		}
		samples = append(samples, time.Since(start))
	}
	reportPercentiles(b, samples)
}

type firstByte struct{ at time.Time }

func (f *firstByte) Write(p []byte) (int, error) {
	if f.at.IsZero() {
		f.at = time.Now()
	}
	return len(p), nil
}
