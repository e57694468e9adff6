package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/cagehq/cage/api/types"
	"github.com/cagehq/cage/internal/api"
	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/store"
)

// ExitBroken is `cage audit verify`'s exit code when the chain does not
// hold.
const ExitBroken = 1

// auditFlags are `cage audit`'s filters.
type auditFlags struct {
	data, sandbox, since, until, kinds, keyID, team string
	limit                                           int
}

func newAuditCmd() *cobra.Command {
	d := &daemonFlags{}
	f := &auditFlags{}
	cmd := &cobra.Command{
		Use:   "audit",
		Short: "Show the audit trail (verify: check its chain; head: the hash to keep elsewhere)",
		Long: `Show the audit trail, oldest first: API calls, sandbox lifecycle, processes started
and how they ended, files written, read, moved and removed, network decisions, volume
and API key changes.

With --data (or without an API key) it reads the daemon's store on this host: every
key's entries (root). With an API key (CAGE_API_KEY or --key) it asks the daemon
(GET /audit): that key's own calls and what happened in and to its sandboxes.
--json prints JSON Lines, one entry a line, for a SIEM.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runAudit(cmd.Context(), cmd.OutOrStdout(), d, f)
		},
	}
	d.register(cmd)
	fl := cmd.Flags()
	cmd.PersistentFlags().StringVar(&f.data, "data", "", "read the daemon's state directory on this host (default $CAGE_DATA or /var/lib/cage when no API key is set)")
	fl.StringVar(&f.sandbox, "sandbox", "", "only this sandbox's entries")
	fl.StringVar(&f.since, "since", "", "only entries since this time (RFC 3339) or this long ago (1h)")
	fl.StringVar(&f.until, "until", "", "only entries before this time (RFC 3339) or this long ago")
	fl.StringVar(&f.kinds, "kind", "", "only these kinds or families, comma-separated (process, file.write, ...)")
	fl.StringVar(&f.keyID, "key-id", "", "only this API key's entries (with --data)")
	fl.StringVar(&f.team, "team", "", "only this team's entries, by name or id (with --data)")
	fl.IntVar(&f.limit, "limit", 0, "at most this many entries (0: all)")
	cmd.AddCommand(newAuditVerifyCmd(d, f), newAuditHeadCmd(f))
	return cmd
}

// local says whether to read the store on this host, and where it is.
func (f *auditFlags) local(d *daemonFlags) (string, bool) {
	if f.data == "" && d.key != "" {
		return "", false
	}
	if f.data == "" {
		return envOr("CAGE_DATA", "/var/lib/cage"), true
	}
	return f.data, true
}

// openTrail opens the trail in a data directory that has one.
func openTrail(data string) (*audit.DB, error) {
	if _, err := os.Stat(filepath.Join(data, audit.FileName)); err != nil {
		return nil, exitf(ExitNotFoundObj, "no audit trail in %s (cage serve keeps it there as %s)", data, audit.FileName)
	}
	db, err := audit.Open(data)
	if err != nil {
		return nil, exitf(ExitInternal, "%v", err)
	}
	return db, nil
}

// whenFlag reads an RFC 3339 time or a duration ago.
func whenFlag(name, v string) (time.Time, error) {
	if v == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(v); err == nil && d >= 0 {
		return time.Now().Add(-d), nil
	}
	return time.Time{}, exitf(ExitUsage, "--%s %q: want an RFC 3339 time or a duration such as 1h", name, v)
}

func runAudit(ctx context.Context, w io.Writer, d *daemonFlags, f *auditFlags) error {
	if ctx == nil {
		ctx = context.Background()
	}
	if f.limit < 0 {
		return exitf(ExitUsage, "--limit must be 0 or more")
	}
	since, err := whenFlag("since", f.since)
	if err != nil {
		return err
	}
	until, err := whenFlag("until", f.until)
	if err != nil {
		return err
	}
	var kinds []string
	if f.kinds != "" {
		for _, k := range strings.Split(f.kinds, ",") {
			if k = strings.TrimSpace(k); !audit.ValidKind(k) {
				return exitf(ExitUsage, "--kind %q: want a kind (process.start) or a family (process)", k)
			}
			kinds = append(kinds, k)
		}
	}
	out := newEntryPrinter(w, d.json)
	if data, ok := f.local(d); ok {
		db, err := openTrail(data)
		if err != nil {
			return err
		}
		defer db.Close()
		team, err := teamIDOf(data, f.team)
		if err != nil {
			return err
		}
		q := audit.Filter{All: true, KeyID: f.keyID, TeamID: team, SandboxID: f.sandbox, Kinds: kinds, Since: since, Until: until}
		for n := 0; f.limit == 0 || n < f.limit; {
			q.Limit = 1000
			if f.limit > 0 {
				q.Limit = min(1000, f.limit-n)
			}
			es, err := db.Query(q)
			if err != nil {
				return exitf(ExitInternal, "%v", err)
			}
			for _, e := range es {
				out.print(api.EntryJSON(e))
			}
			n += len(es)
			if len(es) < q.Limit {
				break
			}
			q.After = es[len(es)-1].Seq
		}
		return out.flush()
	}
	if f.keyID != "" || f.team != "" {
		return exitf(ExitUsage, "--key-id and --team read the store on this host: add --data (a team's key reads its team's entries without them)")
	}
	return auditThroughAPI(ctx, d, f, out, kinds, since, until)
}

// auditThroughAPI pages through GET /audit.
func auditThroughAPI(ctx context.Context, d *daemonFlags, f *auditFlags, out *entryPrinter, kinds []string, since, until time.Time) error {
	c, err := d.client()
	if err != nil {
		return err
	}
	q := url.Values{}
	if f.sandbox != "" {
		q.Set("sandboxID", f.sandbox)
	}
	if len(kinds) > 0 {
		q.Set("kind", strings.Join(kinds, ","))
	}
	if !since.IsZero() {
		q.Set("since", since.Format(time.RFC3339Nano))
	}
	if !until.IsZero() {
		q.Set("until", until.Format(time.RFC3339Nano))
	}
	var dropped int64
	for n := 0; f.limit == 0 || n < f.limit; {
		limit := 1000
		if f.limit > 0 {
			limit = min(1000, f.limit-n)
		}
		q.Set("limit", strconv.Itoa(limit))
		page, err := c.AuditPage(ctx, q)
		if err != nil {
			return apiFailure(err)
		}
		for _, e := range page.Entries {
			out.print(e)
		}
		n += len(page.Entries)
		dropped = page.Dropped
		if page.NextToken == "" {
			break
		}
		q.Set("nextToken", page.NextToken)
	}
	if err := out.flush(); err != nil {
		return err
	}
	if dropped > 0 && !d.json {
		fmt.Fprintf(out.w, "(%d entries of sandbox %s were not kept: over the daemon's cap per sandbox)\n", dropped, f.sandbox)
	}
	return nil
}

// entryPrinter prints entries as a table or as JSON Lines.
type entryPrinter struct {
	w    io.Writer
	json *json.Encoder
	tw   *tabwriter.Writer
	rows int
}

func newEntryPrinter(w io.Writer, asJSON bool) *entryPrinter {
	p := &entryPrinter{w: w}
	if asJSON {
		p.json = json.NewEncoder(w)
	} else {
		p.tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(p.tw, "SEQ\tTIME\tKIND\tSOURCE\tKEY\tSANDBOX\tSTATUS\tWHAT")
	}
	return p
}

func (p *entryPrinter) print(e types.AuditEntry) {
	p.rows++
	if p.json != nil {
		_ = p.json.Encode(e)
		return
	}
	status := ""
	if e.Status != 0 {
		status = strconv.Itoa(e.Status)
	}
	// Routes, user names and details are what clients and sandboxes sent
	// (anyone's path to the proxy): escaped, they cannot drive the
	// terminal or forge a row.
	fmt.Fprintf(p.tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", e.Seq, e.Time.Local().Format("2006-01-02 15:04:05.000"), termSafe(e.Kind),
		termSafe(string(e.Source)), termSafe(dash(e.KeyID)), termSafe(dash(e.SandboxID)), status, termSafe(summary(e)))
}

func (p *entryPrinter) flush() error {
	if p.tw != nil {
		return p.tw.Flush()
	}
	return nil
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// summary is one line of what an entry says.
func summary(e types.AuditEntry) string {
	d := e.Detail
	s := ""
	switch {
	case e.Kind == audit.KindAPICall || e.Kind == audit.KindProxyDenied || e.Kind == audit.KindEnvdCall:
		s = e.Route
	case e.Kind == audit.KindProcessStart:
		b, _ := json.Marshal(d["argv"])
		s = string(b)
		if u, ok := d["user"].(string); ok {
			s += " as " + u
		}
	default:
		b, _ := json.Marshal(d)
		if len(d) > 0 {
			s = string(b)
		}
	}
	if len(s) > 160 {
		s = s[:157] + "..."
	}
	return s
}

func newAuditVerifyCmd(d *daemonFlags, f *auditFlags) *cobra.Command {
	var checks []string
	cmd := &cobra.Command{
		Use:   "verify",
		Short: "Check the audit trail's chain on this host; exit 1 and name the entries where it breaks",
		Long: `Check the whole chain of the daemon's audit trail (DATA/audit.db): every entry numbered
after the one before, carrying its hash, and hashing to its own; entries removed by
retention named by an anchor. It prints the head (SEQ:HASH): keep it elsewhere, and
pass it back later with --checkpoint to prove the chain was not rewritten or cut
short since (the chain alone cannot show a rewrite by root on this host).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var cps []audit.Checkpoint
			for _, c := range checks {
				cp, err := audit.ParseCheckpoint(c)
				if err != nil {
					return exitf(ExitUsage, "--checkpoint: %v", err)
				}
				cps = append(cps, cp)
			}
			data, _ := f.local(&daemonFlags{})
			db, err := openTrail(data)
			if err != nil {
				return err
			}
			defer db.Close()
			rep, err := db.Verify(cps...)
			if err != nil {
				return exitf(ExitInternal, "%v", err)
			}
			return printReport(cmd.OutOrStdout(), rep, db.Path(), d.json)
		},
	}
	cmd.Flags().StringArrayVar(&checks, "checkpoint", nil, "SEQ:HASH of a head printed earlier: it must still be in the chain (repeatable)")
	return cmd
}

