package cluster

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
)

// The names of cage's labels, annotations and taint (docs/ARCHITECTURE.md,
// "Cluster mode").
const (
	LabelManagedBy  = "app.kubernetes.io/managed-by" // = "cage" on every sandbox pod
	LabelSandbox    = "cage.dev/sandbox"             // = "true" on every sandbox pod
	LabelKey        = "cage.dev/key"                 // the owner: the key's team, or the key
	LabelTeam       = "cage.dev/team"                // the team, when the owner is one
	LabelWall       = "cage.dev/wall"
	LabelTemplate   = "cage.dev/template"
	AnnoSpec        = "cage.dev/spec"  // JSON of Spec
	AnnoEnd         = "cage.dev/end"   // RFC 3339: when the sandbox ends (owner node)
	AnnoState       = "cage.dev/state" // running | paused (owner node)
	NodeLabel       = "cage.dev/node"  // = "true" on every cage Node
	WallLabelPrefix = "cage.dev/wall-" // + wall = "true" on Nodes that run it
	Taint           = "cage.dev/sandbox"
	AnnoAPI         = "cage.dev/api"   // on a Node: http://ADVERTISE:APIPORT
	AnnoProxy       = "cage.dev/proxy" // on a Node: http://ADVERTISE:PROXYPORT
	// LabelMicrovmAccel is on a Node that runs microvm: kvm, or tcg
	// (emulation: development and CI only). A pod may select kvm.
	LabelMicrovmAccel = "cage.dev/microvm-accel"

	ContainerName = "sandbox"
	SpecVersion   = 1

	// Reasons of a Failed pod's status.
	ReasonCreateFailed = "CreateFailed"
	ReasonLost         = "Lost"
)

// Spec is what defines a sandbox, kept in a pod's AnnoSpec annotation.
type Spec struct {
	V               int               `json:"v"`
	Wall            string            `json:"wall"`
	Template        string            `json:"template"`
	Key             string            `json:"key,omitempty"` // the owner (manager.CreateRequest.KeyID)
	TimeoutSeconds  int64             `json:"timeoutSeconds,omitempty"`
	Metadata        map[string]string `json:"metadata,omitempty"`
	Env             map[string]string `json:"env,omitempty"`
	CPUs            float64           `json:"cpus,omitempty"`
	Memory          int64             `json:"memory,omitempty"` // bytes
	Disk            int64             `json:"disk,omitempty"`   // bytes
	Pids            int64             `json:"pids,omitempty"`
	Network         string            `json:"network,omitempty"` // manager.EncodePolicy
	PublicTraffic   bool              `json:"publicTraffic,omitempty"`
	HTTPSPorts      []int             `json:"httpsPorts,omitempty"`
	AutoPause       bool              `json:"autoPause,omitempty"`
	AutoPauseMemory bool              `json:"autoPauseMemory,omitempty"`
	AutoResume      bool              `json:"autoResume,omitempty"`
	Volumes         []Volume          `json:"volumes,omitempty"`
}

// Volume is a volume of the owner's mounted in the sandbox, by name.
type Volume struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

// MaxSpecBytes bounds a sandbox pod's AnnoSpec (its create's spec as
// JSON): etcd keeps every write of a pod whole until the API server
// compacts (every 5 minutes), and a tenant's create and each change of
// its sandbox (a timeout, a pause) write the pod again. The bounds of one
// host (64 KiB of metadata and 64 KiB of environment, six bytes of JSON
// each for a control character) made pods of 256 KiB: 40 creates grew
// etcd by 32 MB, 300 timeout calls on one sandbox by 8 MB, and etcd's
// 2 GiB quota (past which the whole Kubernetes cluster stops writing)
// was a minute of one key's requests away (found by review, 2026-12-04).
const MaxSpecBytes = 16 << 10

// ErrSpec marks a pod whose spec annotation cannot be read: the node
// reports it Failed with the error as its message.
var ErrSpec = errors.New("malformed sandbox pod")

