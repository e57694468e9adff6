package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/cagehq/cage/internal/client"
	"github.com/cagehq/cage/internal/cluster"
	"github.com/cagehq/cage/internal/kube"
)

// APICounts are the API server's counters at one moment: requests by
// "VERB resource[/subresource]" (apiserver_request_total), watch events
// sent for pods (apiserver_watch_events_total), and etcd's revision.
type APICounts struct {
	Requests    map[string]float64
	PodEvents   float64
	Revision    int64
	EtcdDBInUse float64 // etcd_mvcc_db_total_size_in_use_in_bytes
	At          time.Time
}

// Total is the sum of the requests.
func (a APICounts) Total() float64 {
	var s float64
	for _, v := range a.Requests {
		s += v
	}
	return s
}

// Counts reads the API server's and etcd's counters.
func (c *Cluster) Counts() (APICounts, error) {
	a := APICounts{Requests: map[string]float64{}, At: time.Now()}
	body, err := c.Plane.Get("/metrics")
	if err != nil {
		return a, err
	}
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "apiserver_request_total{"):
			labels, v, ok := metricLine(line)
			if !ok {
				continue
			}
			key := labels["verb"] + " " + labels["resource"]
			if labels["subresource"] != "" {
				key += "/" + labels["subresource"]
			}
			if labels["resource"] == "" {
				continue // /metrics, /readyz and the like: not the cluster's work
			}
			a.Requests[key] += v
		case strings.HasPrefix(line, "apiserver_watch_events_total{"):
			if labels, v, ok := metricLine(line); ok && (labels["resource"] == "pods" || labels["kind"] == "Pod") {
				a.PodEvents += v
			}
		}
	}
	if body, err = c.Plane.Get("/api/v1/namespaces?limit=1"); err != nil {
		return a, err
	}
	var list struct {
		Metadata struct {
			ResourceVersion string `json:"resourceVersion"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(body, &list); err != nil {
		return a, err
	}
	a.Revision, _ = strconv.ParseInt(list.Metadata.ResourceVersion, 10, 64)
	if resp, err := http.Get(c.Plane.EtcdURL + "/metrics"); err == nil {
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			if f := strings.Fields(sc.Text()); len(f) == 2 && f[0] == "etcd_mvcc_db_total_size_in_use_in_bytes" {
				a.EtcdDBInUse, _ = strconv.ParseFloat(f[1], 64)
			}
		}
	}
	return a, nil
}

// metricLine parses `name{k="v",...} value`.
func metricLine(line string) (map[string]string, float64, bool) {
	open, end := strings.IndexByte(line, '{'), strings.LastIndexByte(line, '}')
	if open < 0 || end < open {
		return nil, 0, false
	}
	v, err := strconv.ParseFloat(strings.TrimSpace(line[end+1:]), 64)
	if err != nil {
		return nil, 0, false
	}
	labels := map[string]string{}
	for _, kv := range strings.Split(line[open+1:end], ",") {
		if k, val, ok := strings.Cut(kv, "="); ok {
			labels[k] = strings.Trim(val, `"`)
		}
	}
	return labels, v, true
}

// APIDelta is what the API server did between two counts, less what it
// does idle (background: the nodes' leases and status, scaled to the
// window).
type APIDelta struct {
	Requests  map[string]float64
	Total     float64
	PodEvents float64
	Revisions float64
}

// Delta is b - a less idle's rates over the window.
func Delta(a, b APICounts, idle *APIDelta, idleWindow time.Duration) APIDelta {
	d := APIDelta{Requests: map[string]float64{}}
	scale := 0.0
	if idle != nil && idleWindow > 0 {
		scale = b.At.Sub(a.At).Seconds() / idleWindow.Seconds()
	}
	for k, v := range b.Requests {
		x := v - a.Requests[k]
		if idle != nil {
			x -= idle.Requests[k] * scale
		}
		if x > 0.5 {
			d.Requests[k] = x
			d.Total += x
		}
	}
	d.PodEvents = b.PodEvents - a.PodEvents
	d.Revisions = float64(b.Revision - a.Revision)
	if idle != nil {
		d.PodEvents -= idle.PodEvents * scale
		d.Revisions -= idle.Revisions * scale
	}
	return d
}

// Top is the n largest entries of d.Requests divided by per, as
// "VERB resource 1.0, ...".
func (d APIDelta) Top(n int, per float64) string {
	keys := make([]string, 0, len(d.Requests))
	for k := range d.Requests {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return d.Requests[keys[i]] > d.Requests[keys[j]] })
	var parts []string
	for i, k := range keys {
		if i == n {
			break
		}
		parts = append(parts, fmt.Sprintf("%s %.2f", k, d.Requests[k]/per))
	}
	return strings.Join(parts, ", ")
}

// Placement counts, by node, the sandbox pods the scheduler binds while
// it runs (a watch on the namespace's sandbox pods).
type Placement struct {
	mu     sync.Mutex
	byNode map[string]int
	seen   map[string]bool
	events int // events the watch received (the API server's count has them)
	stop   func()
	done   chan struct{}
}

