package resources

import (
	"fmt"
	"io"

	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/yaml"
)

// List is every object in the order a cluster takes them: the class, the templates,
// then the slices.
func (o *Objects) List() []runtime.Object {
	out := []runtime.Object{o.Class}
	for _, t := range o.Templates {
		out = append(out, t)
	}
	for _, t := range o.DegradedTemplates {
		out = append(out, t)
	}
	for _, t := range o.NVLinkTemplates {
		out = append(out, t)
	}
	for _, s := range o.Slices {
		out = append(out, s)
	}
	return out
}

// WriteYAML writes the objects as one YAML stream, a document each.
func WriteYAML(w io.Writer, objs []runtime.Object) error {
	for i, obj := range objs {
		b, err := yaml.Marshal(obj)
		if err != nil {
			return fmt.Errorf("%T: %w", obj, err)
		}
		if i > 0 {
			if _, err := io.WriteString(w, "---\n"); err != nil {
				return err
			}
		}
		if _, err := w.Write(b); err != nil {
			return err
		}
	}
	return nil
}
