package sandbox

import (
	"testing"

	"github.com/cagehq/cage/internal/imgstore"
	"github.com/cagehq/cage/internal/template"
)

func TestTemplateDefaults(t *testing.T) {
	h := &Host{}
	labelled := func(labels map[string]string) *template.Template {
		return &template.Template{Image: &template.Image{Info: &imgstore.Template{Config: imgstore.Config{Labels: labels}}}}
	}
	h.SetTemplate("desktop", labelled(map[string]string{LabelMemory: "2G", LabelPids: "1024"}))
	h.SetTemplate("huge", labelled(map[string]string{LabelMemory: "64T", LabelPids: "99999999"}))
	h.SetTemplate("bad", labelled(map[string]string{LabelMemory: "lots", LabelPids: "-3"}))
	h.SetTemplate("plain", labelled(nil))
	for _, c := range []struct {
		name       string
		in         Options
		mem, pids  int64
		wantMemMax bool
	}{
		{name: "desktop", in: Options{Template: "desktop"}, mem: 2 << 30, pids: 1024},
		// What the create names wins over the template's default.
		{name: "desktop", in: Options{Template: "desktop", Memory: 600 << 20, Pids: 300}, mem: 600 << 20, pids: 300},
		// A default above the operator's maximum is held to it, not refused.
		{name: "desktop", in: Options{Template: "desktop", Max: Maxima{Memory: 1 << 30, Pids: 700}}, mem: 1 << 30, pids: 700},
		{name: "huge", in: Options{Template: "huge"}, wantMemMax: true},
		// Labels that do not parse, no labels, no such template: untouched.
		{name: "bad", in: Options{Template: "bad"}},
		{name: "plain", in: Options{Template: "plain"}},
		{name: "missing", in: Options{Template: "missing"}},
	} {
		o := c.in
		h.TemplateDefaults(&o)
		if c.wantMemMax {
			m := Maxima{}.orHost()
			if o.Memory != m.Memory || o.Pids != m.Pids {
				t.Errorf("%s: memory %d, pids %d; want the host's maxima %d, %d", c.name, o.Memory, o.Pids, m.Memory, m.Pids)
			}
			continue
		}
		if o.Memory != c.mem || o.Pids != c.pids {
			t.Errorf("%s %+v: memory %d, pids %d; want %d, %d", c.name, c.in, o.Memory, o.Pids, c.mem, c.pids)
		}
		if err := o.Validate(); err != nil && c.name == "desktop" {
			t.Errorf("%s: the defaults do not validate: %v", c.name, err)
		}
	}
}
