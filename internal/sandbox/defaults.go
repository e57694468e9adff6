package sandbox

import (
	"strconv"

	"github.com/cagehq/cage/internal/units"
)

// An image template may set the limits its sandboxes get when a create
// names none, as labels (LABEL in a Dockerfile): the desktop template needs
// more memory than DefaultMemory for Xvfb, XFCE and a browser, and more
// pids (threads count) for Firefox. E2B sets these per template too.
const (
	LabelMemory = "cage.memory" // a size: "2G"
	LabelPids   = "cage.pids"   // a count: "1024"
)

// TemplateDefaults fills o's memory and pids that the caller left unset
// (zero) from the labels of o's template, held to the maxima (o.Max, else
// the host's): a template's default is never a reason to refuse a create.
// A template that cannot be found, or labels that do not parse, leave o as
// it was (Begin reports a missing template).
func (h *Host) TemplateDefaults(o *Options) {
	if o.Memory != 0 && o.Pids != 0 || o.Template == "" {
		return
	}
	t, err := h.Template(o.Template)
	if err != nil || t == nil || t.Image == nil {
		return
	}
	labels := t.Image.Info.Config.Labels
	maxima := o.Max.orHost()
	if v, ok := labels[LabelMemory]; ok && o.Memory == 0 {
		if n, err := units.ParseSize(v); err == nil && n >= MinMemory {
			o.Memory = min(n, maxima.Memory)
		}
	}
	if v, ok := labels[LabelPids]; ok && o.Pids == 0 {
		if n, err := strconv.ParseInt(v, 10, 64); err == nil && n >= MinPids {
			o.Pids = min(n, maxima.Pids)
		}
	}
}
