package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"

	"github.com/passage-boot/passage/hypervisor"
	"github.com/passage-boot/passage/manifest"
)

// cmdVerify is the hypervisor side: check a manifest envelope against the node's key
// and the hypervisor's expectations, then print a summary (or the payload, --json).
// Exit 1 names the reason a manifest is refused; exit 2 is a usage or file problem.
func cmdVerify(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("verify", stderr)
	var vf verifyFlags
	vf.register(fs)
	asJSON := fs.Bool("json", false, "print the signed payload instead of a summary (with --by-unit: the units document)")
	var af attestFlags
	af.register(fs)
	// --by-unit, not --units: --unit is a unit list in every command that takes one.
	unitsView := fs.Bool("by-unit", false, "print the manifest unit by unit: status, reasons, NUMA node, host functions, guest placement (manifest/SCHEMA.md)")
	deprecatedBoolAlias(fs, "units", "by-unit")
	paths, code, ok := parseFlags(fs, args, stdout)
	if !ok {
		return code
	}
	if len(paths) == 0 {
		fmt.Fprintln(stderr, "passage verify: give a MANIFEST (or a fleet's files and directories); see passage help verify")
		return 2
	}
	if manyPaths(paths) {
		keyFile, opts, code := vf.options("verify", stderr)
		if code != 0 {
			return code
		}
		if *asJSON || *unitsView || af.att != "" {
			fmt.Fprintln(stderr, "passage verify: --json, --by-unit and --attest take one manifest")
			return 2
		}
		return verifyMany(paths, keyFile, vf.tpmPub != "", opts, stdout, stderr)
	}
	if af.att != "" && vf.tpmPub == "" {
		fmt.Fprintln(stderr, "passage verify: --attest vouches for the TPM key: give --tpm-pub")
		return 2
	}
	got, signer, code := vf.verify("verify", paths[0], stderr)
	if got == nil {
		return code
	}
	var attested []string
	if af.att != "" {
		if attested, code = af.check(paths[0], got, vf.tpmPub, stderr); code != 0 {
			return code
		}
	}
	if *unitsView {
		return printUnits(stdout, stderr, paths[0], got, *asJSON)
	}
	if *asJSON {
		stdout.Write(got.Payload)
		fmt.Fprintln(stdout)
		return 0
	}
	printSummary(stdout, paths[0], got, signer)
	for _, l := range attested {
		fmt.Fprintf(stdout, "  %s\n", l)
	}
	return 0
}

// printUnits prints the units view of a verified manifest (hypervisor.Units).
func printUnits(stdout, stderr io.Writer, path string, v *manifest.Verified, asJSON bool) int {
	doc, err := hypervisor.Units(v)
	if err != nil {
		fmt.Fprintf(stderr, "passage verify: %s: REFUSED: %v\n", path, err)
		return 1
	}
	if asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		err = enc.Encode(doc)
	} else {
		err = doc.WriteText(stdout)
	}
	if err != nil {
		fmt.Fprintf(stderr, "passage verify: %v\n", err)
		return 1
	}
	return 0
}

// builtBy names the passage build that signed m (the signer's key is another line's);
// a schema 2 manifest does not say.
func builtBy(m *manifest.Manifest) string {
	if m.Build == nil {
		return fmt.Sprintf("not recorded (schema %d)", m.SchemaVersion)
	}
	return m.Build.String()
}

func printSummary(w io.Writer, path string, v *manifest.Verified, signer string) {
	m := v.Manifest
	fmt.Fprintf(w, "%s: OK, signed by %s\n", pr(path), pr(signer))
	fmt.Fprintf(w, "  payload     %s (schema %d)\n", v.Digest, m.SchemaVersion)
	fmt.Fprintf(w, "  build       %s\n", pr(builtBy(m)))
	fmt.Fprintf(w, "  node        %s serial %s uuid %s\n", pr(orDash(m.Node.Hostname)), pr(orDash(m.Node.DMISerial)), pr(orDash(m.Node.DMIUUID)))
	fmt.Fprintf(w, "  boot        %s at %s, kernel %s\n", pr(m.BootID), m.Time.Format("2006-01-02T15:04:05Z07:00"), pr(orDash(m.KernelRelease)))
	fmt.Fprintf(w, "  generation  %d (%s)\n", m.Generation, pr(string(m.GenerationSource)))
	fmt.Fprintf(w, "  profile     %s %s\n", pr(orDash(m.Profile.Name)), pr(m.Profile.Digest))
	count := map[string]int{}
	for _, u := range m.Units {
		count[u.Status]++
	}
	fmt.Fprintf(w, "  units       %d: %d ready, %d degraded, %d failed\n", len(m.Units),
		count[manifest.StatusReady], count[manifest.StatusDegraded], count[manifest.StatusFailed])
	for _, u := range m.Units {
		bdfs := make([]string, 0, len(u.Functions))
		for _, f := range u.Functions {
			bdfs = append(bdfs, pr(f.BDF+"="+f.Role))
		}
		fmt.Fprintf(w, "    %-8s %-8s numa %d  %s\n", pr(u.ID), pr(u.Status), u.NUMANode, strings.Join(bdfs, " "))
		for _, r := range u.Reasons {
			fmt.Fprintf(w, "             %s\n", pr(r))
		}
		printErase(w, u.Erase)
	}
	for _, s := range m.Stages {
		if s.Status != "ok" {
			fmt.Fprintf(w, "  stage %s: %s\n", pr(s.Name), pr(s.Status))
		}
	}
	for _, e := range m.Errors {
		fmt.Fprintf(w, "  error: %s\n", pr(e))
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
