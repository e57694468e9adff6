package kube

import (
	"context"
	"encoding/json"
	"errors"
	"net/url"
	"strconv"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Resource is one resource of the API (in one namespace, or cluster
// scoped) whose objects are T and lists L, with client-go's call shapes
// (the options structs are apimachinery's; only the fields cage uses are
// sent).
type Resource[T any, L any] struct {
	c        *Client
	prefix   string // /api/v1 or /apis/GROUP/VERSION
	ns, name string // name: the resource's plural
}

func (r Resource[T, L]) path(name string, sub ...string) string {
	p := r.prefix
	if r.ns != "" {
		p += "/namespaces/" + url.PathEscape(r.ns)
	}
	p += "/" + r.name
	if name != "" {
		p += "/" + url.PathEscape(name)
	}
	for _, s := range sub {
		p += "/" + s
	}
	return p
}

// named is what every object of the API has.
type named interface{ GetName() string }

func nameOf(obj any) (string, error) {
	if n, ok := obj.(named); ok && n.GetName() != "" {
		return n.GetName(), nil
	}
	return "", errors.New("kube: the object has no name")
}

// Get reads the named object.
func (r Resource[T, L]) Get(ctx context.Context, name string, _ metav1.GetOptions) (*T, error) {
	out := new(T)
	return out, r.c.call(ctx, request{method: "GET", path: r.path(name)}, out)
}

// List lists the objects that o's selectors select.
func (r Resource[T, L]) List(ctx context.Context, o metav1.ListOptions) (*L, error) {
	out := new(L)
	return out, r.c.call(ctx, request{method: "GET", path: r.path(""), query: listQuery(o)}, out)
}

// Create makes obj.
func (r Resource[T, L]) Create(ctx context.Context, obj *T, _ metav1.CreateOptions) (*T, error) {
	return r.write(ctx, "POST", "", obj)
}

// Update replaces obj (its resourceVersion is the precondition).
func (r Resource[T, L]) Update(ctx context.Context, obj *T, _ metav1.UpdateOptions) (*T, error) {
	name, err := nameOf(obj)
	if err != nil {
		return nil, err
	}
	return r.write(ctx, "PUT", r.path(name), obj)
}

// UpdateStatus replaces obj's status (subresource status).
func (r Resource[T, L]) UpdateStatus(ctx context.Context, obj *T, _ metav1.UpdateOptions) (*T, error) {
	name, err := nameOf(obj)
	if err != nil {
		return nil, err
	}
	return r.write(ctx, "PUT", r.path(name, "status"), obj)
}

func (r Resource[T, L]) write(ctx context.Context, method, path string, obj *T) (*T, error) {
	if path == "" {
		path = r.path("")
	}
	b, err := json.Marshal(obj)
	if err != nil {
		return nil, err
	}
	out := new(T)
	return out, r.c.call(ctx, request{method: method, path: path, contentType: "application/json", body: b}, out)
}

// Patch patches the named object (or its subresource) with data of type pt.
func (r Resource[T, L]) Patch(ctx context.Context, name string, pt types.PatchType, data []byte, _ metav1.PatchOptions, sub ...string) (*T, error) {
	out := new(T)
	return out, r.c.call(ctx, request{method: "PATCH", path: r.path(name, sub...), contentType: string(pt), body: data}, out)
}

// Delete deletes the named object (o's grace period and preconditions).
func (r Resource[T, L]) Delete(ctx context.Context, name string, o metav1.DeleteOptions) error {
	o.TypeMeta = metav1.TypeMeta{Kind: "DeleteOptions", APIVersion: "meta.k8s.io/v1"}
	b, err := json.Marshal(o)
	if err != nil {
		return err
	}
	return r.c.call(ctx, request{method: "DELETE", path: r.path(name), contentType: "application/json", body: b}, nil)
}

// listQuery is the query of a list or watch.
func listQuery(o metav1.ListOptions) url.Values {
	q := url.Values{}
	if o.LabelSelector != "" {
		q.Set("labelSelector", o.LabelSelector)
	}
	if o.FieldSelector != "" {
		q.Set("fieldSelector", o.FieldSelector)
	}
	if o.ResourceVersion != "" {
		q.Set("resourceVersion", o.ResourceVersion)
	}
	if o.Limit > 0 {
		q.Set("limit", strconv.FormatInt(o.Limit, 10))
	}
	if o.Continue != "" {
		q.Set("continue", o.Continue)
	}
	if o.Watch {
		q.Set("watch", "true")
	}
	if o.AllowWatchBookmarks {
		q.Set("allowWatchBookmarks", "true")
	}
	if o.TimeoutSeconds != nil {
		q.Set("timeoutSeconds", strconv.FormatInt(*o.TimeoutSeconds, 10))
	}
	return q
}

// Core is the core API group's resources (client-go's CoreV1()).
type Core struct{ c *Client }

// Coordination is coordination.k8s.io/v1's (CoordinationV1()).
type Coordination struct{ c *Client }

// RBAC is rbac.authorization.k8s.io/v1's (RbacV1()).
type RBAC struct{ c *Client }

// CoreV1 is the core group.
func (c *Client) CoreV1() Core { return Core{c} }

// CoordinationV1 is the coordination group.
func (c *Client) CoordinationV1() Coordination { return Coordination{c} }

// RbacV1 is the RBAC group.
func (c *Client) RbacV1() RBAC { return RBAC{c} }

// Admission is admissionregistration.k8s.io/v1's (AdmissionregistrationV1()).
type Admission struct{ c *Client }

// AdmissionregistrationV1 is the admission registration group.
func (c *Client) AdmissionregistrationV1() Admission { return Admission{c} }

// ValidatingAdmissionPolicies of the cluster.
func (g Admission) ValidatingAdmissionPolicies() Resource[admissionv1.ValidatingAdmissionPolicy, admissionv1.ValidatingAdmissionPolicyList] {
	return Resource[admissionv1.ValidatingAdmissionPolicy, admissionv1.ValidatingAdmissionPolicyList]{g.c, admission, "", "validatingadmissionpolicies"}
}

// ValidatingAdmissionPolicyBindings of the cluster.
func (g Admission) ValidatingAdmissionPolicyBindings() Resource[admissionv1.ValidatingAdmissionPolicyBinding, admissionv1.ValidatingAdmissionPolicyBindingList] {
	return Resource[admissionv1.ValidatingAdmissionPolicyBinding, admissionv1.ValidatingAdmissionPolicyBindingList]{g.c, admission, "", "validatingadmissionpolicybindings"}
}

const (
	core  = "/api/v1"
	coord = "/apis/coordination.k8s.io/v1"
	rbac  = "/apis/rbac.authorization.k8s.io/v1"

	admission = "/apis/admissionregistration.k8s.io/v1"
)

// Pods in namespace ns.
func (g Core) Pods(ns string) Resource[corev1.Pod, corev1.PodList] {
	return Resource[corev1.Pod, corev1.PodList]{g.c, core, ns, "pods"}
}

// Nodes of the cluster.
func (g Core) Nodes() Resource[corev1.Node, corev1.NodeList] {
	return Resource[corev1.Node, corev1.NodeList]{g.c, core, "", "nodes"}
}

// Secrets in namespace ns.
func (g Core) Secrets(ns string) Resource[corev1.Secret, corev1.SecretList] {
	return Resource[corev1.Secret, corev1.SecretList]{g.c, core, ns, "secrets"}
}

// Events in namespace ns.
func (g Core) Events(ns string) Resource[corev1.Event, corev1.EventList] {
	return Resource[corev1.Event, corev1.EventList]{g.c, core, ns, "events"}
}

// Namespaces of the cluster.
func (g Core) Namespaces() Resource[corev1.Namespace, corev1.NamespaceList] {
	return Resource[corev1.Namespace, corev1.NamespaceList]{g.c, core, "", "namespaces"}
}

// Leases in namespace ns.
func (g Coordination) Leases(ns string) Resource[coordinationv1.Lease, coordinationv1.LeaseList] {
	return Resource[coordinationv1.Lease, coordinationv1.LeaseList]{g.c, coord, ns, "leases"}
}

// ClusterRoles of the cluster.
func (g RBAC) ClusterRoles() Resource[rbacv1.ClusterRole, rbacv1.ClusterRoleList] {
	return Resource[rbacv1.ClusterRole, rbacv1.ClusterRoleList]{g.c, rbac, "", "clusterroles"}
}

// ClusterRoleBindings of the cluster.
func (g RBAC) ClusterRoleBindings() Resource[rbacv1.ClusterRoleBinding, rbacv1.ClusterRoleBindingList] {
	return Resource[rbacv1.ClusterRoleBinding, rbacv1.ClusterRoleBindingList]{g.c, rbac, "", "clusterrolebindings"}
}

// Roles in namespace ns.
func (g RBAC) Roles(ns string) Resource[rbacv1.Role, rbacv1.RoleList] {
	return Resource[rbacv1.Role, rbacv1.RoleList]{g.c, rbac, ns, "roles"}
}

// RoleBindings in namespace ns.
func (g RBAC) RoleBindings(ns string) Resource[rbacv1.RoleBinding, rbacv1.RoleBindingList] {
	return Resource[rbacv1.RoleBinding, rbacv1.RoleBindingList]{g.c, rbac, ns, "rolebindings"}
}
