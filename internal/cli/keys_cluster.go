package cli

import (
	"context"
	"errors"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/cagehq/cage/internal/cluster"
	"github.com/cagehq/cage/internal/kube"
)

// clusterKeys are cage keys' flags for a cluster's keys: with a
// kubeconfig they go to the Secret every node syncs (cluster.KeysSecret)
// instead of this host's store.
type clusterKeys struct {
	kubeconfig, namespace string
}

func (ck *clusterKeys) flags(cmd *cobra.Command) {
	cmd.PersistentFlags().StringVar(&ck.kubeconfig, "kubeconfig", "", "manage the cluster's keys (the Secret "+cluster.KeysSecret+" every node syncs) through this kubeconfig (default $CAGE_KUBECONFIG; none: this host's store)")
	cmd.PersistentFlags().StringVar(&ck.namespace, "namespace", cluster.DefaultNamespace, "the cluster's namespace")
}

// on says whether the cluster's keys are meant.
func (ck *clusterKeys) on() bool {
	if ck.kubeconfig == "" {
		ck.kubeconfig = envOr("CAGE_KUBECONFIG", "")
	}
	return ck.kubeconfig != ""
}

func (ck *clusterKeys) client() (*kube.Client, error) {
	c, err := (&cluster.Config{Kubeconfig: ck.kubeconfig, NodeName: "cli"}).Client()
	if err != nil {
		return nil, exitf(ExitUsage, "%v", err)
	}
	return c, nil
}

func (ck *clusterKeys) create(cmd *cobra.Command, name, team string, admin, asJSON bool) error {
	if team != "" {
		return exitf(ExitUsage, "--team with --kubeconfig: teams are each node's own; a cluster key has no team")
	}
	c, err := ck.client()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(cmd.Context(), time.Minute)
	defer cancel()
	plain, k, err := cluster.CreateKey(ctx, c, ck.namespace, name, admin)
	if err != nil {
		return exitf(ExitUnavailable, "%v", err)
	}
	if asJSON {
		return printJSON(cmd.OutOrStdout(), map[string]any{"id": k.ID, "name": k.Name, "key": plain, "admin": k.Admin})
	}
	fmt.Fprintf(cmd.ErrOrStderr(), "created cluster API key %s (%s) in Secret %s/%s; it is shown once:\n",
		k.ID, k.Name, ck.namespace, cluster.KeysSecret)
	fmt.Fprintln(cmd.OutOrStdout(), plain)
	return nil
}

func (ck *clusterKeys) list(cmd *cobra.Command, asJSON bool) error {
	c, err := ck.client()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(cmd.Context(), time.Minute)
	defer cancel()
	keys, err := cluster.ListKeys(ctx, c, ck.namespace)
	if err != nil {
		return exitf(ExitUnavailable, "%v", err)
	}
	if asJSON {
		type keyJSON struct {
			ID        string     `json:"id"`
			Name      string     `json:"name"`
			Prefix    string     `json:"prefix"`
			CreatedAt time.Time  `json:"createdAt"`
			RevokedAt *time.Time `json:"revokedAt,omitempty"`
			Admin     bool       `json:"admin,omitempty"`
		}
		out := []keyJSON{}
		for _, k := range keys {
			j := keyJSON{ID: k.ID, Name: k.Name, Prefix: k.Prefix, CreatedAt: time.Unix(0, k.Created).UTC(), Admin: k.Admin}
			if k.Revoked != 0 {
				r := time.Unix(0, k.Revoked).UTC()
				j.RevokedAt = &r
			}
			out = append(out, j)
		}
		return printJSON(cmd.OutOrStdout(), out)
	}
	tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tNAME\tKEY\tCREATED\tSTATUS")
	for _, k := range keys {
		status := "active"
		if k.Revoked != 0 {
			status = "revoked " + time.Unix(0, k.Revoked).UTC().Format(time.RFC3339)
		}
		if k.Admin {
			status += ", admin"
		}
		fmt.Fprintf(tw, "%s\t%s\te2b_%s…\t%s\t%s\n", k.ID, k.Name, k.Prefix, time.Unix(0, k.Created).UTC().Format(time.RFC3339), status)
	}
	return tw.Flush()
}

func (ck *clusterKeys) revoke(cmd *cobra.Command, idOrPrefix string) error {
	c, err := ck.client()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(cmd.Context(), time.Minute)
	defer cancel()
	k, err := cluster.RevokeKey(ctx, c, ck.namespace, idOrPrefix)
	if errors.Is(err, cluster.ErrNoKey) {
		return exitf(ExitUsage, "no API key %q in the cluster", idOrPrefix)
	}
	if err != nil {
		return exitf(ExitUnavailable, "%v", err)
	}
	fmt.Fprintf(cmd.OutOrStdout(), "revoked %s in the cluster\n", k.ID)
	return nil
}
