package sandbox

import (
	"fmt"
	"path/filepath"
	"sync"

	"github.com/cagehq/cage/internal/template"
)

// templates resolves template names: the built-in host, the store's
// images, and templates set for this Host alone (SetTemplate).
type templates struct {
	mu    sync.Mutex
	extra map[string]*template.Template
}

// A build's template (Build) is found only for a build step's create
// (buildStep), which finds nothing else; for any other create it is as if
// it did not exist.
func (ts *templates) lookup(h *Host, name string, buildStep bool) (*template.Template, error) {
	ts.mu.Lock()
	t := ts.extra[name]
	ts.mu.Unlock()
	switch {
	case buildStep && (t == nil || !t.Build):
		return nil, fmt.Errorf("%w: %q is not a template build's", ErrInvalid, name)
	case t != nil && t.Build == buildStep:
		return t, nil
	}
	return template.Lookup(name, filepath.Join(h.RunDir, "templates"), h.Templates)
}

// Template resolves a template name as a create would (not a build
// step's).
func (h *Host) Template(name string) (*template.Template, error) {
	return h.tmpl.lookup(h, name, false)
}

// SetTemplate makes name resolve to t in this Host (nil: forget it): a
// template build runs its steps from templates that exist only here.
func (h *Host) SetTemplate(name string, t *template.Template) {
	h.tmpl.mu.Lock()
	defer h.tmpl.mu.Unlock()
	if h.tmpl.extra == nil {
		h.tmpl.extra = map[string]*template.Template{}
	}
	if t == nil {
		delete(h.tmpl.extra, name)
	} else {
		h.tmpl.extra[name] = t
	}
}
