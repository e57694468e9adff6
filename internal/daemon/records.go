package daemon

import (
	"fmt"
	"time"

	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/units"
)

// Records bounds the sandboxes' network records (kept in DATA/records.db)
// and the audit trail. Zero values are the defaults
// (manager.DefaultRecordLimits: 20 a second per sandbox with bursts of 200,
// 10,000 per sandbox, 7 days, 256 MiB).
type Records struct {
	Rate       float64  `json:"rate"`        // records a second per sandbox
	Burst      int      `json:"burst"`       // records at once per sandbox
	PerSandbox int64    `json:"per_sandbox"` // records kept per sandbox
	MaxAge     Duration `json:"max_age"`     // records and audit events older are deleted, e.g. "72h"
	MaxSize    string   `json:"max_size"`    // the records' size in their database, e.g. "1G"
}

// limits reads the section.
func (r Records) limits() (manager.RecordLimits, error) {
	l := manager.RecordLimits{Rate: r.Rate, Burst: r.Burst, PerSandbox: r.PerSandbox, MaxAge: time.Duration(r.MaxAge)}
	if r.Rate < 0 || r.Burst < 0 || r.PerSandbox < 0 || r.MaxAge < 0 {
		return l, fmt.Errorf("records: negative values are not limits")
	}
	if r.MaxSize != "" {
		n, err := units.ParseSize(r.MaxSize)
		if err != nil || n < 1<<20 {
			return l, fmt.Errorf("records.max_size %q: want a size of at least 1M", r.MaxSize)
		}
		l.MaxBytes = n
	}
	return l, nil
}
