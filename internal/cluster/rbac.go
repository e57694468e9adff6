package cluster

import (
	"context"
	"fmt"

	admissionv1 "k8s.io/api/admissionregistration/v1"
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
// ns, the sandbox pods, their status and events, reading the Secrets of
// the node key and the keys (and making the first, Policy allowing no
// other create), and the lifecycle's Lease. Nothing else: no other
// namespace's pods or secrets, no other Secret, no write of the keys, no
// bindings, no RBAC.
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
		// The two Secrets a node reads (the keys by its informer's field
		// selector, which RBAC authorizes by name), and a create, which
		// RBAC cannot name: Policy lets a node make cage-cluster only.
		// Nothing updates them: the keys are written with an
		// administrator's kubeconfig (cage keys --kubeconfig).
		{APIGroups: []string{""}, Resources: []string{"secrets"}, ResourceNames: []string{KeySecret, KeysSecret},
			Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"create"}},
		{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: rw},
	}}
	return cr, []*rbacv1.Role{leases, inNS}
}

// NodeUserPrefix begins every cage node's user name: cage:node:NAME, for
// the node NAME (its Node object and its Lease), as kubelets are
// system:node:NAME.
const NodeUserPrefix = "cage:node:"

// Policy is the admission policy that narrows what RBAC cannot: RBAC gives
// group cage:nodes every Node and every Lease of kube-node-lease (a node
// registers its own, and the lifecycle's leader taints others), and so
// one node's credentials could rewrite another node's addresses (and have
// every front send that node's clients, their API keys and tokens, to
// it), or taint, rewrite or delete the Nodes and Leases of kubelets in a
// shared cluster. Under it, a request of group cage:nodes:
//   - changes only Nodes labelled cage.dev/node=true (before and after);
//   - creates, deletes, relabels or re-annotates only its own Node (user
//     cage:node:NAME for the Node NAME): another's it may only taint and
//     mark (spec and status);
//   - writes only its own Lease in kube-node-lease;
//   - creates no Secret but cage-cluster (the node key, when there is
//     none) and changes or deletes none: the keys Secret is written with
//     an administrator's kubeconfig only. A node that could write it
//     minted an admin key every node imported (found by review,
//     2026-12-04).
func Policy() (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
	fail := admissionv1.Fail
	ops := []admissionv1.OperationType{admissionv1.Create, admissionv1.Update, admissionv1.Delete}
	rule := func(group string, resources ...string) admissionv1.NamedRuleWithOperations {
		return admissionv1.NamedRuleWithOperations{RuleWithOperations: admissionv1.RuleWithOperations{Operations: ops,
			Rule: admissionv1.Rule{APIGroups: []string{group}, APIVersions: []string{"v1"}, Resources: resources}}}
	}
	const (
		it       = "(request.operation == 'DELETE' ? oldObject : object)"
		isNode   = "request.resource.resource == 'nodes'"
		isLease  = "request.resource.resource == 'leases'"
		isSecret = "request.resource.resource == 'secrets'"
		own      = "request.userInfo.username == '" + NodeUserPrefix + "' + " + it + ".metadata.name"
		labelled = "(has(%[1]s.metadata.labels) && '" + NodeLabel + "' in %[1]s.metadata.labels && %[1]s.metadata.labels['" + NodeLabel + "'] == 'true')"
	)
	cageNode := fmt.Sprintf(labelled, it) + " && (request.operation != 'UPDATE' || " + fmt.Sprintf(labelled, "oldObject") + ")"
	sameMeta := "request.operation == 'UPDATE' && " +
		"(has(object.metadata.labels) ? object.metadata.labels : {}) == (has(oldObject.metadata.labels) ? oldObject.metadata.labels : {}) && " +
		"(has(object.metadata.annotations) ? object.metadata.annotations : {}) == (has(oldObject.metadata.annotations) ? oldObject.metadata.annotations : {})"
	p := &admissionv1.ValidatingAdmissionPolicy{ObjectMeta: meta(RoleName, ""), Spec: admissionv1.ValidatingAdmissionPolicySpec{
		FailurePolicy: &fail,
		MatchConstraints: &admissionv1.MatchResources{ResourceRules: []admissionv1.NamedRuleWithOperations{
			rule("", "nodes", "nodes/status"), rule("coordination.k8s.io", "leases"), rule("", "secrets")}},
		MatchConditions: []admissionv1.MatchCondition{{Name: "cage-nodes", Expression: "'" + NodesGroup + "' in request.userInfo.groups"}},
		Validations: []admissionv1.Validation{
			{Expression: "!(" + isNode + ") || (" + cageNode + ")",
				Message: "a cage node may change only cage Nodes (label " + NodeLabel + "=true)"},
			{Expression: "!(" + isNode + ") || " + own + " || (" + sameMeta + ")",
				Message: "a cage node may create, delete, relabel or re-annotate only its own Node (user " + NodeUserPrefix + "NAME); another's it may only taint and mark"},
			{Expression: "!(" + isLease + ") || request.namespace != '" + NodeLeaseNamespace + "' || " + own,
				Message: "a cage node may write only its own Lease in " + NodeLeaseNamespace},
			{Expression: "!(" + isSecret + ") || (request.operation == 'CREATE' && object.metadata.name == '" + KeySecret + "')",
				Message: "a cage node may create the Secret " + KeySecret + " only, and change or delete no Secret"},
		},
	}}
	b := &admissionv1.ValidatingAdmissionPolicyBinding{ObjectMeta: meta(RoleName, ""), Spec: admissionv1.ValidatingAdmissionPolicyBindingSpec{
		PolicyName: RoleName, ValidationActions: []admissionv1.ValidationAction{admissionv1.Deny}}}
	return p, b
}

