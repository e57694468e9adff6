package api

import (
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/store"
)

// Per-key rate limits: each key has two token buckets, one for its API
// requests and one for its creates (a create, a resume, a fork, a connect
// that resumes). A request over its bucket is refused before its body is
// read: 429 in E2B's error shape, with Retry-After in whole seconds until
// a token is back. The rates are the server's (Config.Rates), or the
// key's team's where the team sets them; bursts are twice the rate (at
// least 1). The buckets of idle keys are forgotten.

// Rates are requests and creates a second per key; 0 is no limit.
type Rates struct {
	Requests float64
	Creates  float64
}

// DefaultRates are the server's rates when its config names none.
var DefaultRates = Rates{Requests: 1000, Creates: 100}

type tokenBucket struct {
	tokens float64
	last   time.Time
}

// limiter holds the buckets and a cache of the teams' rates.
type limiter struct {
	mu      sync.Mutex
	buckets map[string]*tokenBucket // "r:"+key, "c:"+key
	teams   map[string]teamRates
	sweep   time.Time
}

type teamRates struct {
	r  Rates
	at time.Time
}

// teamRatesTTL is how long a team's rates are cached: a change through the
// admin API applies at once (forget), one made by `cage teams` on the host
// within this.
const teamRatesTTL = 2 * time.Second

func burstOf(rate float64) float64 { return max(1, 2*rate) }

// take takes a token from bucket key (rate a second, burst twice that);
// when there is none it says how long until there is.
func (l *limiter) take(key string, rate float64, now time.Time) (bool, time.Duration) {
	return l.takeN(key, rate, 1, now)
}

// takeN takes n tokens at once, or none (n beyond the burst never fits:
// the wait is then what n tokens would take from an empty bucket).
func (l *limiter) takeN(key string, rate float64, n int, now time.Time) (bool, time.Duration) {
	if rate <= 0 {
		return true, 0
	}
	burst := burstOf(rate)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.buckets == nil {
		l.buckets = map[string]*tokenBucket{}
	}
	if now.Sub(l.sweep) > time.Minute {
		l.sweep = now
		for k, b := range l.buckets {
			if now.Sub(b.last) > 10*time.Minute {
				delete(l.buckets, k)
			}
		}
	}
	b := l.buckets[key]
	if b == nil {
		b = &tokenBucket{tokens: burst, last: now}
		l.buckets[key] = b
	}
	b.tokens = min(burst, b.tokens+now.Sub(b.last).Seconds()*rate)
	b.last = now
	need := float64(n)
	if b.tokens >= need {
		b.tokens -= need
		return true, 0
	}
	return false, time.Duration((need - b.tokens) / rate * float64(time.Second))
}

// ratesOf is the rates of key k: its team's where set, else the server's.
func (s *server) ratesOf(k *store.APIKey) Rates { return s.teamRatesOf(k.TeamID) }

// teamRatesOf is a team's rates where it sets them, else the server's (""
// is no team).
func (s *server) teamRatesOf(team string) Rates {
	r := s.cfg.Rates
	if team == "" {
		return r
	}
	l := &s.limits
	now := time.Now()
	l.mu.Lock()
	c, ok := l.teams[team]
	l.mu.Unlock()
	if !ok || now.Sub(c.at) > teamRatesTTL {
		c = teamRates{r: r, at: now}
		if t, err := s.cfg.Store.GetTeam(team); err == nil {
			if t.Limits.Requests > 0 {
				c.r.Requests = t.Limits.Requests
			}
			if t.Limits.Creates > 0 {
				c.r.Creates = t.Limits.Creates
			}
		}
		l.mu.Lock()
		if l.teams == nil {
			l.teams = map[string]teamRates{}
		}
		l.teams[team] = c
		l.mu.Unlock()
	}
	return c.r
}

// forgetTeam drops a team's cached rates (they changed).
func (s *server) forgetTeam(id string) {
	s.limits.mu.Lock()
	delete(s.limits.teams, id)
	s.limits.mu.Unlock()
}

// allowRequest takes one of the key's request tokens, or answers 429.
func (s *server) allowRequest(w http.ResponseWriter, k *store.APIKey) bool {
	rate := s.ratesOf(k).Requests
	ok, wait := s.limits.take("r:"+k.ID, rate, time.Now())
	if !ok {
		s.rateLimited(w, "requests", k.ID, rate, wait)
	}
	return ok
}

// allowCreate takes one of the calling key's create tokens, or answers 429.
func (s *server) allowCreate(w http.ResponseWriter, r *http.Request) bool {
	return s.allowCreates(w, r, 1)
}

