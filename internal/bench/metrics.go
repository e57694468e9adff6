package bench

import (
	"context"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/cagehq/cage/internal/bench/stats"
)

// What Prometheus metrics cost the API: the same create -> first output as
// InterleavedTTI against a daemon that serves /metrics and one that does
// not (a nil registry: nothing is counted), while a scraper reads /metrics
// as often as scrape says (Prometheus's default is every 15 s; the bench
// scrapes more often, so that the scrape's own cost shows).

// Scraper reads addr's /metrics every interval until Stop, and times each
// scrape.
type Scraper struct {
	stop    chan struct{}
	done    sync.WaitGroup
	mu      sync.Mutex
	samples []time.Duration
	bytes   int
	err     error
}

// StartScraper starts scraping http://addr/metrics.
func StartScraper(addr string, interval time.Duration) *Scraper {
	s := &Scraper{stop: make(chan struct{})}
	s.done.Add(1)
	go func() {
		defer s.done.Done()
		tk := time.NewTicker(interval)
		defer tk.Stop()
		for {
			start := time.Now()
			resp, err := http.Get("http://" + addr + "/metrics")
			if err == nil {
				n, _ := io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					err = errStatus(resp.StatusCode)
				}
				s.mu.Lock()
				s.samples, s.bytes = append(s.samples, time.Since(start)), int(n)
				s.mu.Unlock()
			}
			if err != nil {
				s.mu.Lock()
				s.err = err
				s.mu.Unlock()
			}
			select {
			case <-s.stop:
				return
			case <-tk.C:
			}
		}
	}()
	return s
}

type errStatus int

func (e errStatus) Error() string { return "/metrics answered " + http.StatusText(int(e)) }

// Stop ends the scraping: the scrapes' times, the last one's size, and the
// last error, if any.
func (s *Scraper) Stop() (stats.Stats, int, error) {
	close(s.stop)
	s.done.Wait()
	return stats.Summarize(s.samples), s.bytes, s.err
}

// MetricsTTI is InterleavedTTI against a daemon with metrics (on) and one
// without (off), with a scraper on the first's metricsAddr.
func MetricsTTI(ctx context.Context, on, off *Daemon, metricsAddr string, runs int, every time.Duration) (withM, without, scrapes stats.Stats, size int, err error) {
	sc := StartScraper(metricsAddr, every)
	withM, without, err = InterleavedTTI(ctx, on.Client(), off.Client(), runs)
	scrapes, size, serr := sc.Stop()
	if err == nil {
		err = serr
	}
	return withM, without, scrapes, size, err
}
