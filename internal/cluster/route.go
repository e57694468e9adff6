package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httputil"
	"sync"
	"time"

	"github.com/cagehq/cage/internal/proxy"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// podOf returns sandbox id's pod: from the informer, else, when ask (a
// pod another front made a moment ago may not have reached it), from the
// API server. Only authenticated callers ask: anyone can send the proxy
// made-up ids, which must cost the API server nothing.
func (f *Front) podOf(ctx context.Context, id string, ask bool) *corev1.Pod {
	if p, err := f.pods.Get(id); err == nil {
		return p
	}
	if !ask {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	p, err := f.cfg.Client.CoreV1().Pods(f.cfg.Namespace).Get(ctx, id, metav1.GetOptions{})
	if err != nil || p.Labels[LabelSandbox] != "true" {
		return nil
	}
	return p
}

// An owner's requests for sandboxes the pod informer has not seen ask
// the API server at most askRate times a second (bursts of askBurst);
// past that, the informer alone answers (a sandbox made through another
// front a moment ago may then be a 404 until the informer has its pod).
// Each such request was a GET of the Kubernetes API server, which every
// tenant and the whole cluster share: a key's 1,000 requests a second
// for made-up ids were 1,000 GETs a second (found by review, 2026-12-04).
const (
	askRate  = 20
	askBurst = 2 * askRate
)

// asks are the owners' budgets of API server lookups (mayAsk).
type asks struct {
	mu      sync.Mutex
	buckets map[string]*askBucket
	sweep   time.Time
}

type askBucket struct {
	tokens float64
	last   time.Time
}

// mayAsk takes one of owner's API server lookups, or says there is none.
func (f *Front) mayAsk(owner string) bool {
	a := &f.asks
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.buckets == nil {
		a.buckets = map[string]*askBucket{}
	}
	if now.Sub(a.sweep) > time.Minute {
		a.sweep = now
		for k, b := range a.buckets {
			if now.Sub(b.last) > time.Minute {
				delete(a.buckets, k)
			}
		}
	}
	b := a.buckets[owner]
	if b == nil {
		b = &askBucket{tokens: askBurst, last: now}
		a.buckets[owner] = b
	}
	b.tokens = min(askBurst, b.tokens+now.Sub(b.last).Seconds()*askRate)
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

// elsewhere returns the node that holds sandbox id when it is another
// node ("" when the request is this node's to answer: the sandbox is
// here, is no sandbox of the cluster, is not owner's, or the request came
// from another node: such a request, which carries AuthHeader, is
// answered where it arrives, never forwarded again, so two nodes that
// disagree on a pod's place cannot loop). checkOwner is for API requests: their caller is
// authenticated, and a pod not yet in the informer is asked for.
func (f *Front) elsewhere(r *http.Request, id, owner string, checkOwner bool) (string, *corev1.Pod) {
	if r.Header.Get(AuthHeader) != "" || id == "" {
		return "", nil
	}
	p := f.podOf(r.Context(), id, false)
	if p == nil && checkOwner && f.mayAsk(owner) {
		p = f.podOf(r.Context(), id, true)
	}
	if p == nil || p.Spec.NodeName == "" || p.Spec.NodeName == f.cfg.NodeName {
		return "", nil
	}
	if checkOwner && p.Labels[LabelKey] != owner {
		return "", nil // another tenant's: the local answer is "not found"
	}
	return p.Spec.NodeName, p
}

// Forward serves an API request for sandbox id when the sandbox is on
// another node, and reports whether it did (false: the caller answers it
// locally). owner is the calling key's owner (store.APIKey.Owner): a
// sandbox of another owner is answered locally, which says it does not
// exist. The request goes to the owner node's API as it came (the
// client's own API key: keys are cluster-wide), signed as from this
// node. A sandbox on a lost node is a 503 that names the node and when
// its lease expired, except a kill, which deletes its pod (204): the node
// destroys the sandbox when it returns.
func (f *Front) Forward(w http.ResponseWriter, r *http.Request, id, owner string) bool {
	node, pod := f.elsewhere(r, id, owner, true)
	if node == "" {
		return false
	}
	kill := r.Method == http.MethodDelete && r.URL.Path == "/sandboxes/"+id
	if lost, expired := f.lost(node); lost {
		if kill {
			if err := f.deletePod(r.Context(), pod.Name); err != nil {
				f.log.Warn("cluster: delete the pod of a sandbox on a lost node", "sandbox", id, "node", node, "err", err)
				apiError(w, http.StatusServiceUnavailable, "sandbox "+id+" is on lost node "+node+" and its pod could not be deleted: "+oneLine(err.Error()))
				return true
			}
			w.WriteHeader(http.StatusNoContent)
			return true
		}
		apiError(w, http.StatusServiceUnavailable, trimKind(lostError(id, node, expired)))
		return true
	}
	base, err := f.nodeURL(node, AnnoAPI)
	if err != nil {
		apiError(w, http.StatusServiceUnavailable, err.Error())
		return true
	}
	held, ok := f.holdForward(w, r, node, apiError)
	if !ok {
		return true
	}
	defer held()
	r, done := f.whileLive(r, id, node)
	defer done()
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(base)
			pr.Out.Host = base.Host
			Sign(pr.Out, f.cfg.NodeKey, f.cfg.NodeName, node, ForAPI)
		},
		Transport:     f.cfg.HTTP.Transport,
		FlushInterval: -1,
		ModifyResponse: func(resp *http.Response) error {
			if kill && resp.StatusCode == http.StatusNoContent {
				f.Killed(r.Context(), id)
			}
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if cause := context.Cause(r.Context()); errors.Is(cause, errLost) {
				apiError(w, http.StatusServiceUnavailable, trimKind(cause))
				return
			}
			if r.Context().Err() == nil {
				f.forwardFailed("cluster: forward to node", id, node, err)
			}
			apiError(w, http.StatusBadGateway, "sandbox "+id+" is on node "+node+", which did not answer")
		},
	}
	rp.ServeHTTP(w, r)
	return true
}