// allowCreates takes n of the calling key's create tokens (a fork of n
// sandboxes), or answers 429: n creates cost n, however they are asked for.
//
// A request another node forwarded takes them here all the same: the
// front forwards a sandbox's routes (a resume, a connect that resumes)
// before its handler runs, so the front took none. Found by review,
// 2026-12-04: skipped here too, a key's resumes through any front but
// the sandbox's node were bounded by its request rate only.
func (s *server) allowCreates(w http.ResponseWriter, r *http.Request, n int) bool {
	k := callerOf(r)
	if k == nil {
		return true
	}
	rate := s.ratesOf(k).Creates
	if rate > 0 && float64(n) > burstOf(rate) {
		s.cfg.Metrics.RateLimited("creates")
		writeError(w, http.StatusTooManyRequests, fmt.Sprintf("rate limit: key %s may make %s creates a second in bursts of %s; a fork of %d is more than a burst",
			k.ID, strconv.FormatFloat(rate, 'f', -1, 64), strconv.FormatFloat(burstOf(rate), 'f', -1, 64), n))
		return false
	}
	ok, wait := s.limits.takeN("c:"+k.ID, rate, n, time.Now())
	if !ok {
		s.rateLimited(w, "creates", k.ID, rate, wait)
	}
	return ok
}

// allowContent takes one of a volume owner's content tokens, or answers
// 429 in the content API's shape. The content routes take the volume's
// token, not a key, so they have a bucket of their own per owner (a key,
// or a team for all its keys' volumes) at the owner's request rate: a
// volume's token holder cannot make the host's disk work for it without
// bound, whatever key or volume it uses.
func (s *server) allowContent(w http.ResponseWriter, r *http.Request, owner string) bool {
	if s.forwarded(r) {
		return true
	}
	team := ""
	if strings.HasPrefix(owner, store.TeamPrefix) {
		team = owner
	}
	rate := s.teamRatesOf(team).Requests
	ok, wait := s.limits.take("v:"+owner, rate, time.Now())
	if !ok {
		secs := retryAfter(wait)
		s.cfg.Metrics.RateLimited("content")
		w.Header().Set("Retry-After", strconv.Itoa(secs))
		writeContentError(w, http.StatusTooManyRequests, "rate_limited", fmt.Sprintf(
			"rate limit: the volumes of %s may take %s content requests a second (bursts of %s); retry after %d s",
			owner, strconv.FormatFloat(rate, 'f', -1, 64), strconv.FormatFloat(burstOf(rate), 'f', -1, 64), secs))
	}
	return ok
}

// retryAfter is a wait in whole seconds, at least one.
func retryAfter(wait time.Duration) int { return max(1, int(math.Ceil(wait.Seconds()))) }

func (s *server) rateLimited(w http.ResponseWriter, what, key string, rate float64, wait time.Duration) {
	secs := retryAfter(wait)
	s.cfg.Metrics.RateLimited(what)
	w.Header().Set("Retry-After", strconv.Itoa(secs))
	writeError(w, http.StatusTooManyRequests, fmt.Sprintf("rate limit: key %s may make %s %s a second (bursts of %s); retry after %d s",
		key, strconv.FormatFloat(rate, 'f', -1, 64), what, strconv.FormatFloat(burstOf(rate), 'f', -1, 64), secs))
}

// maxListsInFlight bounds the list requests whose pages hold what
// tenants chose (sandboxes with their metadata, audit entries, a
// sandbox's network records) that one owner (a team, or a key without
// one) has in flight at once. Lists of small records (snapshots,
// volumes, a sandbox's metrics) are not counted.
//
// A list's answer is written a record at a time, but the page being
// written is held until the client takes it, and a write may wait 30 s:
// a client that reads nothing held one page of each of its requests (a
// page of 100 sandboxes some 15 MiB of metadata, 28 MiB while lists
// read their environments too) on each of the 4,096 connections its
// address may hold (before the answers were written a record at a time,
// up to 1 MiB per sandbox of the key for each). Found by review,
// 2026-12-04.
const maxListsInFlight = 8

// inFlight counts requests in flight by owner.
type inFlight struct {
	mu sync.Mutex
	n  map[string]int
}

// listing answers next for the calling key when its owner has fewer
// than maxListsInFlight lists in flight, else 429 (Retry-After: 1),
// before anything is read.
func (s *server) listing(next http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		release, ok := s.holdList(&s.lists, keyID(r))
		if !ok {
			s.tooManyLists(w, "list requests of this key's owner (its team, or the key)")
			return
		}
		defer release()
		next(w, r)
	})
}

// holdList counts one more request of owner's in l, or says that owner
// has maxListsInFlight already.
func (s *server) holdList(l *inFlight, owner string) (release func(), ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.n[owner] >= maxListsInFlight {
		return nil, false
	}
	if l.n == nil {
		l.n = map[string]int{}
	}
	l.n[owner]++
	return func() {
		l.mu.Lock()
		if l.n[owner]--; l.n[owner] <= 0 {
			delete(l.n, owner)
		}
		l.mu.Unlock()
	}, true
}

// tooManyLists answers 429 for a request over maxListsInFlight.
func (s *server) tooManyLists(w http.ResponseWriter, what string) {
	s.cfg.Metrics.RateLimited("lists")
	w.Header().Set("Retry-After", "1")
	writeError(w, http.StatusTooManyRequests, fmt.Sprintf("%d %s are in flight, the most at once: retry when one has ended", maxListsInFlight, what))
}

// quotaName is the quota an ErrQuota names, for the metrics.
func quotaName(err error) string {
	var q *manager.QuotaError
	if errors.As(err, &q) {
		return q.Quota
	}
	return "other"
}