// WatchPlacement starts counting.
func (c *Cluster) WatchPlacement(ctx context.Context) (*Placement, error) {
	ctx, cancel := context.WithCancel(ctx)
	w, err := c.Admin.CoreV1().Pods(ClusterNamespace).Watch(ctx, metav1.ListOptions{LabelSelector: cluster.LabelSandbox + "=true"})
	if err != nil {
		cancel()
		return nil, err
	}
	p := &Placement{byNode: map[string]int{}, seen: map[string]bool{}, stop: cancel, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		for ev := range w.ResultChan() {
			if ev.Type != kube.Added && ev.Type != kube.Modified {
				p.mu.Lock()
				p.events++
				p.mu.Unlock()
				continue
			}
			pod, ok := podOf(ev.Object)
			if !ok || pod.Spec.NodeName == "" {
				p.mu.Lock()
				p.events++
				p.mu.Unlock()
				continue
			}
			p.mu.Lock()
			p.events++
			if !p.seen[pod.Name] {
				p.seen[pod.Name] = true
				p.byNode[pod.Spec.NodeName]++
			}
			p.mu.Unlock()
		}
	}()
	return p, nil
}

// Stop ends the watch and returns "a 12, b 10, c 11" and the events it
// received.
func (p *Placement) Stop() (string, int) {
	p.stop()
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	names := make([]string, 0, len(p.byNode))
	for n := range p.byNode {
		names = append(names, n)
	}
	sort.Strings(names)
	var parts []string
	for _, n := range names {
		parts = append(parts, fmt.Sprintf("%s %d", n, p.byNode[n]))
	}
	return strings.Join(parts, ", "), p.events
}

// Burst is what Sustained measured.
type Burst struct {
	Creates, Errors int
	Rate            float64 // creates a second
	FirstErr        error
}

// Sustained runs conns clients for d, each creating sandboxes (host
// template, 120 s) one after the other through clients[i % len], and
// leaves them alive; the rate is creates completed over the window. The
// caller kills them after (killAll).
func Sustained(ctx context.Context, clients []*client.Client, conns int, d time.Duration) Burst {
	var ok, bad atomic.Int64
	var mu sync.Mutex
	var first error
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	start := time.Now()
	var wg sync.WaitGroup
	for i := 0; i < conns; i++ {
		wg.Add(1)
		go func(c *client.Client) {
			defer wg.Done()
			for ctx.Err() == nil {
				if _, err := c.Create(ctx, hostSandbox(120)); err == nil {
					ok.Add(1)
				} else if ctx.Err() == nil {
					bad.Add(1)
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
				}
			}
		}(clients[i%len(clients)])
	}
	wg.Wait()
	el := time.Since(start).Seconds()
	return Burst{Creates: int(ok.Load()), Errors: int(bad.Load()), Rate: float64(ok.Load()) / el, FirstErr: first}
}

// KillAll kills every sandbox of c's key.
func KillAll(c *client.Client) { killAll(c) }

func podOf(o any) (*corev1.Pod, bool) {
	p, ok := o.(*corev1.Pod)
	return p, ok
}

// CPUTime is a process's user and system CPU time so far (from
// /proc/PID/stat; clock ticks of 100 Hz, as Linux reports them).
func CPUTime(pid int) (time.Duration, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	i := bytes.LastIndexByte(data, ')')
	f := strings.Fields(string(data[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: short", pid)
	}
	u, err1 := strconv.ParseInt(f[11], 10, 64)
	s, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: %v %v", pid, err1, err2)
	}
	return time.Duration(u+s) * 10 * time.Millisecond, nil
}

// Watchers opens n watches of the namespace's sandbox pods, as n more
// fronts' informers would, and drains them until the returned stop.
func (c *Cluster) Watchers(ctx context.Context, n int) (stop func(), err error) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	stop = func() { cancel(); wg.Wait() }
	for i := 0; i < n; i++ {
		w, err := c.Admin.CoreV1().Pods(ClusterNamespace).Watch(ctx, metav1.ListOptions{LabelSelector: cluster.LabelSandbox + "=true"})
		if err != nil {
			stop()
			return nil, fmt.Errorf("watch %d of %d: %w", i+1, n, err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range w.ResultChan() {
			}
		}()
		go func() { <-ctx.Done(); w.Stop() }()
	}
	return stop, nil
}

// ByClient tallies the audit log's requests received in [from, to) by
// client, verb and resource ("node a DELETE pods"), leaving out the
// admin's (the bench's own) and those for no resource (/metrics).
func (c *Cluster) ByClient(from, to time.Time) (map[string]float64, error) {
	if c.Plane.AuditLog == "" {
		return nil, fmt.Errorf("the plane keeps no audit log")
	}
	f, err := os.Open(c.Plane.AuditLog)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	tally := map[string]float64{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var ev struct {
			Stage string
			User  struct{ Username string }
			Verb  string
			Ref   *struct{ Resource, Subresource string } `json:"objectRef"`
			At    time.Time                               `json:"requestReceivedTimestamp"`
		}
		if json.Unmarshal(sc.Bytes(), &ev) != nil || ev.Ref == nil || ev.At.Before(from) || !ev.At.Before(to) {
			continue
		}
		// A watch's record is its start; any other request's, its end.
		if (ev.Verb == "watch") != (ev.Stage == "ResponseStarted") || (ev.Stage != "ResponseStarted" && ev.Stage != "ResponseComplete") {
			continue
		}
		who := ev.User.Username
		switch {
		case who == "admin":
			continue
		case strings.HasPrefix(who, "cage:node:"):
			who = "node " + strings.TrimPrefix(who, "cage:node:")
		case who == "system:kube-scheduler":
			who = "scheduler"
		}
		res := ev.Ref.Resource
		if ev.Ref.Subresource != "" {
			res += "/" + ev.Ref.Subresource
		}
		tally[who+" "+strings.ToUpper(ev.Verb)+" "+res]++
	}
	return tally, sc.Err()
}

// TopOf is the n largest entries of m divided by per, "key 1.00, ...".
func TopOf(m map[string]float64, n int, per float64) string {
	return APIDelta{Requests: m}.Top(n, per)
}
