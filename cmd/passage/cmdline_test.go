package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
)

// TestCmdlineBakesThePlan: the operator's path to a Secure Boot node. plan --out on a
// reference node, cmdline --plan prints what `make uki PLAN=` bakes into the signed
// command line; a node of the same SKU, booted from it with a locked-down kernel that
// programmed the argument, plans every unit ready with the image's digest matched.
func TestCmdlineBakesThePlan(t *testing.T) {
	ref := pcitest.New(t, pcitest.B300()).Root
	saved := filepath.Join(t.TempDir(), "b300.plan.json")
	var out, errb bytes.Buffer
	if code := cmdPlan([]string{"--root", ref, "-o", saved, "--erase", "off"}, &out, &errb); code != 0 {
		t.Fatalf("plan --out: exit %d: %s", code, errb.String())
	}
	out.Reset()
	errb.Reset()
	if code := cmdCmdline([]string{"--plan", saved}, &out, &errb); code != 0 {
		t.Fatalf("cmdline: exit %d: %s", code, errb.String())
	}
	b, err := os.ReadFile(saved)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b)
	digest := "sha256:" + hex.EncodeToString(sum[:])
	args := strings.Fields(out.String())
	if len(args) != 2 || !strings.HasPrefix(args[0], "pci=config_acs=") || args[1] != "passage.plan="+digest {
		t.Fatalf("cmdline printed %q, want pci=config_acs=... passage.plan=%s", out.String(), digest)
	}
	s, err := decision.ReadSaved(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	if args[0] != s.KernelArg {
		t.Errorf("argument %q, the plan's %q", args[0], s.KernelArg)
	}

	// The node: its kernel (6.12, locked down) set every planned port from the argument.
	node := pcitest.New(t, pcitest.B300()).Root
	cfg := pci.SysfsConfig{Root: node}
	for _, p := range s.ACS {
		if p.Skip == "" && p.Offset != 0 {
			if _, err := pci.WriteRegister(cfg, p.Addr, p.Offset+pci.ACSCtlReg, 2, uint32(p.Target)); err != nil {
				t.Fatal(err)
			}
		}
	}
	for name, content := range map[string]string{
		"proc/cmdline":                 "console=ttyS0 " + out.String(),
		"proc/sys/kernel/osrelease":    "6.12.117+deb13-amd64\n",
		"sys/kernel/security/lockdown": "none [integrity] confidentiality\n",
	} {
		p := filepath.Join(node, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out.Reset()
	errb.Reset()
	if code := cmdPlan([]string{"--root", node, "--erase", "off", "--json"}, &out, &errb); code != 0 {
		t.Fatalf("plan on the node: exit %d: %s", code, errb.String())
	}
	var doc struct {
		Units []struct {
			ID      string   `json:"id"`
			Status  string   `json:"status"`
			Reasons []string `json:"reasons"`
		} `json:"units"`
		ImagePlan *decision.ImagePlan `json:"image_plan"`
	}
	if err := json.Unmarshal(out.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Units) != 8 {
		t.Fatalf("%d units", len(doc.Units))
	}
	for _, u := range doc.Units {
		if u.Status != "ready" {
			t.Errorf("unit %s: %s %q, want ready: the kernel set every port", u.ID, u.Status, u.Reasons)
		}
	}
	if ip := doc.ImagePlan; ip == nil || ip.Digest != digest || !ip.Matched {
		t.Errorf("image plan %+v, want digest %s matched", ip, digest)
	}

	for _, bad := range [][]string{{}, {"--plan", filepath.Join(t.TempDir(), "none.json")}, {"--plan", node}} {
		if code := cmdCmdline(bad, &out, &errb); code != 2 {
			t.Errorf("cmdline %q: exit %d, want 2", bad, code)
		}
	}
}

// TestCmdlineRefusesEditedPlan: a saved plan whose kernel_arg was edited to carry anything
// besides the entries its ports make (another argument after a separator the kernel
// splits on, another pci= option after a comma, shell text for the Makefile) is refused,
// naming the plan file, and nothing is printed for `make uki` to sign.
func TestCmdlineRefusesEditedPlan(t *testing.T) {
	ref := pcitest.New(t, pcitest.B300()).Root
	dir := t.TempDir()
	saved := filepath.Join(dir, "b300.plan.json")
	var out, errb bytes.Buffer
	if code := cmdPlan([]string{"--root", ref, "-o", saved, "--erase", "off"}, &out, &errb); code != 0 {
		t.Fatalf("plan --out: exit %d: %s", code, errb.String())
	}
	b, err := os.ReadFile(saved)
	if err != nil {
		t.Fatal(err)
	}
	var plan map[string]any
	if err := json.Unmarshal(b, &plan); err != nil {
		t.Fatal(err)
	}
	arg := plan["kernel_arg"].(string)
	for name, edited := range map[string]string{
		"carriage return":      arg + "\rrdinit=/bin/sh",
		"vertical tab":         arg + "\vrdinit=/bin/sh",
		"form feed":            arg + "\frdinit=/bin/sh",
		"NUL":                  arg + "\x00rdinit=/bin/sh",
		"no-break space":       arg + "\u00a0rdinit=/bin/sh",
		"comma, acs redirect":  arg + ",disable_acs_redir=pci:*",
		"comma, noats":         arg + ",noats",
		"command substitution": arg + "$(reboot)",
		"backquote":            arg + "`reboot`",
		"semicolon command":    arg + "; reboot",
		"pipe":                 arg + "|sh",
		"entry inside a flag":  strings.Replace(arg, "@", "\r@", 1),
	} {
		plan["kernel_arg"] = edited
		nb, err := json.Marshal(plan)
		if err != nil {
			t.Fatal(err)
		}
		f := filepath.Join(dir, "edited.json")
		if err := os.WriteFile(f, nb, 0o644); err != nil {
			t.Fatal(err)
		}
		out.Reset()
		errb.Reset()
		code := cmdCmdline([]string{"--plan", f}, &out, &errb)
		if code != 2 || out.Len() != 0 || !strings.Contains(errb.String(), f+": saved plan: kernel_arg") {
			t.Errorf("%s: exit %d, printed %q, stderr %q; want 2, nothing, the plan named", name, code, out.String(), errb.String())
		}
	}
}
