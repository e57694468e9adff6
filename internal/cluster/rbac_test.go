package cluster

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/cagehq/cage/internal/kube"
	"github.com/cagehq/cage/internal/store"
	"github.com/cagehq/cage/internal/testutil/kubeplane"
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
		"name: " + NodesGroup, "namespace: ns1", "namespace: " + NodeLeaseNamespace, "name: " + KubeletPolicyName} {
		if !strings.Contains(string(y), want) {
			t.Errorf("RBACYAML lacks %q:\n%s", want, y)
		}
	}
}

// Attack: one cage node's credentials (root in its daemon after a sandbox
// escape) used against the rest of the cluster. RBAC gives group
// cage:nodes every Node and every Lease of kube-node-lease: node "evil"
// rewrote node b's cage.dev/api and cage.dev/proxy (every front then sent
// b's clients, their API keys and tokens, to it) and tainted, rewrote the
// Lease of, and deleted a Node that is not cage's. Expected (the
// admission policy ApplyRBAC installs): all of that refused with the
// policy's reason; what cage's own nodes need still allowed: its own
// Node and Lease, and taints and conditions on another cage Node (the
// lifecycle's leader).
func TestNodePolicy(t *testing.T) {
	p := kubeplane.Start(t, kubeplane.Options{Nodes: []string{"evil"}})
	ctx := context.Background()
	load := func(user string) *kube.Client {
		cfg, err := kube.LoadKubeconfig(p.MustKubeconfig(t, user))
		if err != nil {
			t.Fatal(err)
		}
		c, err := kube.New(cfg, kube.Options{QPS: 100, Burst: 100})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	admin, evil := load(kubeplane.Admin), load(kubeplane.NodeUser("evil"))
	if err := ApplyRBAC(ctx, admin); err != nil {
		t.Fatal(err)
	}
	if err := ApplyRBAC(ctx, admin); err != nil { // again: an update
		t.Fatalf("ApplyRBAC over itself: %v", err)
	}
	// The API server takes a policy in a moment after it is made: until
	// evil's change of a Node that is not cage's is refused.
	probe := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "probe"}}
	if _, err := admin.CoreV1().Nodes().Create(ctx, probe, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		b, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]string{"x": "y"}}})
		_, err := evil.CoreV1().Nodes().Patch(ctx, "probe", types.MergePatchType, b, metav1.PatchOptions{})
		if err != nil {
			break
		}
		if time.Now().After(deadline) {
			pol, _ := admin.AdmissionregistrationV1().ValidatingAdmissionPolicies().Get(ctx, RoleName, metav1.GetOptions{})
			t.Fatalf("the policy is not in force after 30 s; its status: %+v", pol.Status)
		}
	}
	nodes := func(c *kube.Client) kube.Resource[corev1.Node, corev1.NodeList] { return c.CoreV1().Nodes() }
	mk := func(name string, labels map[string]string) {
		if _, err := nodes(admin).Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	mk("b", map[string]string{NodeLabel: "true"})
	mk("worker-1", nil)
	lease := func(c *kube.Client, name string) error {
		l := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: NodeLeaseNamespace}}
		_, err := c.CoordinationV1().Leases(NodeLeaseNamespace).Create(ctx, l, metav1.CreateOptions{})
		return err
	}
	if err := lease(admin, "worker-1"); err != nil {
		t.Fatal(err)
	}
	patch := func(c *kube.Client, node string, v any) error {
		b, _ := json.Marshal(v)
		_, err := nodes(c).Patch(ctx, node, types.MergePatchType, b, metav1.PatchOptions{})
		return err
	}
	annos := map[string]any{"metadata": map[string]any{"annotations": map[string]string{AnnoAPI: "http://127.0.0.1:1", AnnoProxy: "http://127.0.0.1:1"}}}
	taint := map[string]any{"spec": map[string]any{"taints": []map[string]string{{"key": TaintUnreachable, "effect": "NoSchedule"}}}}
	refused := func(what string, err error, reason string) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), reason) {
			t.Errorf("%s: %v; want refused (%q)", what, err, reason)
		}
	}
	allowed := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Errorf("%s: %v; want allowed", what, err)
		}
	}
	refused("evil rewrites cage node b's addresses", patch(evil, "b", annos), "only its own Node")
	refused("evil relabels cage node b", patch(evil, "b", map[string]any{"metadata": map[string]any{"labels": map[string]string{NodeLabel: "false"}}}), "")
	allowed("evil taints cage node b (the lifecycle's leader)", patch(evil, "b", taint))
	refused("evil taints worker-1 (not cage's)", patch(evil, "worker-1", taint), "only cage Nodes")
	refused("evil labels worker-1 a cage node", patch(evil, "worker-1", map[string]any{"metadata": map[string]any{"labels": map[string]string{NodeLabel: "true"}}}), "only cage Nodes")
	refused("evil deletes worker-1", nodes(evil).Delete(ctx, "worker-1", metav1.DeleteOptions{}), "only cage Nodes")
	refused("evil deletes cage node b", nodes(evil).Delete(ctx, "b", metav1.DeleteOptions{}), "only its own Node")
	refused("evil creates a Node named c", func() error {
		_, err := nodes(evil).Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "c", Labels: map[string]string{NodeLabel: "true"}}}, metav1.CreateOptions{})
		return err
	}(), "only its own Node")
	allowed("evil registers its own Node", func() error {
		_, err := nodes(evil).Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "evil", Labels: map[string]string{NodeLabel: "true"}}}, metav1.CreateOptions{})
		return err
	}())
	allowed("evil sets its own addresses", patch(evil, "evil", annos))
	refused("evil deletes worker-1's Lease", evil.CoordinationV1().Leases(NodeLeaseNamespace).Delete(ctx, "worker-1", metav1.DeleteOptions{}), "only its own Lease")
	refused("evil creates a Lease for b", lease(evil, "b"), "only its own Lease")
	allowed("evil creates its own Lease", lease(evil, "evil"))
	if n, err := nodes(admin).Get(ctx, "b", metav1.GetOptions{}); err != nil || n.Annotations[AnnoAPI] != "" || n.Labels[NodeLabel] != "true" {
		t.Errorf("node b after: %v %v", n, err)
	}
}

