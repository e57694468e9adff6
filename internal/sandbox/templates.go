package sandbox

import (
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

func (ts *templates) lookup(h *Host, name string) (*template.Template, error) {
	ts.mu.Lock()
	t := ts.extra[name]
	ts.mu.Unlock()
	if t != nil {
		return t, nil
	}
	return template.Lookup(name, filepath.Join(h.RunDir, "templates"), h.Templates)
}

// Template resolves a template name as a create would.
func (h *Host) Template(name string) (*template.Template, error) { return h.tmpl.lookup(h, name) }

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