func printReport(w io.Writer, rep *audit.Report, path string, asJSON bool) error {
	if asJSON {
		if err := printJSON(w, rep); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(w, "%s: %d entries, %d to %d", path, rep.Entries, rep.First, rep.Last)
		if rep.Pruned > 0 {
			fmt.Fprintf(w, " (1 to %d removed by retention, anchored)", rep.Pruned)
		}
		fmt.Fprintf(w, "\nhead %d:%s\n", rep.Last, rep.Head)
		for _, c := range rep.Checkpoints {
			fmt.Fprintln(w, c)
		}
		if rep.OK() {
			fmt.Fprintln(w, "OK: the chain holds")
		}
		for _, b := range rep.Breaks {
			fmt.Fprintf(w, "BROKEN at %s\n", b)
		}
	}
	if !rep.OK() {
		return exitf(ExitBroken, "the audit trail's chain is broken at entry %d: %s", rep.Breaks[0].Seq, rep.Breaks[0].Reason)
	}
	return nil
}

func newAuditHeadCmd(f *auditFlags) *cobra.Command {
	return &cobra.Command{
		Use:   "head",
		Short: "Print the audit trail's head, SEQ:HASH, to keep outside this host",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			data, _ := f.local(&daemonFlags{})
			db, err := openTrail(data)
			if err != nil {
				return err
			}
			defer db.Close()
			seq, h, err := db.Head()
			if err != nil {
				return exitf(ExitInternal, "%v", err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%d:%s\n", seq, h)
			return nil
		},
	}
}

// keyAudit records an API key change made on this host in the trail of
// the data directory, opened before the change (a change is never made
// where the trail cannot be opened).
type keyAudit struct{ db *audit.DB }

func openKeyAudit(data string) (*keyAudit, error) {
	db, err := audit.Open(data)
	if err != nil {
		return nil, exitf(ExitInternal, "open the audit trail in %s: %v", data, err)
	}
	return &keyAudit{db: db}, nil
}

// teamIDOf is a team's id from its name or id ("" for none): a name is
// looked up in the store of data.
func teamIDOf(data, ref string) (string, error) {
	if ref == "" || strings.HasPrefix(ref, store.TeamPrefix) {
		return ref, nil
	}
	st, err := store.Open(data)
	if err != nil {
		return "", exitf(ExitInternal, "open the store in %s: %v", data, err)
	}
	defer st.Close()
	t, err := st.GetTeam(ref)
	if err != nil {
		return "", exitf(ExitNotFoundObj, "no team %q", ref)
	}
	return t.ID, nil
}

func (k *keyAudit) record(kind, keyID string, detail map[string]any) error {
	defer k.db.Close()
	detail["by_uid"] = os.Getuid()
	if u := os.Getenv("SUDO_USER"); u != "" {
		detail["sudo_user"] = u
	}
	err := k.db.Append(audit.Event{Kind: kind, Source: audit.SourceCLI, KeyID: keyID, Detail: detail})
	if err != nil {
		return exitf(ExitInternal, "the key change was made but the audit trail did not record it: %v", errors.Unwrap(err))
	}
	return nil
}
