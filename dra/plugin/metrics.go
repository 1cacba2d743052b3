package plugin

import (
	"fmt"
	"path/filepath"

	"github.com/passage-boot/passage/manifest"
)

// hookExportFailures is the counter Config.MetricsFile holds: what the log line counts.
const hookExportFailures = "passage_dra_hook_export_failures_total"

// writeMetrics writes the plugin's counters into Config.MetricsFile in the text
// exposition format (0.0.4) node_exporter's textfile collector reads, as passage's boot
// writes passage.prom: the plugin serves no HTTP of its own. A file that cannot be
// written is logged; the counters carry on in memory.
func (d *Driver) writeMetrics() {
	p := d.cfg.MetricsFile
	if p == "" {
		return
	}
	b := fmt.Appendf(nil, "# HELP %s Exports to the hook dir (the verified manifest for passage-hook) that failed since the plugin started.\n# TYPE %s counter\n%s %d\n",
		hookExportFailures, hookExportFailures, hookExportFailures, d.exportFailures.Load())
	if err := manifest.WriteAtomic(filepath.Dir(p), filepath.Base(p), b); err != nil {
		d.logf("metrics: %v", err)
	}
}
