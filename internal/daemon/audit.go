package daemon

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/units"
)

// Audit configures the audit trail (DATA/audit.db). Zero values are the
// defaults (audit.DefaultLimits: 50,000 entries of processes, files and
// network decisions per sandbox, API calls at 200 a second per key, 30
// days, 1 GiB).
type Audit struct {
	// Disabled keeps no trail (for measuring what it costs).
	Disabled   bool     `json:"disabled"`
	PerSandbox int64    `json:"per_sandbox"` // entries kept per sandbox (processes, files, envd calls, network)
	KeyRate    float64  `json:"key_rate"`    // API-call entries a second per key
	KeyBurst   int      `json:"key_burst"`
	MaxAge     Duration `json:"max_age"`  // entries older are removed (anchored), e.g. "720h"
	MaxSize    string   `json:"max_size"` // the trail's size in its database, e.g. "1G"
}

// limits reads the section.
func (a Audit) limits() (audit.Limits, error) {
	l := audit.Limits{PerSandbox: a.PerSandbox, KeyRate: a.KeyRate, KeyBurst: a.KeyBurst, MaxAge: time.Duration(a.MaxAge)}
	if a.PerSandbox < 0 || a.KeyRate < 0 || a.KeyBurst < 0 || a.MaxAge < 0 {
		return l, fmt.Errorf("audit: negative values are not limits")
	}
	if a.MaxSize != "" {
		n, err := units.ParseSize(a.MaxSize)
		if err != nil || n < 1<<20 {
			return l, fmt.Errorf("audit.max_size %q: want a size of at least 1M", a.MaxSize)
		}
		l.MaxBytes = n
	}
	return l, nil
}

// startAudit opens the trail's database and starts its writer (nil, nil
// when disabled).
func (a Audit) start(data string, log *slog.Logger) (*audit.Trail, error) {
	if a.Disabled {
		log.Warn("audit trail disabled (config audit.disabled)")
		return nil, nil
	}
	lim, err := a.limits()
	if err != nil {
		return nil, err
	}
	db, err := audit.Open(data)
	if err != nil {
		return nil, err
	}
	return audit.Start(db, lim, log), nil
}
