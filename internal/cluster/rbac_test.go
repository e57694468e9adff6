package cluster

import (
	"slices"
	"strings"
	"testing"
)

// TestRolesLeastPrivilege: the nodes' rights name their resources (no
// wildcard), stay in the namespace for pods and secrets, never delete a
// Secret and never touch RBAC.
func TestRolesLeastPrivilege(t *testing.T) {
	cr, roles := Roles("ns1")
	for _, r := range cr.Rules {
		for _, res := range r.Resources {
			if res != "nodes" && res != "nodes/status" {
				t.Errorf("cluster-wide right on %s", res)
			}
		}
	}
	for _, role := range roles {
		if role.Namespace != "ns1" && role.Namespace != NodeLeaseNamespace {
			t.Errorf("role in %s", role.Namespace)
		}
		for _, r := range role.Rules {
			if slices.Contains(r.Verbs, "*") || slices.Contains(r.Resources, "*") || slices.Contains(r.APIGroups, "*") {
				t.Errorf("wildcard rule %+v", r)
			}
			if slices.Contains(r.Resources, "secrets") && slices.Contains(r.Verbs, "delete") {
				t.Error("nodes may delete secrets")
			}
			for _, g := range r.APIGroups {
				if strings.Contains(g, "rbac") {
					t.Errorf("rule on %s", g)
				}
			}
			if role.Namespace == NodeLeaseNamespace && !slices.Equal(r.Resources, []string{"leases"}) {
				t.Errorf("in %s: %v", NodeLeaseNamespace, r.Resources)
			}
		}
	}
	y, err := RBACYAML("ns1")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"kind: ClusterRole\n", "kind: ClusterRoleBinding\n", "kind: Role\n", "kind: RoleBinding\n",
		"name: " + NodesGroup, "namespace: ns1", "namespace: " + NodeLeaseNamespace} {
		if !strings.Contains(string(y), want) {
			t.Errorf("RBACYAML lacks %q:\n%s", want, y)
		}
	}
}
