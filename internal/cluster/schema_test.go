package cluster

import (
	"errors"
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/cagehq/cage/internal/manager"
	"github.com/cagehq/cage/internal/network"
)

const testID = "0123456789abcdef0123"

// fullRequest sets every field of manager.CreateRequest that Spec carries.
func fullRequest() manager.CreateRequest {
	return manager.CreateRequest{
		Wall: "runc", KeyID: "team_0011223344556677", Template: "base", Timeout: 300 * time.Second,
		Metadata: map[string]string{"user": "ann", "x": "y"}, Env: map[string]string{"A": "1", "B": "two words"},
		CPUs: 1.5, Memory: 768 << 20, Disk: 2 << 30, Pids: 300,
		Net: network.Policy{Mode: network.Allowlist, Allow: []network.Rule{{Name: "*.example.com", Port: 443},
			{Prefix: netip.MustParsePrefix("10.1.0.0/16")}}},
		PublicTraffic: true, HTTPSPorts: []int{8443, 9443},
		AutoPause: true, AutoPauseMemory: true, AutoResume: true,
		Volumes: []manager.VolumeMount{{Name: "data", Path: "/mnt/data"}},
	}
}

func TestPodForRoundTrip(t *testing.T) {
	req := fullRequest()
	pod, err := PodFor(testID, req, "cage")
	if err != nil {
		t.Fatal(err)
	}
	got, err := RequestFrom(pod)
	if err != nil {
		t.Fatal(err)
	}
	want := req
	want.ID = testID
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, want)
	}
	// Every exported field of CreateRequest is carried: a new field that
	// PodFor forgets fails here.
	rt := reflect.TypeOf(got)
	gv, zero := reflect.ValueOf(got), reflect.ValueOf(manager.CreateRequest{})
	for i := 0; i < rt.NumField(); i++ {
		if f := rt.Field(i); f.IsExported() && reflect.DeepEqual(gv.Field(i).Interface(), zero.Field(i).Interface()) {
			t.Errorf("field %s is not carried (zero after the round trip)", f.Name)
		}
	}
	l := pod.Labels
	for k, v := range map[string]string{LabelManagedBy: "cage", LabelSandbox: "true", LabelWall: "runc",
		LabelTemplate: "base", LabelKey: req.KeyID, LabelTeam: req.KeyID} {
		if l[k] != v {
			t.Errorf("label %s = %q, want %q", k, l[k], v)
		}
	}
	if pod.Name != testID || pod.Namespace != "cage" {
		t.Errorf("name %s/%s", pod.Namespace, pod.Name)
	}
	s := pod.Spec
	if s.NodeSelector[WallLabelPrefix+"runc"] != "true" || len(s.NodeSelector) != 1 {
		t.Errorf("nodeSelector %v", s.NodeSelector)
	}
	if len(s.Tolerations) != 1 || s.Tolerations[0].Key != Taint || s.Tolerations[0].Effect != corev1.TaintEffectNoSchedule {
		t.Errorf("tolerations %+v", s.Tolerations)
	}
	if s.RestartPolicy != corev1.RestartPolicyNever || *s.AutomountServiceAccountToken || *s.EnableServiceLinks {
		t.Errorf("pod spec %+v", s)
	}
	c := s.Containers[0]
	if c.Name != ContainerName || c.Resources.Requests.Cpu().MilliValue() != 1500 ||
		c.Resources.Limits.Memory().Value() != 768<<20 || !c.Resources.Requests.Memory().Equal(*c.Resources.Limits.Memory()) {
		t.Errorf("container %+v", c)
	}
}

func TestPodForDefaults(t *testing.T) {
	pod, err := PodFor(testID, manager.CreateRequest{Wall: "process", KeyID: "key_00112233aabb"}, "ns1")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := pod.Labels[LabelTeam]; ok {
		t.Error("team label on a key without a team")
	}
	r := pod.Spec.Containers[0].Resources.Requests
	if r.Cpu().MilliValue() != 1000 || r.Memory().Value() != 512<<20 {
		t.Errorf("default requests %v", r)
	}
	got, err := RequestFrom(pod)
	if err != nil || got.ID != testID || got.Wall != "process" || got.Timeout != 0 || got.CPUs != 0 || got.Net.Mode != "" {
		t.Fatalf("RequestFrom = %+v, %v", got, err)
	}
}

func TestPodForRefuses(t *testing.T) {
	ok := manager.CreateRequest{Wall: "runc", Template: "base"}
	for name, c := range map[string]struct {
		id  string
		req func(r *manager.CreateRequest)
	}{
		"short id":         {id: "abc"},
		"uppercase id":     {id: "0123456789ABCDEF0123"},
		"no wall":          {req: func(r *manager.CreateRequest) { r.Wall = "" }},
		"key label":        {req: func(r *manager.CreateRequest) { r.KeyID = "key with spaces" }},
		"negative memory":  {req: func(r *manager.CreateRequest) { r.Memory = -1 }},
		"negative timeout": {req: func(r *manager.CreateRequest) { r.Timeout = -time.Second }},
	} {
		id, r := testID, ok
		if c.id != "" {
			id = c.id
		}
		if c.req != nil {
			c.req(&r)
		}
		if _, err := PodFor(id, r, "cage"); !errors.Is(err, ErrSpec) {
			t.Errorf("%s: err = %v, want ErrSpec", name, err)
		}
	}
}