// KubeletPolicyName names the policy that keeps kubelets out of cage's
// labels and annotations; KubeletGroup is their group.
const (
	KubeletPolicyName = "cage-kubelet"
	KubeletGroup      = "system:nodes"
)

// KubeletPolicy is the admission policy that keeps the kubelets of a
// shared cluster's other nodes from passing their Node off as a cage
// node. A kubelet may change its own Node's labels and annotations (the
// NodeRestriction plugin reserves only kubernetes.io and k8s.io ones): one
// that labelled its Node cage.dev/node=true and cage.dev/wall-W=true and
// annotated it with a cage.dev/api address of its choosing was, to every
// front, a live cage node (its Lease is the kubelet's own): the scheduler
// gave it sandbox pods (their create's env included), fronts sent it
// their starts and forwarded it clients' requests with their API keys
// (found by review, 2026-12-04). Under it, a request of group
// system:nodes neither makes, changes nor removes a label or annotation
// under cage.dev/ on a Node.
func KubeletPolicy() (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding) {
	fail := admissionv1.Fail
	const (
		newObj = "(has(object.metadata.%[1]s) ? object.metadata.%[1]s : {})"
		oldObj = "(oldObject == null ? {} : has(oldObject.metadata.%[1]s) ? oldObject.metadata.%[1]s : {})"
		same   = "variables.new%[1]s.all(k, !k.startsWith('cage.dev/') || (k in variables.old%[1]s && variables.old%[1]s[k] == variables.new%[1]s[k])) && " +
			"variables.old%[1]s.all(k, !k.startsWith('cage.dev/') || k in variables.new%[1]s)"
	)
	var vars []admissionv1.Variable
	for _, f := range []string{"labels", "annotations"} {
		vars = append(vars, admissionv1.Variable{Name: "new" + f, Expression: fmt.Sprintf(newObj, f)},
			admissionv1.Variable{Name: "old" + f, Expression: fmt.Sprintf(oldObj, f)})
	}
	p := &admissionv1.ValidatingAdmissionPolicy{ObjectMeta: meta(KubeletPolicyName, ""), Spec: admissionv1.ValidatingAdmissionPolicySpec{
		FailurePolicy: &fail,
		MatchConstraints: &admissionv1.MatchResources{ResourceRules: []admissionv1.NamedRuleWithOperations{{
			RuleWithOperations: admissionv1.RuleWithOperations{
				Operations: []admissionv1.OperationType{admissionv1.Create, admissionv1.Update},
				Rule:       admissionv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"nodes", "nodes/status"}}}}}},
		MatchConditions: []admissionv1.MatchCondition{{Name: "kubelets", Expression: "'" + KubeletGroup + "' in request.userInfo.groups"}},
		Variables:       vars,
		Validations: []admissionv1.Validation{
			{Expression: fmt.Sprintf(same, "labels"), Message: "a kubelet may not set, change or remove cage.dev/ labels of a Node"},
			{Expression: fmt.Sprintf(same, "annotations"), Message: "a kubelet may not set, change or remove cage.dev/ annotations of a Node"},
		},
	}}
	b := &admissionv1.ValidatingAdmissionPolicyBinding{ObjectMeta: meta(KubeletPolicyName, ""), Spec: admissionv1.ValidatingAdmissionPolicyBindingSpec{
		PolicyName: KubeletPolicyName, ValidationActions: []admissionv1.ValidationAction{admissionv1.Deny}}}
	return p, b
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
	adm := c.AdmissionregistrationV1()
	for _, policy := range []func() (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding){Policy, KubeletPolicy} {
		p, pb := policy()
		if err := upsertVersioned(ctx, adm.ValidatingAdmissionPolicies(), p); err != nil {
			return fmt.Errorf("rbac: validating admission policy %s: %w", p.Name, err)
		}
		if err := upsertVersioned(ctx, adm.ValidatingAdmissionPolicyBindings(), pb); err != nil {
			return fmt.Errorf("rbac: validating admission policy binding %s: %w", pb.Name, err)
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

// upsertVersioned creates obj in r, or updates the one that exists (whose
// resource version an update of these resources must name).
func upsertVersioned[T, L any, P interface {
	*T
	metav1.Object
}](ctx context.Context, r kube.Resource[T, L], obj P) error {
	return upsert(ctx, func() error { _, err := r.Create(ctx, obj, metav1.CreateOptions{}); return err }, func() error {
		cur, err := r.Get(ctx, obj.GetName(), metav1.GetOptions{})
		if err != nil {
			return err
		}
		obj.SetResourceVersion(P(cur).GetResourceVersion())
		_, err = r.Update(ctx, obj, metav1.UpdateOptions{})
		return err
	})
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
	for _, policy := range []func() (*admissionv1.ValidatingAdmissionPolicy, *admissionv1.ValidatingAdmissionPolicyBinding){Policy, KubeletPolicy} {
		p, pb := policy()
		p.TypeMeta = metav1.TypeMeta{APIVersion: "admissionregistration.k8s.io/v1", Kind: "ValidatingAdmissionPolicy"}
		pb.TypeMeta = metav1.TypeMeta{APIVersion: "admissionregistration.k8s.io/v1", Kind: "ValidatingAdmissionPolicyBinding"}
		objs = append(objs, p, pb)
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
