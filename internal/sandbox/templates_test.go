package sandbox

import (
	"testing"

	"github.com/cagehq/cage/internal/template"
)

// A build's template (set for a RUN step, Build) exists only for a build
// step's create: any other create, which a tenant's request becomes, finds
// it as it finds a name never set; a build step's create finds nothing
// else. Before, a tenant who learnt the name (the step reads it in its
// mountinfo) got a build sandbox of the build's image.
func TestBuildTemplatesOnlyForBuildSteps(t *testing.T) {
	h := &Host{}
	step := &template.Template{Name: "build-0123456789ab", Build: true}
	plain := &template.Template{Name: "plain"}
	h.SetTemplate("build-0123456789ab", step)
	h.SetTemplate("plain", plain)
	if got, err := h.tmpl.lookup(h, "build-0123456789ab", true); err != nil || got != step {
		t.Errorf("a build step's create of its template: %v, %v", got, err)
	}
	if got, err := h.tmpl.lookup(h, "build-0123456789ab", false); got == step || err == nil {
		t.Errorf("another create of a build's template: %v, %v; want not found", got, err)
	}
	if got, err := h.Template("build-0123456789ab"); got == step || err == nil {
		t.Errorf("Host.Template of a build's template: %v, %v; want not found", got, err)
	}
	if got, err := h.tmpl.lookup(h, "plain", false); err != nil || got != plain {
		t.Errorf("a template set for this host: %v, %v", got, err)
	}
	for _, name := range []string{"plain", "host", "build-ffffffffffff"} {
		if got, err := h.tmpl.lookup(h, name, true); err == nil {
			t.Errorf("a build step's create of %s: %v; want refused", name, got)
		}
	}
}