// Attack: one cage node's credentials (root in its daemon after a sandbox
// escape) used to become an administrator of every node. The nodes' Role
// let group cage:nodes create, update and patch any Secret of the
// namespace: node "evil" wrote an admin key into cage-api-keys, which
// every node imports (an admin key of each node: teams, keys, every
// team's sandboxes, volumes and snapshots), replaced the node key of
// cage-cluster (every node's signatures then fail: the cluster's
// forwarding stops), and read or wrote any other Secret of the
// namespace. Expected: all of that refused; what a node needs still
// allowed: reading the two Secrets (the keys by their informer's field
// selector) and making cage-cluster when there is none (NodeKey).
func TestNodePolicySecrets(t *testing.T) {
	p := kubeplane.Start(t, kubeplane.Options{Nodes: []string{"evil"}})
	ctx := context.Background()
	load := func(user string) *kube.Client {
		cfg, err := kube.LoadKubeconfig(p.MustKubeconfig(t, user))
		if err != nil {
			t.Fatal(err)
		}
		c, err := kube.New(cfg, kube.Options{QPS: 100, Burst: 100})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	admin, evil := load(kubeplane.Admin), load(kubeplane.NodeUser("evil"))
	const ns = DefaultNamespace
	if err := ApplyRBAC(ctx, admin); err != nil {
		t.Fatal(err)
	}
	// The policy is in force once evil's change of a Node that is not
	// cage's is refused (the API server takes it in a moment).
	probe := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "probe"}}
	if _, err := admin.CoreV1().Nodes().Create(ctx, probe, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		b, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]string{"x": "y"}}})
		if _, err := evil.CoreV1().Nodes().Patch(ctx, "probe", types.MergePatchType, b, metav1.PatchOptions{}); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the policy is not in force after 30 s")
		}
	}
	secrets := func(c *kube.Client) kube.Resource[corev1.Secret, corev1.SecretList] { return c.CoreV1().Secrets(ns) }
	refused := func(what string, err error) {
		t.Helper()
		if err == nil {
			t.Errorf("%s: allowed; want refused", what)
		}
	}
	// A create is RBAC's to allow (it cannot name what is made): the
	// policy refuses it.
	byPolicy := func(what string, err error) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), "may create the Secret "+KeySecret+" only") {
			t.Errorf("%s: %v; want refused by the policy", what, err)
		}
	}
	allowed := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Errorf("%s: %v; want allowed", what, err)
		}
	}
	// No keys Secret yet: evil may not make one.
	_, _, err := CreateKey(ctx, evil, ns, "evil", true)
	byPolicy("evil creates cage-api-keys with an admin key", err)
	// The operator's key (an administrator's kubeconfig), then evil's.
	if _, _, err := CreateKey(ctx, admin, ns, "ci", false); err != nil {
		t.Fatal(err)
	}
	_, _, err = CreateKey(ctx, evil, ns, "evil", true)
	refused("evil adds an admin key to cage-api-keys", err)
	refused("evil patches cage-api-keys", func() error {
		b, _ := json.Marshal(map[string]any{"data": map[string]string{"x": "eyJ9"}})
		_, err := secrets(evil).Patch(ctx, KeysSecret, types.MergePatchType, b, metav1.PatchOptions{})
		return err
	}())
	keys, err := ListKeys(ctx, admin, ns)
	if err != nil || len(keys) != 1 || keys[0].Admin {
		t.Errorf("the cluster's keys after: %+v %v; want the operator's one", keys, err)
	}
	// The node key: evil makes it when there is none (the first node
	// does), reads it, and may not change it.
	key, err := NodeKey(ctx, evil, ns)
	allowed("evil makes and reads cage-cluster (NodeKey)", err)
	refused("evil replaces the node key", func() error {
		s, err := secrets(admin).Get(ctx, KeySecret, metav1.GetOptions{})
		if err != nil {
			return nil // reported below
		}
		s.Data[KeySecretData] = make([]byte, KeyLen)
		_, err = secrets(evil).Update(ctx, s, metav1.UpdateOptions{})
		return err
	}())
	if again, err := NodeKey(ctx, admin, ns); err != nil || string(again) != string(key) {
		t.Errorf("the node key changed, or is gone: %v", err)
	}
	// Other Secrets of the namespace are the operator's.
	if _, err := secrets(admin).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "db-password", Namespace: ns},
		StringData: map[string]string{"password": "x"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	refused("evil reads another Secret of the namespace", func() error {
		_, err := secrets(evil).Get(ctx, "db-password", metav1.GetOptions{})
		return err
	}())
	refused("evil lists the namespace's Secrets", func() error {
		_, err := secrets(evil).List(ctx, metav1.ListOptions{})
		return err
	}())
	byPolicy("evil creates another Secret", func() error {
		_, err := secrets(evil).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "x", Namespace: ns}}, metav1.CreateOptions{})
		return err
	}())
	// What a node reads: the keys, through SyncKeys's informer.
	_, err = ListKeys(ctx, evil, ns)
	allowed("evil reads cage-api-keys", err)
	sctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	st, err := store.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	allowed("evil syncs the keys (list and watch of cage-api-keys)", SyncKeys(sctx, evil, ns, st, nil))
}

