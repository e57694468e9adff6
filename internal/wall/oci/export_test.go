package oci

import (
	"context"

	"github.com/cagehq/cage/internal/wall"
)

// StopAgent has a gVisor sandbox's agent let go of its lock, as it does
// before a checkpoint, then stops it (SIGSTOP from the runtime): an agent
// that will not come back after a restore, as a compromised one may
// choose.
func StopAgent(ctx context.Context, s wall.Sandbox) error {
	sb := s.(*Sandbox)
	if err := sb.releaseLock(ctx); err != nil {
		return err
	}
	_, err := sb.runtime(ctx, "kill", sb.id, "STOP")
	return err
}
