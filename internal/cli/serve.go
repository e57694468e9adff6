package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/cagehq/cage/internal/audit"
	"github.com/cagehq/cage/internal/daemon"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
)

func newServeCmd(g *globals) *cobra.Command {
	cfg := daemon.Defaults()
	var configFile, maxTimeout string
	var poolsOf []string
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the daemon: E2B-compatible API and sandbox proxy",
		Long: `Run the daemon in the foreground. Settings come from flags, then the
environment (CAGE_API, CAGE_PROXY, CAGE_DATA, CAGE_TEMPLATES, CAGE_DOMAIN, CAGE_CONFIG,
CAGE_DIFY, CAGE_DIFY_KEY, CAGE_METRICS, CAGE_KUBECONFIG, CAGE_NODE_NAME), then the JSON config file, then defaults. Sandboxes
outlive the daemon: the next start adopts those still running and removes what
a crash left behind.

Point an E2B SDK at it with E2B_API_URL=http://API and E2B_SANDBOX_URL=http://PROXY
and E2B_API_KEY set to a key from 'cage keys create'. With --tls-cert/--tls-key or
--tls-self-signed the proxy speaks TLS (E2B_SANDBOX_URL=https://PROXY), as the
https://{port}-{sandbox}.{domain} URLs the SDKs build (@e2b/desktop's stream) need. Point Dify at --dify ADDR with
CODE_EXECUTION_ENDPOINT=http://ADDR and CODE_EXECUTION_API_KEY set to the config's dify.key.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			final := daemon.Defaults()
			if configFile == "" {
				configFile = os.Getenv("CAGE_CONFIG")
			}
			if configFile != "" {
				if err := daemon.LoadFile(configFile, &final); err != nil {
					return exitf(ExitUsage, "%v", err)
				}
			}
			for env, dst := range map[string]*string{"CAGE_API": &final.API, "CAGE_PROXY": &final.Proxy,
				"CAGE_DATA": &final.Data, "CAGE_DOMAIN": &final.Domain, "CAGE_TEMPLATES": &final.Templates,
				"CAGE_DIFY": &final.Dify.Addr, "CAGE_DIFY_KEY": &final.Dify.Key, "CAGE_METRICS": &final.Metrics.Addr,
				"CAGE_KUBECONFIG": &final.Cluster.Kubeconfig, "CAGE_NODE_NAME": &final.Cluster.NodeName} {
				if v := os.Getenv(env); v != "" {
					*dst = v
				}
			}
			fl := cmd.Flags()
			if fl.Changed("api") {
				final.API = cfg.API
			}
			if fl.Changed("proxy") {
				final.Proxy = cfg.Proxy
			}
			if fl.Changed("data") {
				final.Data = cfg.Data
			}
			if fl.Changed("domain") {
				final.Domain = cfg.Domain
			}
			if fl.Changed("dify") {
				final.Dify.Addr = cfg.Dify.Addr
			}
			if fl.Changed("wall") {
				final.DefaultWall = cfg.DefaultWall
			}
			if fl.Changed("metrics") {
				final.Metrics.Addr = cfg.Metrics.Addr
			}
			if fl.Changed("metrics-token-file") {
				final.Metrics.TokenFile = cfg.Metrics.TokenFile
			}
			if fl.Changed("tls-cert") || fl.Changed("tls-key") || fl.Changed("tls-self-signed") {
				final.TLS = cfg.TLS
			}
			if fl.Changed("pool") {
				final.Pool = cfg.Pool
			}
			if fl.Changed("pool-grow") {
				final.PoolGrow = cfg.PoolGrow
			}
			if fl.Changed("kubeconfig") {
				final.Cluster.Kubeconfig = cfg.Cluster.Kubeconfig
			}
			if fl.Changed("node-name") {
				final.Cluster.NodeName = cfg.Cluster.NodeName
			}
			if fl.Changed("advertise") {
				final.Cluster.Advertise = cfg.Cluster.Advertise
			}
			for _, kv := range poolsOf {
				name, n, err := templateCount(kv)
				if err != nil {
					return exitf(ExitUsage, "--pool-of %q: %v", kv, err)
				}
				if final.Pools == nil {
					final.Pools = map[string]int{}
				}
				final.Pools[name] = n
			}
			if fl.Changed("max-sandboxes") {
				final.MaxSandboxes = cfg.MaxSandboxes
			}
			if fl.Changed("max-timeout") {
				d, err := time.ParseDuration(maxTimeout)
				if err != nil || d <= 0 {
					return exitf(ExitUsage, "--max-timeout %q: want a duration such as 1h", maxTimeout)
				}
				final.MaxTimeout = daemon.Duration(d)
			}
			if cmd.Root().PersistentFlags().Changed("run-dir") || os.Getenv("CAGE_RUN_DIR") != "" {
				final.RunDir = g.runDir
			}
			if err := daemon.CheckPoolGrow(final.PoolGrow); err != nil {
				return exitf(ExitUsage, "%v", err)
			}
			if err := daemon.CheckTLS(final); err != nil {
				return exitf(ExitUsage, "%v", err)
			}
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			return daemon.Run(ctx, final, g.log, nil)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&configFile, "config", "", "JSON config file")
	fl.StringVar(&cfg.API, "api", cfg.API, "control API address")
	fl.StringVar(&cfg.Proxy, "proxy", cfg.Proxy, "sandbox traffic address")
	fl.StringVar(&cfg.Data, "data", cfg.Data, "state directory")
	fl.StringVar(&cfg.Domain, "domain", "", "domain of {port}-{sandboxID}.{domain} hosts")
	fl.StringVar(&cfg.Dify.Addr, "dify", "", "address of Dify's sandbox API (e.g. 127.0.0.1:8194; off by default; its key: config dify.key or CAGE_DIFY_KEY)")
	fl.StringVar(&cfg.Metrics.Addr, "metrics", "", "address of Prometheus's /metrics, a listener of its own (off by default; off loopback it needs --metrics-token-file)")
	fl.StringVar(&cfg.Metrics.TokenFile, "metrics-token-file", "", "a file holding the bearer token /metrics asks for (Prometheus's credentials_file)")
	fl.StringVar(&cfg.TLS.Cert, "tls-cert", "", "the proxy serves TLS with this certificate (PEM, for the domain and *.domain)")
	fl.StringVar(&cfg.TLS.Key, "tls-key", "", "the key of --tls-cert (PEM; refused if others may read it)")
	fl.BoolVar(&cfg.TLS.SelfSigned, "tls-self-signed", false, "the proxy serves TLS with a certificate signed by a local CA kept in DATA/tls (printed at the start; needs --domain)")
	fl.IntVar(&cfg.Pool, "pool", cfg.Pool, "prepared sandboxes kept ready (on the default wall)")
	fl.IntVar(&cfg.PoolGrow, "pool-grow", cfg.PoolGrow, "every pool keeps up to this many times its size while creates find it empty, back to its size after a minute without creates (1: fixed size)")
	fl.StringArrayVar(&poolsOf, "pool-of", nil, "[WALL/]TEMPLATE=N: keep N sandboxes of TEMPLATE ready too, on WALL (default: the default wall), started if it has a start command (repeatable)")
	fl.StringVar(&cfg.DefaultWall, "wall", cfg.DefaultWall, "wall of a create that names none: process, runc, gvisor")
	fl.IntVar(&cfg.MaxSandboxes, "max-sandboxes", 0, "sandboxes alive at once (0: one per 8 MiB of the host's RAM, at least 16); beyond it creates get 429")
	fl.StringVar(&maxTimeout, "max-timeout", "24h", "longest timeout a sandbox may ask for")
	fl.StringVar(&cfg.Cluster.Kubeconfig, "kubeconfig", "", "join the Kubernetes cluster of this kubeconfig as a node (cluster mode; also CAGE_KUBECONFIG, config cluster.kubeconfig)")
	fl.StringVar(&cfg.Cluster.NodeName, "node-name", "", "this node's name in the cluster (default: the host name; also CAGE_NODE_NAME)")
	fl.StringVar(&cfg.Cluster.Advertise, "advertise", "", "the IP address other nodes reach this node's --api and --proxy at (default: the API's address, else the first non-loopback IPv4)")
	return cmd
}

// templateCount reads TEMPLATE=N.
func templateCount(kv string) (string, int, error) {
	name, v, ok := strings.Cut(kv, "=")
	n, err := strconv.Atoi(v)
	if !ok || name == "" || err != nil || n < 0 || n > 1000 {
		return "", 0, errors.New("want [WALL/]TEMPLATE=N with N from 0 to 1000")
	}
	if err := sandbox.CheckPool(name); err != nil {
		return "", 0, err
	}
	return name, n, nil
}

// openStore opens the store in *data (CAGE_DATA or /var/lib/cage when
// empty, which it sets), for the commands that manage keys and teams.
func openStore(data *string) (*store.Store, error) {
	if *data == "" {
		*data = envOr("CAGE_DATA", "/var/lib/cage")
	}
	st, err := store.Open(*data)
	if err != nil {
		return nil, exitf(ExitInternal, "open the store in %s: %v", *data, err)
	}
	return st, nil
}

func newKeysCmd(g *globals) *cobra.Command {
	var data string
	var asJSON bool
	open := func() (*store.Store, error) { return openStore(&data) }
	cmd := &cobra.Command{Use: "keys", Short: "Manage API keys (create | ls | revoke)"}
	cmd.PersistentFlags().StringVar(&data, "data", "", "the daemon's state directory (default $CAGE_DATA or /var/lib/cage)")
	var ck clusterKeys
	ck.flags(cmd)
	var name, team string
	var admin bool
	create := &cobra.Command{
		Use:   "create",
		Short: "Create an API key (in a team, or an admin key); the key alone is printed on the last line",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if admin && team != "" {
				return exitf(ExitUsage, "an admin key belongs to no team: --admin and --team are not given together")
			}
			if ck.on() {
				return ck.create(cmd, name, team, admin, asJSON)
			}
			st, err := open()
			if err != nil {
				return err
			}
			defer st.Close()
			ka, err := openKeyAudit(data)
			if err != nil {
				return err
			}
			opts := store.KeyOptions{Name: name, Admin: admin}
			if team != "" {
				t, err := st.GetTeam(team)
				if err != nil {
					ka.db.Close()
					if errors.Is(err, store.ErrNotFound) {
						return exitf(ExitNotFoundObj, "no team %q (cage teams create %s)", team, team)
					}
					return err
				}
				opts.TeamID = t.ID
			}
			plain, k, err := st.CreateKeyWith(opts)
			if err != nil {
				ka.db.Close()
				return err
			}
			if err := ka.record(audit.KindKeyCreate, k.ID, map[string]any{"name": k.Name, "prefix": k.Prefix,
				"team": k.TeamID, "admin": k.Admin}); err != nil {
				return err
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), map[string]any{"id": k.ID, "name": k.Name, "key": plain, "team": k.TeamID, "admin": k.Admin})
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "created API key %s (%s); it is shown once:\n", k.ID, k.Name)
			fmt.Fprintln(cmd.OutOrStdout(), plain)
			return nil
		},
	}
	create.Flags().StringVar(&name, "name", "", "a name to recognise the key by")
	create.Flags().StringVar(&team, "team", "", "the team (name or id) the key belongs to: it shares the team's sandboxes, snapshots, volumes, audit entries and quotas (fixed; default none: the key is a team of its own)")
	create.Flags().BoolVar(&admin, "admin", false, "an admin key: it also manages teams and keys through the API (/admin/...)")
	ls := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List API keys",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if ck.on() {
				return ck.list(cmd, asJSON)
			}
			st, err := open()
			if err != nil {
				return err
			}
			defer st.Close()
			keys, err := st.ListKeys()
			if err != nil {
				return err
			}
			if asJSON {
				type keyJSON struct {
					ID        string     `json:"id"`
					Name      string     `json:"name"`
					Prefix    string     `json:"prefix"`
					CreatedAt time.Time  `json:"createdAt"`
					RevokedAt *time.Time `json:"revokedAt,omitempty"`
					LastUsed  *time.Time `json:"lastUsed,omitempty"`
					TeamID    string     `json:"teamID,omitempty"`
					Admin     bool       `json:"admin,omitempty"`
				}
				out := []keyJSON{}
				for _, k := range keys {
					out = append(out, keyJSON{k.ID, k.Name, k.Prefix, k.CreatedAt, k.RevokedAt, k.LastUsed, k.TeamID, k.Admin})
				}
				return printJSON(cmd.OutOrStdout(), out)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tNAME\tKEY\tTEAM\tCREATED\tSTATUS")
			for _, k := range keys {
				status := "active"
				if k.RevokedAt != nil {
					status = "revoked " + k.RevokedAt.Format(time.RFC3339)
				}
				if k.Admin {
					status += ", admin"
				}
				team := k.TeamID
				if team == "" {
					team = "-"
				}
				fmt.Fprintf(tw, "%s\t%s\te2b_%s…\t%s\t%s\t%s\n", k.ID, termSafe(k.Name), k.Prefix, termSafe(team), k.CreatedAt.Format(time.RFC3339), status)
			}
			return tw.Flush()
		},
	}
	revoke := &cobra.Command{
		Use:     "revoke ID",
		Aliases: []string{"delete"},
		Short:   "Revoke an API key (by id or prefix)",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if ck.on() {
				return ck.revoke(cmd, args[0])
			}
			st, err := open()
			if err != nil {
				return err
			}
			defer st.Close()
			ka, err := openKeyAudit(data)
			if err != nil {
				return err
			}
			k, err := st.RevokeKey(args[0])
			if err != nil {
				ka.db.Close()
			}
			if errors.Is(err, store.ErrNotFound) {
				return exitf(ExitUsage, "no API key %q", args[0])
			}
			if err != nil {
				return err
			}
			if err := ka.record(audit.KindKeyRevoke, k.ID, map[string]any{"name": k.Name, "prefix": k.Prefix}); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "revoked %s\n", k.ID)
			return nil
		},
	}
	cmd.PersistentFlags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.AddCommand(create, ls, revoke)
	return cmd
}

func printJSON(w io.Writer, v any) error {
	enc := jsonEncoder(w)
	return enc.Encode(v)
}
