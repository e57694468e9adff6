package cli

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/spf13/cobra"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/units"
)

// The lifecycle commands: pause, resume, snapshot and fork, clients of the
// daemon as the other sandbox commands are.

func newPauseCmd(d *daemonFlags) *cobra.Command {
	var filesOnly bool
	cmd := &cobra.Command{
		Use:   "pause ID",
		Short: "Pause a sandbox (its memory kept unless --files-only)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := d.client()
			if err != nil {
				return err
			}
			if err := c.Pause(ctx(cmd), args[0], !filesOnly); err != nil {
				return apiFailure(err)
			}
			if !d.json {
				fmt.Fprintln(cmd.OutOrStdout(), args[0])
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&filesOnly, "files-only", false, "keep only the sandbox's files: its memory is released and its processes end")
	return cmd
}

func newResumeCmd(d *daemonFlags) *cobra.Command {
	var timeout string
	cmd := &cobra.Command{
		Use:   "resume ID",
		Short: "Resume a paused sandbox (a running one is only extended)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			t, err := units.ParseDuration(timeout)
			if err != nil || t < time.Second || t/time.Second > math.MaxInt32 {
				return exitf(ExitUsage, "--timeout %q: want a duration of at least 1s", timeout)
			}
			c, err := d.client()
			if err != nil {
				return err
			}
			sb, err := c.Resume(ctx(cmd), args[0], int64(t/time.Second))
			if err != nil {
				return apiFailure(err)
			}
			if d.json {
				return jsonEncoder(cmd.OutOrStdout()).Encode(sb)
			}
			fmt.Fprintln(cmd.OutOrStdout(), sb.SandboxID)
			return nil
		},
	}
	cmd.Flags().StringVar(&timeout, "timeout", "5m", "how long the resumed sandbox lives")
	return cmd
}

func newSnapshotCmd(d *daemonFlags) *cobra.Command {
	var name string
	cmd := &cobra.Command{
		Use:   "snapshot ID",
		Short: "Save a running sandbox's files as a snapshot (create from it with --template SNAPSHOT)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := d.client()
			if err != nil {
				return err
			}
			sn, err := c.Snapshot(ctx(cmd), args[0], name)
			if err != nil {
				return apiFailure(err)
			}
			if d.json {
				return jsonEncoder(cmd.OutOrStdout()).Encode(sn)
			}
			fmt.Fprintln(cmd.OutOrStdout(), sn.SnapshotID)
			return nil
		},
	}
	cmd.Flags().StringVar(&name, "name", "", "a name for the snapshot")
	return cmd
}

func newForkCmd(d *daemonFlags) *cobra.Command {
	var n int
	var timeout string
	cmd := &cobra.Command{
		Use:   "fork ID",
		Short: "Make N sandboxes from a running sandbox's files, on its wall (its processes are not copied)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if n < 1 || n > 100 {
				return exitf(ExitUsage, "-n %d: want 1 to 100", n)
			}
			t, err := units.ParseDuration(timeout)
			if err != nil || t < time.Second || t/time.Second > math.MaxInt32 {
				return exitf(ExitUsage, "--timeout %q: want a duration of at least 1s", timeout)
			}
			c, err := d.client()
			if err != nil {
				return err
			}
			forks, err := c.Fork(ctx(cmd), args[0], int32(n), int32(t/time.Second))
			if err != nil {
				return apiFailure(err)
			}
			made := make([]types.Sandbox, 0, len(forks))
			var failed []string
			for i, f := range forks {
				if f.Error.Code != 0 {
					failed = append(failed, fmt.Sprintf("fork %d: %s", i+1, f.Error.Message))
					continue
				}
				made = append(made, f.Sandbox)
			}
			if len(failed) > 0 {
				// All or nothing: the ones that started go with the others.
				for _, sb := range made {
					_ = c.Kill(context.Background(), sb.SandboxID)
				}
				return exitf(ExitInternal, "%d of %d forks failed: %s", len(failed), n, failed[0])
			}
			if d.json {
				return jsonEncoder(cmd.OutOrStdout()).Encode(made)
			}
			for _, sb := range made {
				fmt.Fprintln(cmd.OutOrStdout(), sb.SandboxID)
			}
			return nil
		},
	}
	cmd.Flags().IntVarP(&n, "n", "n", 1, "how many sandboxes")
	cmd.Flags().StringVar(&timeout, "timeout", "5m", "how long each lives")
	return cmd
}
