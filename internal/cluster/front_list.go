package cluster

import (
	"encoding/base64"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/cagehq/cage/internal/ids"
	"github.com/cagehq/cage/internal/sandbox"
	"github.com/cagehq/cage/internal/store"
)

// List is the cluster's sandboxes that match f, from the pod informer (no
// request to the API server), in the order and pages of the local list
// (store.ListSandboxes). A sandbox shows once its node runs it (phase
// Running): pods still being created, failed ones and those on lost
// nodes are left out (a get of one of the latter says it is lost).
func (f *Front) List(flt store.ListFilter) ([]*store.Sandbox, string, error) {
	sel := labels.Everything()
	if flt.KeyID != "" {
		req, err := labels.NewRequirement(LabelKey, "==", []string{flt.KeyID})
		if err != nil { // an owner id a label cannot hold owns no pod
			return nil, "", nil
		}
		sel = labels.NewSelector().Add(*req)
	}
	var after struct {
		at int64
		id string
	}
	if flt.Cursor != "" {
		at, id, err := decodeCursor(flt.Cursor)
		if err != nil {
			return nil, "", err
		}
		after.at, after.id = at, id
	}
	var pods []*corev1.Pod
	for _, p := range f.pods.List() {
		if sel.Matches(labels.Set(p.Labels)) {
			pods = append(pods, p)
		}
	}
	lost := map[string]bool{}
	var out []*store.Sandbox
	for _, p := range pods {
		if p.Spec.NodeName == "" || p.Status.Phase != corev1.PodRunning || p.DeletionTimestamp != nil || f.killed(p.Name) {
			continue
		}
		l, seen := lost[p.Spec.NodeName]
		if !seen {
			l, _ = f.lost(p.Spec.NodeName)
			lost[p.Spec.NodeName] = l
		}
		if l {
			continue
		}
		rec, err := recordOf(p)
		if err != nil {
			f.log.Warn("cluster: a sandbox pod that does not read", "pod", p.Name, "err", err)
			continue
		}
		if !matches(rec, flt) {
			continue
		}
		if flt.Cursor != "" && !pastCursor(rec, after.at, after.id, flt.Desc) {
			continue
		}
		out = append(out, rec)
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		less := a.StartedAt.Before(b.StartedAt) || (a.StartedAt.Equal(b.StartedAt) && a.ID < b.ID)
		if flt.Desc {
			return !less
		}
		return less
	})
	next := ""
	if flt.Limit > 0 && len(out) > flt.Limit {
		out = out[:flt.Limit]
		last := out[len(out)-1]
		next = encodeCursor(last.StartedAt.UnixNano(), last.ID)
	}
	return out, next, nil
}

// matches says whether rec passes f's filters other than the key and the
// cursor.
func matches(rec *store.Sandbox, f store.ListFilter) bool {
	if len(f.States) > 0 && !contains(f.States, rec.State) {
		return false
	}
	for k, v := range f.Metadata {
		if got, ok := rec.Metadata[k]; !ok || got != v {
			return false
		}
	}
	if f.Template != "" && rec.TemplateID != f.Template {
		return false
	}
	return f.StartedAfter.IsZero() || !rec.StartedAt.Before(f.StartedAfter)
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// pastCursor says whether rec comes after the position (at, id) in the
// list's order.
func pastCursor(rec *store.Sandbox, at int64, id string, desc bool) bool {
	n := rec.StartedAt.UnixNano()
	if desc {
		return n < at || (n == at && rec.ID < id)
	}
	return n > at || (n == at && rec.ID > id)
}

// cursorVersion marks the cluster list's cursors (base64 of "c1.NANOS.ID").
const cursorVersion = "c1"

func encodeCursor(at int64, id string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(cursorVersion + "." + strconv.FormatInt(at, 10) + "." + id))
}

func decodeCursor(c string) (int64, string, error) {
	bad := fmt.Errorf("%w: %w: %q", sandbox.ErrInvalid, store.ErrInvalidCursor, c)
	b, err := base64.RawURLEncoding.DecodeString(c)
	if err != nil {
		return 0, "", bad
	}
	parts := strings.Split(string(b), ".")
	if len(parts) != 3 || parts[0] != cursorVersion || !ids.Valid(parts[2]) {
		return 0, "", bad
	}
	at, err := strconv.ParseInt(parts[1], 10, 64)
	if err != nil {
		return 0, "", bad
	}
	return at, parts[2], nil
}

// recordOf is what a list shows of a sandbox pod: its spec, its node's
// state annotation, its start and end. No token is in it (a pod holds
// none).
func recordOf(p *corev1.Pod) (*store.Sandbox, error) {
	req, err := RequestFrom(p)
	if err != nil {
		return nil, err
	}
	rec := &store.Sandbox{ID: p.Name, KeyID: req.KeyID, TemplateID: req.Template, Wall: req.Wall,
		State: store.StateRunning, Metadata: req.Metadata, CPUs: req.CPUs, Memory: req.Memory,
		Disk: req.Disk, Pids: req.Pids, PublicTraffic: req.PublicTraffic, AutoPause: req.AutoPause,
		AutoPauseMemory: req.AutoPauseMemory, AutoResume: req.AutoResume, HTTPSPorts: req.HTTPSPorts,
		TimeoutSeconds: int64(req.Timeout / time.Second)}
	if p.Annotations[AnnoState] == store.StatePaused {
		rec.State = store.StatePaused
	}
	for _, v := range req.Volumes {
		rec.VolumeMounts = append(rec.VolumeMounts, store.VolumeMount{Name: v.Name, Path: v.Path})
	}
	if len(p.Spec.Containers) > 0 {
		res := p.Spec.Containers[0].Resources.Limits
		if rec.CPUs == 0 {
			if q, ok := res[corev1.ResourceCPU]; ok {
				rec.CPUs = float64(q.MilliValue()) / 1000
			}
		}
		if rec.Memory == 0 {
			if q, ok := res[corev1.ResourceMemory]; ok {
				rec.Memory = q.Value()
			}
		}
	}
	rec.StartedAt = p.CreationTimestamp.Time
	if p.Status.StartTime != nil {
		rec.StartedAt = p.Status.StartTime.Time
	}
	for _, cs := range p.Status.ContainerStatuses {
		if cs.State.Running != nil && !cs.State.Running.StartedAt.IsZero() {
			rec.StartedAt = cs.State.Running.StartedAt.Time
		}
	}
	rec.EndAt = rec.StartedAt.Add(req.Timeout)
	if e, err := time.Parse(time.RFC3339Nano, p.Annotations[AnnoEnd]); err == nil {
		rec.EndAt = e
	}
	return rec, nil
}