// PodFor returns the pod of sandbox id (a name of ids.NewID's format)
// created with req, in namespace ns; a spec past MaxSpecBytes is an
// ErrSpec error. The scheduler places it on a Node
// labelled for req.Wall (so req.Wall must be the registry's name for it,
// not ""), counting req's cpus and memory (or the defaults).
func PodFor(id string, req manager.CreateRequest, ns string) (*corev1.Pod, error) {
	if !ids.Valid(id) {
		return nil, fmt.Errorf("%w: sandbox id %q is not 20 lowercase hex characters", ErrSpec, id)
	}
	if req.Wall == "" {
		return nil, fmt.Errorf("%w: no wall named", ErrSpec)
	}
	if req.Timeout < 0 || req.CPUs < 0 || req.Memory < 0 || req.Disk < 0 || req.Pids < 0 {
		return nil, fmt.Errorf("%w: negative limit", ErrSpec)
	}
	s := Spec{V: SpecVersion, Wall: req.Wall, Template: req.Template, Key: req.KeyID,
		TimeoutSeconds: int64(req.Timeout / time.Second), Metadata: req.Metadata, Env: req.Env,
		CPUs: req.CPUs, Memory: req.Memory, Disk: req.Disk, Pids: req.Pids,
		Network: manager.EncodePolicy(req.Net), PublicTraffic: req.PublicTraffic, HTTPSPorts: req.HTTPSPorts,
		AutoPause: req.AutoPause, AutoPauseMemory: req.AutoPauseMemory, AutoResume: req.AutoResume}
	for _, v := range req.Volumes {
		s.Volumes = append(s.Volumes, Volume{Name: v.Name, Path: v.Path})
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false) // "<" is one byte of the bound, not six
	if err := enc.Encode(s); err != nil {
		return nil, err
	}
	spec := bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
	if len(spec) > MaxSpecBytes {
		return nil, fmt.Errorf("%w: the sandbox's metadata, environment and network policy are %d bytes in the cluster's pod, at most %d in cluster mode",
			ErrSpec, len(spec), MaxSpecBytes)
	}
	labels := map[string]string{LabelManagedBy: "cage", LabelSandbox: "true",
		LabelWall: req.Wall, LabelKey: req.KeyID}
	if strings.HasPrefix(req.KeyID, store.TeamPrefix) {
		labels[LabelTeam] = req.KeyID
	}
	// A template's name may be no label value (a snapshot's ref has a / and
	// a tag): the label is then left out; the spec has the name.
	if len(validation.IsValidLabelValue(req.Template)) == 0 {
		labels[LabelTemplate] = req.Template
	}
	for k, v := range labels {
		if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
			return nil, fmt.Errorf("%w: %s %q: %s", ErrSpec, k, v, errs[0])
		}
	}
	if errs := validation.IsQualifiedName(WallLabelPrefix + req.Wall); len(errs) > 0 {
		return nil, fmt.Errorf("%w: wall %q: %s", ErrSpec, req.Wall, errs[0])
	}
	cpus, mem := req.CPUs, req.Memory
	if cpus == 0 {
		cpus = sandbox.DefaultCPUs
	}
	if mem == 0 {
		mem = sandbox.DefaultMemory
	}
	res := corev1.ResourceList{
		corev1.ResourceCPU:    *resource.NewMilliQuantity(int64(cpus*1000+0.5), resource.DecimalSI),
		corev1.ResourceMemory: *resource.NewQuantity(mem, resource.BinarySI),
	}
	no := false
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: id, Namespace: ns, Labels: labels,
			Annotations: map[string]string{AnnoSpec: string(spec)}},
		Spec: corev1.PodSpec{
			NodeSelector: map[string]string{WallLabelPrefix + req.Wall: "true"},
			Tolerations: []corev1.Toleration{{Key: Taint, Operator: corev1.TolerationOpEqual, Value: "true",
				Effect: corev1.TaintEffectNoSchedule}},
			Containers: []corev1.Container{{Name: ContainerName, Image: "cage.dev/template/" + req.Template,
				Resources: corev1.ResourceRequirements{Requests: res, Limits: res.DeepCopy()}}},
			RestartPolicy:                corev1.RestartPolicyNever,
			AutomountServiceAccountToken: &no,
			EnableServiceLinks:           &no,
		},
	}, nil
}

