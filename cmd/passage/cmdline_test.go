package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/topology"
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

// editPlan rewrites the saved plan at path through edit, with kernel_arg made again from
// its ports as ImageArgs makes it, so that only what edit changed can be refused.
func editPlan(t *testing.T, path string, edit func(s *decision.Saved)) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	s, err := decision.ReadSaved(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	edit(s)
	var ports []topology.ACSPort
	for _, p := range s.ACS {
		if p.Offset != 0 && p.Skip == "" {
			ports = append(ports, topology.ACSPort{Addr: p.Addr, Offset: p.Offset, Mask: p.Mask, Flags: p.Flags})
		}
	}
	s.KernelArg = topology.KernelArg(ports)
	var out bytes.Buffer
	if err := s.Write(&out); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, out.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestCmdlineRefusesPortListedTwice: a saved plan listing a port twice, every ACS control
// off first and the planned entry second, would put both on the signed line, where the
// kernel applies the first; cmdline --plan refuses it, naming the plan and the port, and
// prints nothing for make uki to sign.
func TestCmdlineRefusesPortListedTwice(t *testing.T) {
	saved := filepath.Join(t.TempDir(), "b300.plan.json")
	var out, errb bytes.Buffer
	if code := cmdPlan([]string{"--root", pcitest.New(t, pcitest.B300()).Root, "-o", saved, "--erase", "off"}, &out, &errb); code != 0 {
		t.Fatalf("plan --out: exit %d: %s", code, errb.String())
	}
	var port pci.Address
	editPlan(t, saved, func(s *decision.Saved) {
		for i, p := range s.ACS {
			if p.Offset != 0 && p.Skip == "" && p.Mask&pci.ACSDT != 0 {
				port = p.Addr
				weak := p
				weak.Mask, weak.Flags = 0x7f, 0
				s.ACS = slices.Insert(s.ACS, i, weak)
				return
			}
		}
		t.Fatal("no port with DT in the plan")
	})
	out.Reset()
	errb.Reset()
	code := cmdCmdline([]string{"--plan", saved}, &out, &errb)
	if code != 2 || out.Len() != 0 || !strings.Contains(errb.String(), saved+": saved plan: acs "+port.String()+" listed twice") {
		t.Errorf("exit %d, printed %q, stderr %q; want 2, nothing, the plan and %s named", code, out.String(), errb.String(), port)
	}
}

// TestCmdlineBoundsTheLine: the kernel keeps 2047 bytes of its command line (x86
// COMMAND_LINE_SIZE 2048, the NUL included) and drops the rest silently, passage.plan=
// first. A plan of 150 ports makes an argument longer than that alone; a plan that fits
// may not fit beside the image's other arguments (--base, make uki's UKI_CMDLINE). Both
// are refused naming the lengths and the limit, and so is one of exactly 2047 bytes (the
// boot cannot tell it from a cut one); a line of 2046 bytes is not.
func TestCmdlineBoundsTheLine(t *testing.T) {
	dir := t.TempDir()
	saved := filepath.Join(dir, "b300.plan.json")
	var out, errb bytes.Buffer
	if code := cmdPlan([]string{"--root", pcitest.New(t, pcitest.B300()).Root, "-o", saved, "--erase", "off"}, &out, &errb); code != 0 {
		t.Fatalf("plan --out: exit %d: %s", code, errb.String())
	}
	run := func(args ...string) (int, string, string) {
		out.Reset()
		errb.Reset()
		code := cmdCmdline(args, &out, &errb)
		return code, out.String(), errb.String()
	}
	code, plan, errs := run("--plan", saved)
	if code != 0 {
		t.Fatalf("cmdline: exit %d: %s", code, errs)
	}
	args := strings.TrimSuffix(plan, "\n")
	uki := "console=ttyS0,115200 intel_iommu=on panic=-1 rdinit=/bbin/passage passage.profile=b300 passage.handoff=switch_root passage.root=LABEL=root"
	if code, got, errs := run("--plan", saved, "--base", uki); code != 0 || got != plan {
		t.Errorf("with the Makefile's UKI_CMDLINE (%d + 1 + %d bytes): exit %d, printed %q, stderr %q", len(uki), len(args), code, got, errs)
	}
	fits := strings.Repeat("a", decision.MaxCmdline-len(args)-1)
	if code, _, errs := run("--plan", saved, "--base", fits); code != 0 {
		t.Errorf("a line of exactly %d bytes: exit %d: %s", decision.MaxCmdline, code, errs)
	}
	code, got, errs := run("--plan", saved, "--base", fits+"a")
	want := fmt.Sprintf("the image's command line would be 2047 bytes (its other arguments %d, the plan's %d, a space between): at most 2046 sign (the kernel keeps 2047", len(fits)+1, len(args))
	if code != 2 || got != "" || !strings.Contains(errs, saved+": ") || !strings.Contains(errs, want) {
		t.Errorf("a line of 2047 bytes: exit %d, printed %q, stderr %q; want 2, nothing, %q", code, got, errs, want)
	}

	// 150 ports: the argument alone is past the limit.
	big := filepath.Join(dir, "big.plan.json")
	b, _ := os.ReadFile(saved)
	os.WriteFile(big, b, 0o644)
	editPlan(t, big, func(s *decision.Saved) {
		tmpl := s.ACS[0]
		for _, p := range s.ACS {
			if p.Offset != 0 && p.Skip == "" {
				tmpl = p
			}
		}
		var ports []decision.SavedPort
		for i := 0; i < 150; i++ {
			p := tmpl
			p.Addr = pci.Address{Domain: 1, Bus: uint8(i), Device: 2}
			ports = append(ports, p)
		}
		s.ACS = ports
	})
	code, got, errs = run("--plan", big)
	if code != 2 || got != "" || !regexp.MustCompile(`would be 3\d{3} bytes \(the plan's arguments alone\): at most 2046 sign`).MatchString(errs) {
		t.Errorf("150 ports: exit %d, printed %q, stderr %q; want 2, nothing, the length named", code, got, errs)
	}
	t.Logf("150 ports: %s", strings.TrimSpace(errs))
}

// TestUKIRefusesLineThatDoesNotFit: image/uki.sh, which signs whatever line it is given
// (make uki without PLAN= too), refuses one longer than the kernel keeps before it
// signs or writes anything (2047 bytes too: the boot cannot tell such a line from a cut
// one); a line of 2046 bytes goes on to its other checks.
func TestUKIRefusesLineThatDoesNotFit(t *testing.T) {
	out := filepath.Join(t.TempDir(), "netboot")
	run := func(line string) (int, string) {
		cmd := exec.Command("bash", filepath.Join("..", "..", "image", "uki.sh"), out, "/nonexistent/vmlinuz", "/nonexistent/initrd", line, "/nonexistent/key", "/nonexistent/cert")
		b, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatal(err)
		}
		return cmd.ProcessState.ExitCode(), string(b)
	}
	// 1,024 two-byte characters: the bound is in bytes, as the kernel counts.
	for _, line := range []string{strings.Repeat("a", 2047), strings.Repeat("a", 2048), strings.Repeat("é", 1024)} {
		code, msg := run(line)
		want := fmt.Sprintf("uki: the command line is %d bytes, at most 2046 sign (the kernel keeps 2047", len(line))
		if code != 1 || !strings.Contains(msg, want) {
			t.Errorf("a line of %d bytes: exit %d: %s", len(line), code, msg)
		}
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Errorf("uki.sh made %s for a line it refused: %v", out, err)
	}
	if code, msg := run(strings.Repeat("a", 2046)); code != 1 || !strings.Contains(msg, "/nonexistent/vmlinuz: missing or empty") {
		t.Errorf("a line of 2046 bytes: exit %d: %s, want past the length to the missing kernel", code, msg)
	}
}
