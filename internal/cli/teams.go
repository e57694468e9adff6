package cli

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/units"
)

// ExitConflict is `cage teams rm`'s exit code for a team that still holds
// keys, sandboxes, snapshots or volumes, and `create`'s for a name taken.
const ExitConflict = 65

// teamFlags are a team's quotas and rates as flags.
type teamFlags struct {
	sandboxes, paused int64
	cpus              float64
	memory, disk      string
	requests, creates float64
	changed           func(string) bool
}

func (f *teamFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.Int64Var(&f.sandboxes, "sandboxes", 0, "quota: sandboxes running at once (0: none)")
	fl.Float64Var(&f.cpus, "cpus", 0, "quota: vCPUs of the running sandboxes (0: none)")
	fl.StringVar(&f.memory, "memory", "", "quota: memory of the running and frozen sandboxes, e.g. 16G (0: none)")
	fl.StringVar(&f.disk, "disk", "", "quota: disk sizes of all its sandboxes, paused included, and its snapshots' files, e.g. 100G (0: none)")
	fl.Int64Var(&f.paused, "paused", 0, "quota: paused sandboxes (0: none)")
	fl.Float64Var(&f.requests, "requests", 0, "each of its keys' API requests a second (0: the server's, limits.key_requests)")
	fl.Float64Var(&f.creates, "creates", 0, "each of its keys' creates a second (0: the server's, limits.key_creates)")
	f.changed = func(name string) bool { return cmd.Flags().Changed(name) }
}

// limits applies the flags that were given over cur.
func (f *teamFlags) limits(cur store.TeamLimits) (store.TeamLimits, error) {
	l := cur
	set := func(name string, apply func() error) error {
		if !f.changed(name) {
			return nil
		}
		return apply()
	}
	size := func(name, v string, dst *int64) error {
		if v == "0" {
			*dst = 0
			return nil
		}
		n, err := units.ParseSize(v)
		if err != nil {
			return exitf(ExitUsage, "--%s %q: %v", name, v, err)
		}
		*dst = n
		return nil
	}
	for _, e := range []error{
		set("sandboxes", func() error { l.Sandboxes = f.sandboxes; return nil }),
		set("cpus", func() error { l.CPUs = f.cpus; return nil }),
		set("memory", func() error { return size("memory", f.memory, &l.Memory) }),
		set("disk", func() error { return size("disk", f.disk, &l.Disk) }),
		set("paused", func() error { l.Paused = f.paused; return nil }),
		set("requests", func() error { l.Requests = f.requests; return nil }),
		set("creates", func() error { l.Creates = f.creates; return nil }),
	} {
		if e != nil {
			return l, e
		}
	}
	if err := l.Valid(); err != nil {
		return l, exitf(ExitUsage, "%v", err)
	}
	return l, nil
}