// RequestFrom reads the create request of a sandbox pod (its ID the pod's
// name). A pod whose spec cannot be read is an ErrSpec error naming why.
func RequestFrom(pod *corev1.Pod) (manager.CreateRequest, error) {
	var req manager.CreateRequest
	if !ids.Valid(pod.Name) {
		return req, fmt.Errorf("%w: name %q is not a sandbox id", ErrSpec, pod.Name)
	}
	raw, ok := pod.Annotations[AnnoSpec]
	if !ok {
		return req, fmt.Errorf("%w: no %s annotation", ErrSpec, AnnoSpec)
	}
	var s Spec
	dec := json.NewDecoder(bytes.NewReader([]byte(raw)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&s); err != nil {
		return req, fmt.Errorf("%w: %s: %s", ErrSpec, AnnoSpec, oneLine(err.Error()))
	}
	if dec.More() {
		return req, fmt.Errorf("%w: %s: data after the JSON object", ErrSpec, AnnoSpec)
	}
	if s.V != SpecVersion {
		return req, fmt.Errorf("%w: %s: version %d, this node reads %d", ErrSpec, AnnoSpec, s.V, SpecVersion)
	}
	if s.Wall == "" {
		return req, fmt.Errorf("%w: %s: no wall", ErrSpec, AnnoSpec)
	}
	if s.TimeoutSeconds < 0 || s.CPUs < 0 || s.Memory < 0 || s.Disk < 0 || s.Pids < 0 {
		return req, fmt.Errorf("%w: %s: negative limit", ErrSpec, AnnoSpec)
	}
	if s.TimeoutSeconds > int64((1<<63-1)/time.Second) {
		return req, fmt.Errorf("%w: %s: timeout out of range", ErrSpec, AnnoSpec)
	}
	pol, err := manager.DecodePolicy(s.Network)
	if err == nil {
		check := pol // Validate fills defaults; the request keeps what was asked
		err = check.Validate()
	}
	if err != nil {
		return req, fmt.Errorf("%w: %s: network: %s", ErrSpec, AnnoSpec, oneLine(err.Error()))
	}
	req = manager.CreateRequest{ID: pod.Name, Wall: s.Wall, KeyID: s.Key, Template: s.Template,
		Timeout: time.Duration(s.TimeoutSeconds) * time.Second, Metadata: s.Metadata, Env: s.Env,
		CPUs: s.CPUs, Memory: s.Memory, Disk: s.Disk, Pids: s.Pids, Net: pol,
		PublicTraffic: s.PublicTraffic, HTTPSPorts: s.HTTPSPorts,
		AutoPause: s.AutoPause, AutoPauseMemory: s.AutoPauseMemory, AutoResume: s.AutoResume}
	for _, v := range s.Volumes {
		req.Volumes = append(req.Volumes, manager.VolumeMount{Name: v.Name, Path: v.Path})
	}
	return req, nil
}

// EndOf reads a pod's AnnoEnd (zero when absent or malformed).
func EndOf(pod *corev1.Pod) time.Time {
	t, _ := time.Parse(time.RFC3339Nano, pod.Annotations[AnnoEnd])
	return t
}

// FormatEnd is AnnoEnd's value for t.
func FormatEnd(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

// oneLine keeps an error's first line, at most 200 bytes, so that it fits
// a pod's status message and an API error.
func oneLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	if len(s) > 200 {
		s = s[:200] + "…"
	}
	return s
}
