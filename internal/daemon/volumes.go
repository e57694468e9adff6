package daemon

import (
	"fmt"
	"log/slog"

	"github.com/cagehq/cage/internal/units"
	"github.com/cagehq/cage/internal/volume"
)

// Volumes configures the volumes (E2B's Volume API): each is a file
// system of max_size bytes (its quota: a sparse ext4 image under
// DATA/volumes, taking host disk only as it is written), and a key may
// have max_per_key of them.
type Volumes struct {
	MaxSize   string `json:"max_size"`    // e.g. "10G" (default 1G; at least 8M)
	MaxPerKey int    `json:"max_per_key"` // default 100
}

// manager reads the section into the volumes' manager.
func (v Volumes) manager(data, runDir string, log *slog.Logger) (*volume.Manager, error) {
	size := volume.DefaultSize
	if v.MaxSize != "" {
		n, err := units.ParseSize(v.MaxSize)
		if err != nil || n < volume.MinSize {
			return nil, fmt.Errorf("volumes.max_size %q: want a size of at least 8M", v.MaxSize)
		}
		size = n
	}
	if v.MaxPerKey < 0 {
		return nil, fmt.Errorf("volumes.max_per_key: a negative number is no limit")
	}
	return volume.New(volume.Config{Data: data, RunDir: runDir, Size: size, Log: log}), nil
}