// Attack: the kubelet of an ordinary node of a shared cluster (root on
// that node after a container escape) passes its Node off as a cage node:
// it labels it cage.dev/node=true and cage.dev/wall-process=true and
// annotates it with a cage.dev/api address of its own. Its Lease is the
// kubelet's, so every front took it for a live cage node: kube-scheduler
// gave it sandbox pods (their env included), fronts sent it starts and
// forwarded it clients' requests with their API keys. Kubelets may change
// their own Node's labels and annotations (NodeRestriction reserves only
// kubernetes.io and k8s.io ones; this plane, RBAC only, is granted what
// the Node authorizer would). Expected: every make, change or removal of
// a cage.dev/ label or annotation by group system:nodes refused; the
// kubelet's other changes of its Node, and its status, allowed.
func TestKubeletPolicy(t *testing.T) {
	p := kubeplane.Start(t, kubeplane.Options{Kubelets: []string{"worker-1"}})
	ctx := context.Background()
	load := func(user string) *kube.Client {
		cfg, err := kube.LoadKubeconfig(p.MustKubeconfig(t, user))
		if err != nil {
			t.Fatal(err)
		}
		c, err := kube.New(cfg, kube.Options{QPS: 100, Burst: 100})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	admin, kubelet := load(kubeplane.Admin), load(kubeplane.KubeletUser("worker-1"))
	if err := ApplyRBAC(ctx, admin); err != nil {
		t.Fatal(err)
	}
	rb := admin.RbacV1()
	if _, err := rb.ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "kubelet"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"nodes", "nodes/status"},
			Verbs: []string{"get", "create", "update", "patch"}}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := rb.ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "kubelet"},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.GroupKind, APIGroup: rbacv1.GroupName, Name: kubeplane.KubeletGroup}},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "kubelet"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	nodes := kubelet.CoreV1().Nodes()
	patch := func(v any) error {
		b, _ := json.Marshal(v)
		_, err := nodes.Patch(ctx, "worker-1", types.MergePatchType, b, metav1.PatchOptions{})
		return err
	}
	labels := func(l map[string]any) map[string]any { return map[string]any{"metadata": map[string]any{"labels": l}} }
	// The kubelet registers its Node (RBAC takes a moment to authorize it).
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		_, err := nodes.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "worker-1",
			Labels: map[string]string{"kubernetes.io/hostname": "worker-1"}}}, metav1.CreateOptions{})
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the kubelet registers its Node: %v", err)
		}
	}
	// The policy is in force once this is refused (in a moment).
	cage := labels(map[string]any{NodeLabel: "true", WallLabelPrefix + "process": "true"})
	for deadline := time.Now().Add(30 * time.Second); patch(cage) == nil; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the kubelet labelled its Node a cage node: allowed after 30 s; want refused")
		}
		back := labels(map[string]any{NodeLabel: nil, WallLabelPrefix + "process": nil})
		if err := patch(back); err != nil {
			if !strings.Contains(err.Error(), "a kubelet may not") {
				t.Fatalf("take the labels back: %v", err)
			}
			// The policy came into force between the two patches: the
			// kubelet may no longer take them back; the admin does.
			b, _ := json.Marshal(back)
			if _, err := admin.CoreV1().Nodes().Patch(ctx, "worker-1", types.MergePatchType, b, metav1.PatchOptions{}); err != nil {
				t.Fatalf("the admin takes the labels back: %v", err)
			}
		}
	}
	refused := func(what string, err error) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), "a kubelet may not") {
			t.Errorf("%s: %v; want refused by the policy", what, err)
		}
	}
	allowed := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Errorf("%s: %v; want allowed", what, err)
		}
	}
	refused("the kubelet labels its Node a cage node", patch(cage))
	refused("the kubelet sets its Node's cage.dev/api", patch(map[string]any{"metadata": map[string]any{
		"annotations": map[string]string{AnnoAPI: "http://10.0.0.9:3000", AnnoProxy: "http://10.0.0.9:3001"}}}))
	refused("a kubelet registers a Node labelled for cage", func() error {
		_, err := nodes.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "worker-2",
			Labels: map[string]string{NodeLabel: "true"}}}, metav1.CreateOptions{})
		return err
	}())
	allowed("the kubelet labels its Node otherwise", patch(labels(map[string]any{"pool": "general"})))
	allowed("the kubelet annotates its Node otherwise", patch(map[string]any{"metadata": map[string]any{
		"annotations": map[string]string{"node.alpha.kubernetes.io/ttl": "0"}}}))
	allowed("the kubelet reports its status", func() error {
		n, err := nodes.Get(ctx, "worker-1", metav1.GetOptions{})
		if err != nil {
			return err
		}
		n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue,
			LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now()}}
		_, err = nodes.UpdateStatus(ctx, n, metav1.UpdateOptions{})
		return err
	}())
	// An administrator still may (a cage node registers its own Node
	// under group cage:nodes, TestNodePolicy).
	b, _ := json.Marshal(cage)
	if _, err := admin.CoreV1().Nodes().Patch(ctx, "worker-1", types.MergePatchType, b, metav1.PatchOptions{}); err != nil {
		t.Errorf("an administrator labels worker-1 for cage: %v", err)
	}
	refused("the kubelet removes a cage.dev/ label", patch(labels(map[string]any{NodeLabel: nil})))
	allowed("the kubelet labels its cage-labelled Node otherwise", patch(labels(map[string]any{"pool": "cage"})))
}