// TestPodForSnapshotTemplate: a template name that is no label value (a
// snapshot's ref) is kept in the spec and left out of the labels.
func TestPodForSnapshotTemplate(t *testing.T) {
	pod, err := PodFor(testID, manager.CreateRequest{Wall: "runc", Template: "snapshots/my-snap:latest"}, "cage")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := pod.Labels[LabelTemplate]; ok {
		t.Errorf("template label %q", pod.Labels[LabelTemplate])
	}
	req, err := RequestFrom(pod)
	if err != nil || req.Template != "snapshots/my-snap:latest" {
		t.Fatalf("RequestFrom = %q, %v", req.Template, err)
	}
}

func TestRequestFromMalformed(t *testing.T) {
	good, err := PodFor(testID, fullRequest(), "cage")
	if err != nil {
		t.Fatal(err)
	}
	for name, spec := range map[string]string{
		"not JSON":        `{"v":1,`,
		"wrong version":   `{"v":2,"wall":"runc"}`,
		"no version":      `{"wall":"runc"}`,
		"unknown field":   `{"v":1,"wall":"runc","privileged":true}`,
		"no wall":         `{"v":1,"template":"base"}`,
		"negative cpus":   `{"v":1,"wall":"runc","cpus":-1}`,
		"bad network":     `{"v":1,"wall":"runc","network":"{\"mode\":\"sideways\"}"}`,
		"trailing data":   `{"v":1,"wall":"runc"} {}`,
		"wrong type":      `{"v":1,"wall":"runc","memory":"lots"}`,
		"huge timeout":    `{"v":1,"wall":"runc","timeoutSeconds":9223372036854775807}`,
		"multiline error": "{\"v\":1,\n\"wall\":3}",
	} {
		pod := good.DeepCopy()
		pod.Annotations[AnnoSpec] = spec
		_, err := RequestFrom(pod)
		if !errors.Is(err, ErrSpec) {
			t.Errorf("%s: err = %v, want ErrSpec", name, err)
			continue
		}
		if strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: error of more than one line: %q", name, err)
		}
	}
	pod := good.DeepCopy()
	delete(pod.Annotations, AnnoSpec)
	if _, err := RequestFrom(pod); !errors.Is(err, ErrSpec) {
		t.Errorf("no annotation: err = %v", err)
	}
	pod = good.DeepCopy()
	pod.Name = "not-an-id"
	if _, err := RequestFrom(pod); !errors.Is(err, ErrSpec) {
		t.Errorf("bad name: err = %v", err)
	}
}

func TestEnd(t *testing.T) {
	end := time.Date(2026, 12, 1, 21, 0, 0, 123e6, time.UTC)
	pod := &corev1.Pod{}
	pod.Annotations = map[string]string{AnnoEnd: FormatEnd(end.In(time.FixedZone("x", 3600)))}
	if got := EndOf(pod); !got.Equal(end) {
		t.Errorf("EndOf = %v, want %v", got, end)
	}
	pod.Annotations[AnnoEnd] = "soon"
	if got := EndOf(pod); !got.IsZero() {
		t.Errorf("EndOf(malformed) = %v", got)
	}
}

// Attack: a tenant's creates in cluster mode fill the cluster's etcd. A
// pod carries its create's metadata, environment and network policy in
// cage.dev/spec, and etcd keeps each write of it whole until the API
// server compacts: with one host's bounds (64 KiB each, a control
// character or "<" six bytes of JSON) a pod was 256 KiB, and 40 creates
// grew etcd by 32 MB (the review's run). Expected: a spec past
// MaxSpecBytes is refused before any pod is made (the front's create
// answers 400), and "<" costs one byte of it.
func TestPodForSpecBounded(t *testing.T) {
	big := strings.Repeat("<", 10<<10)
	for name, r := range map[string]manager.CreateRequest{
		"the review's metadata": {Metadata: map[string]string{"a": big, "b": big, "c": big, "d": big}},
		"environment":           {Env: map[string]string{"BLOB": strings.Repeat("x", MaxSpecBytes)}},
		"control characters":    {Metadata: map[string]string{"m": strings.Repeat("\x01", 3<<10)}},
		"network policy": {Net: network.Policy{Mode: network.Allowlist,
			Allow: slices.Repeat([]network.Rule{{Name: strings.Repeat("a", 60) + ".example.com", Port: 443}}, 256)}},
	} {
		r.Wall, r.Template = "runc", "base"
		_, err := PodFor(testID, r, "cage")
		if !errors.Is(err, ErrSpec) || !strings.Contains(err.Error(), fmt.Sprintf("at most %d", MaxSpecBytes)) {
			t.Errorf("%s: %v; want refused naming the bound", name, err)
		}
	}
	md := map[string]string{"html": strings.Repeat("<&>", 4<<10)} // 12 KiB
	pod, err := PodFor(testID, manager.CreateRequest{Wall: "runc", Template: "base", Metadata: md}, "cage")
	if err != nil {
		t.Fatalf("12 KiB of metadata: %v", err)
	}
	if n := len(pod.Annotations[AnnoSpec]); n > 13<<10 {
		t.Errorf("spec of 12 KiB of \"<&>\" is %d bytes", n)
	}
	back, err := RequestFrom(pod)
	if err != nil || back.Metadata["html"] != md["html"] {
		t.Errorf("round trip: %v", err)
	}
}
