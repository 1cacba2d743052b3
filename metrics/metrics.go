// Package metrics renders a manifest as Prometheus metrics in the text exposition format
// (version 0.0.4), for node_exporter's textfile collector and a Pushgateway. It reports
// what the manifest says (verdicts, ACS results, ATS findings, stage results) and never
// judges: a unit's status here is the decision's, copied.
//
// The format is written directly: a few families of gauges need no client library, and
// the initramfs carries this code.
package metrics

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/passage-boot/passage/buildinfo"
	"github.com/passage-boot/passage/manifest"
)

// ContentType is the exposition format's media type.
const ContentType = "text/plain; version=0.0.4; charset=utf-8"

// TextfileName is the file the boot writes beside the manifest, in the form
// node_exporter's textfile collector reads (*.prom).
const TextfileName = "passage.prom"

// Source is what the metrics are rendered from.
type Source struct {
	Manifest *manifest.Manifest
	// Signed says the manifest is a signed one (the boot's signed payload, or one that
	// passage verify accepted).
	Signed bool
	// Signer names the key that signed it (passage verify's words: key ID, key file,
	// enrolled node; the boot: its signing keys' IDs).
	Signer string
	// LiveACS is, when set, each port's ACS Control register as the node holds it now,
	// in lspci's words (pci.ACSBits.Lspci), by port address: a port whose register no
	// longer reads what the manifest recorded after the write has drifted. Nil: the
	// manifest alone, no drift metric.
	LiveACS map[string]string
}

// Unit, stage and ACS result values each get a series, 0 or 1, so that an alert can
// compare with == 1 and a dashboard can sum by status.
var (
	unitStatuses  = []string{manifest.StatusReady, manifest.StatusDegraded, manifest.StatusFailed}
	stageStatuses = []string{"ok", "degraded", "failed", "skipped"}
)

type sample struct {
	labels [][2]string
	value  float64
}

type family struct {
	name, help string
	samples    []sample
}

func (f *family) add(v float64, labels ...string) {
	s := sample{value: v}
	for i := 0; i+1 < len(labels); i += 2 {
		s.labels = append(s.labels, [2]string{labels[i], labels[i+1]})
	}
	f.samples = append(f.samples, s)
}

