package cli

import (
	"github.com/spf13/cobra"

	"github.com/cagehq/cage/internal/cluster"
)

// newClusterCmd is `cage cluster`: what an operator needs to set a
// cluster up (docs: README's "Cluster").
func newClusterCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "cluster", Short: "Cluster mode: the RBAC the nodes need"}
	var ns string
	rbac := &cobra.Command{
		Use:   "rbac",
		Short: "Print the RBAC objects (YAML) that let group cage:nodes run cage nodes, for kubectl apply -f -",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			b, err := cluster.RBACYAML(ns)
			if err != nil {
				return err
			}
			_, err = cmd.OutOrStdout().Write(b)
			return err
		},
	}
	rbac.Flags().StringVar(&ns, "namespace", cluster.DefaultNamespace, "the cluster's namespace")
	cmd.AddCommand(rbac)
	return cmd
}
