package metrics_test

import (
	"strings"
	"testing"

	"github.com/passage-boot/passage/metrics"
)

func TestGroupURL(t *testing.T) {
	for in, want := range map[string]string{"": "/metrics/job/passage/instance@base64/=", "a/b": "/metrics/job/passage/instance@base64/YS9i"} {
		if u := metrics.GroupURL("http://gw", in); u != "http://gw"+want {
			t.Errorf("GroupURL(%q) = %s", in, u)
		}
	}
	if !strings.HasPrefix(metrics.ContentType, "text/plain; version=0.0.4") {
		t.Error(metrics.ContentType)
	}
}