// Write writes the exposition of src to w. Every family is a gauge: each value is the
// state of one boot, replaced by the next boot's.
func Write(w io.Writer, src Source) error {
	m := src.Manifest
	if m == nil {
		return fmt.Errorf("metrics: no manifest")
	}
	var fams []*family
	fam := func(name, help string) *family {
		f := &family{name: name, help: help}
		fams = append(fams, f)
		return f
	}

	var build buildinfo.Info
	if m.Build != nil {
		build = *m.Build
	}
	fam("passage_build_info", "The passage build that decided and signed the manifest (unknown: a schema 2 manifest, which does not say); always 1.").
		add(1, "version", build.VersionString(), "revision", build.Rev(), "goversion", build.GoString())
	info := fam("passage_manifest_info", "The manifest's node, boot, kernel, profile and signer; always 1.")
	info.add(1, "hostname", m.Node.Hostname, "dmi_serial", m.Node.DMISerial, "dmi_uuid", m.Node.DMIUUID,
		"boot_id", m.BootID, "kernel_release", m.KernelRelease, "profile", m.Profile.Name,
		"profile_digest", m.Profile.Digest, "generation_source", string(m.GenerationSource),
		"schema_version", strconv.Itoa(m.SchemaVersion), "signer", src.Signer)
	signed := 0.0
	if src.Signed {
		signed = 1
	}
	fam("passage_manifest_signed", "1 when the metrics come from a signed (or verified) manifest, 0 from an unsigned one.").add(signed)
	fam("passage_manifest_generation", "The manifest's generation counter (monotonic across boots unless its source is none).").add(float64(m.Generation))
	fam("passage_manifest_timestamp_seconds", "When the manifest was written, in seconds since the epoch.").
		add(float64(m.Time.UnixNano()) / 1e9)
	fam("passage_manifest_errors", "Errors the manifest records (unreadable identity, malformed passage.* arguments, ...).").add(float64(len(m.Errors)))

	boot := fam("passage_boot_duration_seconds", "Time the boot's stages up to the manifest took, the sum of their durations.")
	stageDur := fam("passage_stage_duration_seconds", "Time each boot stage took.")
	stageSt := fam("passage_stage_status", "Each boot stage's status: 1 for the status it ended with, 0 for the others.")
	var total float64
	for _, s := range m.Stages {
		d := s.Duration.Seconds()
		total += d
		stageDur.add(d, "stage", s.Name)
		for _, st := range stageStatuses {
			stageSt.add(b2f(s.Status == st), "stage", s.Name, "status", st)
		}
		if !slices.Contains(stageStatuses, s.Status) {
			stageSt.add(1, "stage", s.Name, "status", s.Status)
		}
	}
	boot.add(total)

	units := fam("passage_unit_status", "Each unit's verdict from the signed decision: 1 for its status (ready, degraded, failed), 0 for the others.")
	fns := fam("passage_function_info", "Each function of a unit with its role and driver after the boot; always 1.")
	ats := fam("passage_unit_ats_missing_functions", "Functions of the unit whose ATS capability is missing (CX-8 firmware without ATS_ENABLED).")
	acs := fam("passage_acs_ports", "Ports above the unit by the ACS stage's result (applied: written; unchanged; verified: the kernel applied pci=config_acs=; mismatch; failed; ...).")
	var drift *family
	if src.LiveACS != nil {
		drift = fam("passage_acs_port_drifted", "1 when a port's ACS Control register no longer reads what the manifest recorded after the boot's write, 0 when it does.")
	}
	for _, u := range m.Units {
		for _, st := range unitStatuses {
			units.add(b2f(u.Status == st), "unit", u.ID, "status", st)
		}
		if !slices.Contains(unitStatuses, u.Status) {
			units.add(1, "unit", u.ID, "status", u.Status)
		}
		for _, f := range u.Functions {
			fns.add(1, "unit", u.ID, "bdf", f.BDF, "role", f.Role, "driver", f.DriverAfter, "vendor", f.Vendor, "device", f.Device)
		}
		missing := 0
		for _, f := range u.ATSFindings {
			// The boot writes a missing capability as a warning, a present one as info
			// (stages/boot, manifestUnits).
			if f.Severity == "warning" {
				missing++
			}
		}
		ats.add(float64(missing), "unit", u.ID)
		byResult := map[string]int{}
		for _, c := range u.ACSChanges {
			res, _, _ := strings.Cut(c.Result, ":")
			byResult[res]++
			if drift != nil && c.After != "" {
				live, ok := src.LiveACS[c.Port]
				drift.add(b2f(!ok || live != c.After), "unit", u.ID, "port", c.Port)
			}
		}
		for res, n := range byResult {
			acs.add(float64(n), "unit", u.ID, "result", res)
		}
	}

	bw := bufio.NewWriter(w)
	sort.SliceStable(fams, func(i, j int) bool { return fams[i].name < fams[j].name })
	for _, f := range fams {
		if len(f.samples) == 0 {
			continue
		}
		fmt.Fprintf(bw, "# HELP %s %s\n# TYPE %s gauge\n", f.name, escapeHelp(f.help), f.name)
		lines := make([]string, 0, len(f.samples))
		// A series given twice (a unit, function or stage the manifest lists twice)
		// makes the whole exposition invalid to a Pushgateway: the first one stands.
		seen := make(map[string]bool, len(f.samples))
		for _, s := range f.samples {
			var b strings.Builder
			b.WriteString(f.name)
			if len(s.labels) > 0 {
				b.WriteByte('{')
				for i, l := range s.labels {
					if i > 0 {
						b.WriteByte(',')
					}
					fmt.Fprintf(&b, "%s=\"%s\"", l[0], escapeLabel(l[1]))
				}
				b.WriteByte('}')
			}
			if seen[b.String()] {
				continue
			}
			seen[b.String()] = true
			b.WriteByte(' ')
			b.WriteString(formatValue(s.value))
			lines = append(lines, b.String())
		}
		sort.Strings(lines)
		for _, l := range lines {
			bw.WriteString(l)
			bw.WriteByte('\n')
		}
	}
	return bw.Flush()
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// escapeLabel escapes a label value as the text format requires: backslash, double quote
// and line feed; bytes that are not UTF-8 (which the format does not admit) become
// U+FFFD.
func escapeLabel(s string) string {
	return strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`).Replace(strings.ToValidUTF8(s, "\uFFFD"))
}

// escapeHelp escapes a HELP text: backslash and line feed.
func escapeHelp(s string) string {
	return strings.NewReplacer(`\`, `\\`, "\n", `\n`).Replace(s)
}

func formatValue(v float64) string {
	switch {
	case math.IsNaN(v):
		return "NaN"
	case math.IsInf(v, 1):
		return "+Inf"
	case math.IsInf(v, -1):
		return "-Inf"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}
