package cluster

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/cagehq/cage/internal/kube"
)

// RoleName names the roles and bindings ApplyRBAC makes; NodesGroup is the
// group every cage node's user belongs to.
const (
	RoleName   = "cage-node"
	NodesGroup = "cage:nodes"
)

var rw = []string{"get", "list", "watch", "create", "update", "patch", "delete"}

// Roles are what cage nodes may do, granted to NodesGroup: on the cluster,
// Nodes (their own registration and status, and the node lifecycle's
// taints on others); in kube-node-lease, the Leases; in the namespace
// ns, the sandbox pods, their status and events, the Secrets (the node
// key, the keys) and the lifecycle's Lease. Nothing else: no other
// namespace's pods or secrets, no bindings, no RBAC.
func Roles(ns string) (*rbacv1.ClusterRole, []*rbacv1.Role) {
	cr := &rbacv1.ClusterRole{ObjectMeta: meta(RoleName, ""), Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: rw},
		{APIGroups: []string{""}, Resources: []string{"nodes/status"}, Verbs: []string{"get", "update", "patch"}},
	}}
	leases := &rbacv1.Role{ObjectMeta: meta(RoleName, NodeLeaseNamespace), Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: rw},
	}}
	inNS := &rbacv1.Role{ObjectMeta: meta(RoleName, ns), Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: rw},
		{APIGroups: []string{""}, Resources: []string{"pods/status"}, Verbs: []string{"get", "update", "patch"}},
		{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "update", "patch"}},
		{APIGroups: []string{"events.k8s.io"}, Resources: []string{"events"}, Verbs: []string{"create", "update", "patch"}},
		{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"get", "list", "watch", "create", "update", "patch"}},
		{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: rw},
	}}
	return cr, []*rbacv1.Role{leases, inNS}
}

func meta(name, ns string) metav1.ObjectMeta {
	return metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{LabelManagedBy: "cage"}}
}

func subjects() []rbacv1.Subject {
	return []rbacv1.Subject{{Kind: rbacv1.GroupKind, APIGroup: rbacv1.GroupName, Name: NodesGroup}}
}

// ApplyRBAC creates or updates the namespace ns (DefaultNamespace when
// none is given), Roles' roles and their bindings to NodesGroup (an
// administrator's client: it grants rights).
func ApplyRBAC(ctx context.Context, c *kube.Client, namespace ...string) error {
	ns := DefaultNamespace
	if len(namespace) > 0 {
		ns = namespace[0]
	}
	for _, name := range []string{ns, NodeLeaseNamespace} {
		_, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
		if err != nil && !kube.IsAlreadyExists(err) {
			return fmt.Errorf("rbac: namespace %s: %w", name, err)
		}
	}
	cr, roles := Roles(ns)
	rb := c.RbacV1()
	if err := upsert(ctx, func() error { _, err := rb.ClusterRoles().Create(ctx, cr, metav1.CreateOptions{}); return err },
		func() error { _, err := rb.ClusterRoles().Update(ctx, cr, metav1.UpdateOptions{}); return err }); err != nil {
		return fmt.Errorf("rbac: clusterrole %s: %w", cr.Name, err)
	}
	crb := &rbacv1.ClusterRoleBinding{ObjectMeta: meta(RoleName, ""), Subjects: subjects(),
		RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: RoleName}}
	if err := upsert(ctx, func() error { _, err := rb.ClusterRoleBindings().Create(ctx, crb, metav1.CreateOptions{}); return err },
		func() error { _, err := rb.ClusterRoleBindings().Update(ctx, crb, metav1.UpdateOptions{}); return err }); err != nil {
		return fmt.Errorf("rbac: clusterrolebinding %s: %w", crb.Name, err)
	}
	for _, r := range roles {
		r := r
		if err := upsert(ctx, func() error { _, err := rb.Roles(r.Namespace).Create(ctx, r, metav1.CreateOptions{}); return err },
			func() error { _, err := rb.Roles(r.Namespace).Update(ctx, r, metav1.UpdateOptions{}); return err }); err != nil {
			return fmt.Errorf("rbac: role %s/%s: %w", r.Namespace, r.Name, err)
		}
		b := &rbacv1.RoleBinding{ObjectMeta: meta(RoleName, r.Namespace), Subjects: subjects(),
			RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: RoleName}}
		if err := upsert(ctx, func() error {
			_, err := rb.RoleBindings(r.Namespace).Create(ctx, b, metav1.CreateOptions{})
			return err
		},
			func() error {
				_, err := rb.RoleBindings(r.Namespace).Update(ctx, b, metav1.UpdateOptions{})
				return err
			}); err != nil {
			return fmt.Errorf("rbac: rolebinding %s/%s: %w", r.Namespace, r.Name, err)
		}
	}
	return nil
}

// upsert creates, or updates what exists.
func upsert(ctx context.Context, create, update func() error) error {
	err := create()
	if kube.IsAlreadyExists(err) {
		err = update()
	}
	return err
}

// RBACYAML is Roles' roles and bindings as YAML documents, for operators
// who apply RBAC themselves (cage cluster rbac).
func RBACYAML(ns string) ([]byte, error) {
	cr, roles := Roles(ns)
	cr.TypeMeta = metav1.TypeMeta{APIVersion: "rbac.authorization.k8s.io/v1", Kind: "ClusterRole"}
	objs := []any{cr, &rbacv1.ClusterRoleBinding{TypeMeta: metav1.TypeMeta{APIVersion: "rbac.authorization.k8s.io/v1", Kind: "ClusterRoleBinding"},
		ObjectMeta: meta(RoleName, ""), Subjects: subjects(), RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: RoleName}}}
	for _, r := range roles {
		r.TypeMeta = metav1.TypeMeta{APIVersion: "rbac.authorization.k8s.io/v1", Kind: "Role"}
		objs = append(objs, r, &rbacv1.RoleBinding{TypeMeta: metav1.TypeMeta{APIVersion: "rbac.authorization.k8s.io/v1", Kind: "RoleBinding"},
			ObjectMeta: meta(RoleName, r.Namespace), Subjects: subjects(), RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: RoleName}})
	}
	var out []byte
	for i, o := range objs {
		b, err := yaml.Marshal(o)
		if err != nil {
			return nil, err
		}
		if i > 0 {
			out = append(out, "---\n"...)
		}
		out = append(out, b...)
	}
	return out, nil
}