func newTeamsCmd() *cobra.Command {
	var data string
	var asJSON bool
	open := func() (*store.Store, error) { return openStore(&data) }
	cmd := &cobra.Command{Use: "teams", Short: "Manage teams: who owns what, with quotas and rates (create | ls | set | rm)",
		Long: `Teams are the tenancy boundary: a team's keys (cage keys create --team NAME) share its
sandboxes, snapshots, volumes and audit entries, and see nothing of another team's. A key
without a team is a team of its own. A team's quotas bound what it holds at once; its
rates bound each of its keys. These commands change the store on this host (root); an
admin key does the same through the API (/admin/teams).`}
	cmd.PersistentFlags().StringVar(&data, "data", "", "the daemon's state directory (default $CAGE_DATA or /var/lib/cage)")
	cmd.PersistentFlags().BoolVar(&asJSON, "json", false, "print JSON")
	record := func(kind string, t *store.Team) error {
		ka, err := openKeyAudit(data)
		if err != nil {
			return err
		}
		return ka.record(kind, "", map[string]any{"team": t.ID, "name": t.Name, "limits": t.Limits})
	}

	cf := &teamFlags{}
	create := &cobra.Command{
		Use:   "create NAME",
		Short: "Create a team (its id is printed)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !store.ValidTeamName(args[0]) {
				return exitf(ExitUsage, "team name %q: want 1 to 63 of a-z, 0-9, '-' and '_', starting with a letter or digit, not with %q", args[0], store.TeamPrefix)
			}
			l, err := cf.limits(store.TeamLimits{})
			if err != nil {
				return err
			}
			st, err := open()
			if err != nil {
				return err
			}
			defer st.Close()
			t, err := st.CreateTeam(args[0], l)
			if errors.Is(err, store.ErrConflict) {
				return exitf(ExitConflict, "a team named %q exists already", args[0])
			}
			if err != nil {
				return exitf(ExitInternal, "%v", err)
			}
			if err := record(audit.KindTeamCreate, t); err != nil {
				return err
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), teamOut(t, nil))
			}
			fmt.Fprintln(cmd.OutOrStdout(), t.ID)
			return nil
		},
	}
	cf.register(create)

	sf := &teamFlags{}
	set := &cobra.Command{
		Use:   "set NAME",
		Short: "Change a team's quotas and rates (the flags given; 0 is none)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			st, err := open()
			if err != nil {
				return err
			}
			defer st.Close()
			t, err := st.GetTeam(args[0])
			if errors.Is(err, store.ErrNotFound) {
				return exitf(ExitNotFoundObj, "no team %q", args[0])
			}
			if err != nil {
				return exitf(ExitInternal, "%v", err)
			}
			if t.Limits, err = sf.limits(t.Limits); err != nil {
				return err
			}
			if err := st.SetTeamLimits(t.ID, t.Limits); err != nil {
				return exitf(ExitInternal, "%v", err)
			}
			return record(audit.KindTeamUpdate, t)
		},
	}
	sf.register(set)

	ls := &cobra.Command{
		Use:   "ls",
		Short: "List teams with their quotas, rates and what they hold",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			st, err := open()
			if err != nil {
				return err
			}
			defer st.Close()
			return listTeams(cmd.OutOrStdout(), st, asJSON)
		},
	}
	rm := &cobra.Command{
		Use:   "rm NAME",
		Short: "Remove a team that holds nothing (revoke its keys, kill its sandboxes, delete its snapshots and volumes first)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			st, err := open()
			if err != nil {
				return err
			}
			defer st.Close()
			t, err := st.GetTeam(args[0])
			if err == nil {
				err = st.DeleteTeam(t.ID)
			}
			switch {
			case errors.Is(err, store.ErrNotFound):
				return exitf(ExitNotFoundObj, "no team %q", args[0])
			case errors.Is(err, store.ErrConflict):
				return exitf(ExitConflict, "team %s (%s) still has %s", t.Name, t.ID, heldOf(err))
			case err != nil:
				return exitf(ExitInternal, "%v", err)
			}
			if err := record(audit.KindTeamDelete, t); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "removed %s\n", t.ID)
			return nil
		},
	}
	cmd.AddCommand(create, ls, set, rm)
	return cmd
}

// heldOf is what a store's conflict says a team still holds.
func heldOf(err error) string {
	_, rest, ok := strings.Cut(err.Error(), "still has ")
	if !ok {
		return "something"
	}
	held, _, _ := strings.Cut(rest, ": ")
	return held
}

type teamJSON struct {
	ID        string           `json:"id"`
	Name      string           `json:"name"`
	CreatedAt time.Time        `json:"createdAt"`
	Limits    store.TeamLimits `json:"limits"`
	Usage     *store.Usage     `json:"usage,omitempty"`
}

func teamOut(t *store.Team, u *store.Usage) teamJSON {
	return teamJSON{ID: t.ID, Name: t.Name, CreatedAt: t.CreatedAt, Limits: t.Limits, Usage: u}
}

func listTeams(w io.Writer, st *store.Store, asJSON bool) error {
	ts, err := st.ListTeams()
	if err != nil {
		return exitf(ExitInternal, "%v", err)
	}
	out := []teamJSON{}
	for _, t := range ts {
		u, err := st.Usage(t.ID, "memory")
		if err != nil {
			return exitf(ExitInternal, "%v", err)
		}
		out = append(out, teamOut(t, &u))
	}
	if asJSON {
		return printJSON(w, out)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tNAME\tSANDBOXES\tCPUS\tMEMORY\tDISK\tPAUSED\tREQ/S\tCREATES/S")
	q := func(used, limit string, has bool) string {
		if !has {
			return used
		}
		return used + "/" + limit
	}
	rate := func(v float64) string {
		if v == 0 {
			return "server's"
		}
		return strconv.FormatFloat(v, 'f', -1, 64)
	}
	for _, t := range out {
		l, u := t.Limits, t.Usage
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", t.ID, termSafe(t.Name),
			q(fmt.Sprint(u.Sandboxes), fmt.Sprint(l.Sandboxes), l.Sandboxes > 0),
			q(strconv.FormatFloat(u.CPUs, 'f', -1, 64), strconv.FormatFloat(l.CPUs, 'f', -1, 64), l.CPUs > 0),
			q(units.FormatSize(u.Memory), units.FormatSize(l.Memory), l.Memory > 0),
			q(units.FormatSize(u.Disk), units.FormatSize(l.Disk), l.Disk > 0),
			q(fmt.Sprint(u.Paused), fmt.Sprint(l.Paused), l.Paused > 0),
			rate(l.Requests), rate(l.Creates))
	}
	return tw.Flush()
}