// ForwardTraffic forwards sandbox traffic (the proxy's) for sandbox id
// to the proxy of the node that holds it, and reports whether it did
// (false: the sandbox is not on another node; the proxy answers as for
// any unknown sandbox). Headers go as they came: the owner's proxy checks
// the access and traffic tokens, as for a request made to it. Streams
// (Connect's server streams) and WebSocket upgrades pass through.
func (f *Front) ForwardTraffic(w http.ResponseWriter, r *http.Request, id string) bool {
	node, _ := f.elsewhere(r, id, "", false)
	if node == "" {
		return false
	}
	if lost, expired := f.lost(node); lost {
		proxyError(w, id, http.StatusServiceUnavailable, trimKind(lostError(id, node, expired)))
		return true
	}
	base, err := f.nodeURL(node, AnnoProxy)
	if err != nil {
		proxyError(w, id, http.StatusServiceUnavailable, err.Error())
		return true
	}
	held, ok := f.holdForward(w, r, node, func(w http.ResponseWriter, status int, msg string) { proxyError(w, id, status, msg) })
	if !ok {
		return true
	}
	defer held()
	r, done := f.whileLive(r, id, node)
	defer done()
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme, pr.Out.URL.Host = base.Scheme, base.Host
			pr.Out.Host = r.Host // the owner routes by Host as this proxy did
			// The owner sees this node's address: the client's, for its
			// share of a sandbox's anonymous budget, goes with the
			// signature (TrafficClient), never a client's own header.
			pr.Out.Header.Set(proxy.ClientHeader, proxy.ClientOf(r))
			Sign(pr.Out, f.cfg.NodeKey, f.cfg.NodeName, node, ForTraffic)
		},
		Transport:     f.cfg.HTTP.Transport,
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if cause := context.Cause(r.Context()); errors.Is(cause, errLost) {
				proxyError(w, id, http.StatusServiceUnavailable, trimKind(cause))
				return
			}
			if r.Context().Err() == nil {
				f.forwardFailed("cluster: forward traffic to node", id, node, err)
			}
			proxyError(w, id, http.StatusBadGateway, "sandbox "+id+" is on node "+node+", which did not answer")
		},
	}
	// A stream answers before the request body is read (see proxy.serve).
	_ = http.NewResponseController(w).EnableFullDuplex()
	rp.ServeHTTP(w, r)
	return true
}

// forwardFailed logs a forward to node that failed, at most one line a
// second for each node and msg, with how many were left out. Anyone who
// reaches the proxy can make one a request while the node does not
// answer and is not yet lost: found by review, 2026-12-05, each was a
// line, unbounded, filling the host's log and the journal's rate limit
// that the daemon's own lines share.
func (f *Front) forwardFailed(msg, id, node string, err error) {
	if ok, skipped := f.failLog.Allow(msg + "\x00" + node); ok {
		f.log.Warn(msg, "sandbox", id, "node", node, "err", err, "not_logged_before", skipped)
	}
}

// TrafficClient is the proxy's Client in cluster mode: the client that
// sandbox traffic another node forwarded here came from, as that node
// named it (proxy.ClientHeader), where its node signature verifies; ""
// for any other request (the proxy then goes by its address).
func (f *Front) TrafficClient(r *http.Request) string {
	c := r.Header.Get(proxy.ClientHeader)
	if c == "" || r.Header.Get(AuthHeader) == "" {
		return ""
	}
	if _, err := Verify(r, f.cfg.NodeKey, f.cfg.NodeName, ForTraffic); err != nil {
		return ""
	}
	return c
}

// Forwarded says whether r is an API request another node of the cluster
// forwarded to this one (its node signature verifies under the cluster's
// key, as made for this node's API).
func (f *Front) Forwarded(r *http.Request) bool {
	_, err := Verify(r, f.cfg.NodeKey, f.cfg.NodeName, ForAPI)
	return err == nil
}

// whileLive returns r with a context that ends, with the lost error as
// its cause, as soon as node is lost: a request in flight to a node that
// dies or is cut off (whose connection may hang, not break) is answered
// then. done releases the watch.
func (f *Front) whileLive(r *http.Request, id, node string) (*http.Request, func()) {
	ctx, cancel := context.WithCancelCause(r.Context())
	go func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if lost, expired := f.lost(node); lost {
					cancel(lostError(id, node, expired))
					return
				}
			}
		}
	}()
	return r.WithContext(ctx), func() { cancel(nil) }
}

// trimKind is err's message without errLost's prefix.
func trimKind(err error) string {
	msg := err.Error()
	if errors.Is(err, errLost) {
		msg = msg[len(errLost.Error())+2:]
	}
	return msg
}

// apiError writes an E2B API error.
func apiError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"code": status, "message": msg})
}

// proxyError writes an error in the shape of the proxy's.
func proxyError(w http.ResponseWriter, id string, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"sandboxId": id, "message": msg, "code": status})
}
