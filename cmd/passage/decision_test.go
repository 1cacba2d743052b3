package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/apply"
	"github.com/passage-boot/passage/apply/applytest"
	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/erase/erasetest"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/stages/boot"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"
	"github.com/passage-boot/passage/vfiobind/vfiotest"
)

// variant is a reference node with one thing real nodes get wrong.
type variant struct {
	name    string
	profile string
	spec    func() pcitest.Spec
	files   map[string]string // extra files under the root (lockdown)
	// unit and want: the verdict the variant must give that unit (the test proves the
	// variant bites, not only that the commands agree).
	unit int
	want string
	// image is the signed image's plan on the command line (nil: none), and what the
	// kernel made of it.
	image *imageKernel
}

// imageKernel is a boot from an image planned on the reference B300 (make uki PLAN=):
// its pci=config_acs= and passage.plan= on the command line, and a 6.12 kernel that set
// the listed ports and logged it before passage ran.
type imageKernel struct {
	drop    int  // a unit failed on the node the image was planned on (its ports left out: another topology); -1 none
	unset   int  // a unit whose ports the kernel did not set; -1 none
	refused bool // the kernel's log says it could not parse the argument
	// twice is a unit whose NIC port the line lists twice, DT off first and the plan's
	// entry second (an image not made by passage cmdline, which refuses such a plan): the
	// kernel applies the first entry and stops (__pci_config_acs); -1 none.
	twice int
	// cut: the line is what the kernel kept of a longer one, decision.KernelKeeps bytes
	// ending in the space before the argument it dropped. /proc/cmdline holds it as kept
	// (then '\n'): every reader must count that space, or the line reads as one byte
	// shorter, whole, and the image's plan matched.
	cut bool
}

func b300With(edit func(s *pcitest.Spec)) func() pcitest.Spec {
	return func() pcitest.Spec {
		s := pcitest.B300()
		edit(&s)
		return s
	}
}

func variants() []variant {
	hostNIC := pcitest.Fn{Name: "hostnic", Func: 1, Vendor: pcitest.VendorBCMNet, Device: pcitest.DevBCM57414, SubVendor: pcitest.VendorBCMNet,
		SubDevice: 0x1402, Class: pcitest.ClassEthernet, Port: pci.PortEndpoint, Link: pcitest.Link{Speed: pcitest.Gen4, Width: 4}, Driver: "bnxt_en"}
	return []variant{
		{name: "reference", spec: pcitest.B300, unit: 0, want: "ready"},
		{name: "no-ats", spec: b300With(func(s *pcitest.Spec) {
			s.Fn("nic0.0").ATS, s.Fn("nic0.1").ATS = nil, nil
		}), unit: 0, want: "degraded"},
		{name: "no-ats-require", spec: b300With(func(s *pcitest.Spec) { s.Fn("nic1.1").ATS = nil }),
			files: map[string]string{"proc/cmdline": "passage.ats=require"}, unit: 1, want: "failed"},
		{name: "port-without-acs", spec: b300With(func(s *pcitest.Spec) { s.Fn("gpu-dsp1").ACS = nil }), unit: 1, want: "failed"},
		{name: "nic-port-without-dt", spec: b300With(func(s *pcitest.Spec) {
			s.Fn("cx-dsp-nic2").ACS = &pcitest.ACS{Cap: pci.ACSIsolation, Ctl: pci.ACSIsolation}
		}), unit: 2, want: "degraded"},
		{name: "no-iommu-groups", spec: b300With(func(s *pcitest.Spec) { s.NoIOMMU = true }), unit: 3, want: "failed"},
		{name: "nvme-shares-group-with-host-nic", spec: b300With(func(s *pcitest.Spec) {
			dsp := s.Fn("bcm-dsp-nvme2")
			dsp.Below = append(dsp.Below, hostNIC)
		}), unit: 2, want: "failed"},
		{name: "host-nic-in-gpu-group", spec: b300With(func(s *pcitest.Spec) {
			dsp := s.Fn("gpu-dsp3")
			dsp.Below = append(dsp.Below, hostNIC)
		}), unit: 3, want: "failed"},
		{name: "placeholder-class-0880", spec: b300With(func(s *pcitest.Spec) {
			for i := 0; i < 8; i++ {
				s.Fn(fmt.Sprintf("holder%d", i)).Class = 0x088000
			}
		}), unit: 0, want: "ready"},
		{name: "placeholder-class-0b40", spec: pcitest.B300, unit: 0, want: "ready"},
		{name: "nvswitch-mgmt-class-0880", spec: b300With(func(s *pcitest.Spec) {
			for k := 0; k < 4; k++ {
				s.Fn(fmt.Sprintf("nvswitch%d", k)).Class = 0x088000
			}
		}), unit: 0, want: "ready"},
		{name: "b200-mgmt-endpoint-class-0880", profile: "b200", spec: func() pcitest.Spec {
			s := pcitest.B200()
			for i := 0; i < 8; i++ {
				s.Fn(fmt.Sprintf("bcm-mgmt%d", i)).Class = 0x088000
			}
			return s
		}, unit: 0, want: "ready"},
		{name: "b200-mgmt-endpoint-class-0b40", profile: "b200", spec: pcitest.B200, unit: 0, want: "ready"},
		{name: "sriov-active", spec: b300With(func(s *pcitest.Spec) {
			s.Fn("nic4.0").SRIOV = &pcitest.SRIOV{Total: 8, Num: 2, VFDevice: pcitest.DevCX8VF, VFDriver: "mlx5_core"}
		}), unit: 4, want: "failed"},
		{name: "unit-missing-nvme", spec: b300With(func(s *pcitest.Spec) { s.Fn("bcm-dsp-nvme5").Below = nil }), unit: 5, want: "ready"},
		{name: "lockdown-integrity", spec: pcitest.B300,
			files: map[string]string{"sys/kernel/security/lockdown": "none [integrity] confidentiality\n"}, unit: 6, want: "degraded"},
		{name: "lockdown-image-plan", spec: pcitest.B300, files: lockedDown612, image: &imageKernel{drop: -1, unset: -1, twice: -1}, unit: 6, want: "ready"},
		{name: "lockdown-image-plan-not-set", spec: pcitest.B300, files: lockedDown612, image: &imageKernel{drop: -1, unset: 6, twice: -1}, unit: 6, want: "degraded"},
		{name: "lockdown-image-plan-refused", spec: pcitest.B300, files: lockedDown612, image: &imageKernel{drop: -1, unset: 6, refused: true, twice: -1}, unit: 6, want: "degraded"},
		{name: "lockdown-image-other-topology", spec: pcitest.B300, files: lockedDown612, image: &imageKernel{drop: 6, unset: -1, twice: -1}, unit: 6, want: "failed"},
		// The port's isolation holds, DT does not: judged by the plan's own (second) entry
		// the unit would be degraded; the kernel applied the first, so the image does not
		// carry this node's plan for it.
		{name: "lockdown-image-port-twice", spec: pcitest.B300, files: lockedDown612, image: &imageKernel{drop: -1, unset: -1, twice: 4}, unit: 4, want: "failed"},
		{name: "image-plan-unlocked", spec: pcitest.B300, image: &imageKernel{drop: 2, unset: 3, twice: -1}, unit: 3, want: "ready"},
		{name: "lockdown-image-plan-cut-off", spec: pcitest.B300, files: lockedDown612, image: &imageKernel{drop: -1, unset: -1, twice: -1, cut: true}, unit: 6, want: "ready"},
	}
}

// lockedDown612 is a Secure Boot node's kernel: 6.12, locked down.
var lockedDown612 = map[string]string{
	"sys/kernel/security/lockdown": "none [integrity] confidentiality\n",
	"proc/sys/kernel/osrelease":    "6.12.117+deb13-amd64\n",
}

// bootImage plays the image's kernel on the tree under root: the image built as make uki
// PLAN=F builds it, from a reference node's saved plan (passage plan -o) through
// decision.ImageArgs, then the ports the kernel set and its log. It returns the command
// line words the image adds and the kernel log. With drop, the reference node's unit
// drop failed when it was planned (its GPU port without ACS): the image lacks the ports
// that unit alone holds.
func bootImage(t *testing.T, root string, im *imageKernel) (cmdline, kmsg string) {
	t.Helper()
	spec := pcitest.B300
	if im.drop >= 0 {
		spec = b300With(func(s *pcitest.Spec) { s.Fn(fmt.Sprintf("gpu-dsp%d", im.drop)).ACS = nil })
	}
	refRoot := pcitest.New(t, spec()).Root
	saved := filepath.Join(t.TempDir(), "reference.plan.json")
	var out, errb bytes.Buffer
	if code := cmdPlan([]string{"--root", refRoot, "--profile", "b300", "-o", saved}, &out, &errb); code == 2 {
		t.Fatalf("passage plan -o of the reference node: exit 2: %s", errb.String())
	}
	b, err := os.ReadFile(saved)
	if err != nil {
		t.Fatal(err)
	}
	words, err := decision.ImageArgs(b)
	if err != nil {
		t.Fatalf("the image's arguments from the reference node's plan: %v", err)
	}
	ref, err := pci.Scan(refRoot)
	if err != nil {
		t.Fatal(err)
	}
	p, err := topology.Builtin("b300")
	if err != nil {
		t.Fatal(err)
	}
	d, err := decision.Decide(decision.Input{Tree: ref, Profile: p, Erase: erase.PolicyOff})
	if err != nil {
		t.Fatal(err)
	}
	var set []topology.ACSPort
	for _, port := range d.ACS {
		if port.Skip != "" || slices.Contains(port.Units(), topology.UnitID(im.unset)) {
			continue
		}
		if im.twice >= 0 && port.Unit == topology.UnitID(im.twice) && port.Position == "nic-port" {
			port.Flags &^= pci.ACSDT
			weak := topology.KernelArg([]topology.ACSPort{port})
			words = strings.Replace(words, "pci=config_acs=", weak+";", 1)
		}
		if im.drop >= 0 && port.Unit == topology.UnitID(im.drop) {
			t.Fatalf("the reference node's failed unit %d still has port %s to set", im.drop, port.Addr)
		}
		set = append(set, port)
	}
	log, err := applytest.KernelSets(pci.SysfsConfig{Root: root}, set)
	if err != nil {
		t.Fatal(err)
	}
	if im.refused {
		log = append(log, "6,399,900000,-;PCI: Can't parse ACS command line parameter")
	}
	return words, strings.Join(log, "\n") + "\n"
}

// erasePolicies are the erase policies every variant runs under.
var erasePolicies = []string{"off", "auto", "require"}

// buildVariant builds a fresh tree of v (every command that writes gets its own) with
// passage.erase=policy on its command line: every command reads it, as the boot does.
// Every function has a reset method and every NVMe a simulated controller (nvme) holding
// a tenant's data, for the boot's erase step.
func buildVariant(t *testing.T, v variant, policy string) (root string, nvme erase.Opener) {
	t.Helper()
	n := pcitest.New(t, v.spec())
	files := map[string]string{"proc/cmdline": "passage.erase=" + policy}
	for name, body := range v.files {
		if name == "proc/cmdline" {
			body += " " + files[name]
		}
		files[name] = body
	}
	if v.image != nil {
		words, log := bootImage(t, n.Root, v.image)
		files["proc/cmdline"] += " " + words
		files[decision.KernelLogFile] = log
		if v.image.cut {
			line := files["proc/cmdline"] + " pad="
			files["proc/cmdline"] = line + strings.Repeat("x", decision.KernelKeeps-len(line)-1) + " "
		}
	}
	// The kernel ends /proc/cmdline with a newline (cmdline_proc_show).
	files["proc/cmdline"] += "\n"
	tree, err := pci.Scan(n.Root)
	if err != nil {
		t.Fatal(err)
	}
	ctrls := map[pci.Address]*erasetest.Controller{}
	for _, d := range tree.Devices {
		dir := filepath.Join(pci.DevicesDir, d.Addr.String())
		files[filepath.Join(dir, "reset_method")] = "flr bus\n"
		files[filepath.Join(dir, "reset")] = ""
		if d.Class == pcitest.ClassNVMe {
			c := erasetest.New("S"+d.Addr.String(), erase.SANICAPCES|erase.SANICAPBES, 0, true, erasetest.Namespace{NSID: 1, Blocks: 1 << 16})
			c.Write(1, 0, bytes.Repeat([]byte{0xa5}, 512))
			ctrls[d.Addr] = c
		}
	}
	for name, body := range files {
		p := filepath.Join(n.Root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return n.Root, func(_ context.Context, a pci.Address) (erase.Controller, string, error) {
		if c := ctrls[a]; c != nil {
			return c, "nvme", nil
		}
		return nil, "", fmt.Errorf("%s: %w", a, erase.ErrNoController)
	}
}

// imagePlanDoc is what plan --json and the signed manifest share of the image's plan.
type imagePlanDoc struct {
	Matched     bool     `json:"matched"`
	Differences []string `json:"differences"`
}

// verdicts is unit -> "status: reason; reason".
type verdicts map[string]string

// commandDoc is what plan --json, apply --json and the manifest share: units with their
// verdicts, the kernel argument, and (apply) the ACS changes.
type commandDoc struct {
	Units []struct {
		ID      string   `json:"id"`
		Status  string   `json:"status"`
		Reasons []string `json:"reasons"`
	} `json:"units"`
	KernelArg string `json:"kernel_arg"`
	// ImagePlan is how the node compares with the plan the boot image's command line
	// carries (plan's image_plan, the manifest's).
	ImagePlan *imagePlanDoc `json:"image_plan"`
	// ACS is plan's targets or apply's report (applyChanges reads the latter).
	ACS json.RawMessage `json:"acs"`
}

// applyChanges are the ACS changes of apply --json.
func (doc commandDoc) applyChanges(t *testing.T) []apply.Change {
	t.Helper()
	var rep apply.Report
	if err := json.Unmarshal(doc.ACS, &rep); err != nil {
		t.Fatalf("apply's acs report: %v", err)
	}
	return rep.Changes
}

func parseCommandDoc(t *testing.T, what, out string) commandDoc {
	t.Helper()
	var doc commandDoc
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		t.Fatalf("%s: %v\n%s", what, err, out)
	}
	return doc
}

func (doc commandDoc) verdicts() verdicts {
	vs := verdicts{}
	for _, u := range doc.Units {
		vs[u.ID] = u.Status + ": " + strings.Join(u.Reasons, "; ")
	}
	return vs
}

func unitVerdicts(t *testing.T, what, out string) (verdicts, string) {
	t.Helper()
	doc := parseCommandDoc(t, what, out)
	return doc.verdicts(), doc.KernelArg
}

// writtenForFailed are the ACS changes applied on a port whose units all end failed:
// config space written for nothing any guest receives.
func writtenForFailed(changes []apply.Change, vs verdicts) []string {
	var out []string
	for _, c := range changes {
		if c.Result != apply.ResultApplied {
			continue
		}
		all := true
		for _, id := range c.Units() {
			all = all && strings.HasPrefix(vs[id.String()], "failed:")
		}
		if all {
			out = append(out, c.String())
		}
	}
	return out
}
func simulatedKernel(t *testing.T, root string) *vfiotest.Kernel {
	t.Helper()
	k, err := vfiotest.New(root)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// bootRun is what the boot's stages ended with.
type bootRun struct {
	verdicts  verdicts
	kernelArg string
	worst     stages.Status
	changes   []apply.Change
	imagePlan *imagePlanDoc
}

// runBootStages runs the boot's stages from scan to manifest on root, erasing through
// simulated controllers (nvme) and binding through a simulated kernel.
func runBootStages(t *testing.T, root, profile string, nvme erase.Opener) bootRun {
	t.Helper()
	k := simulatedKernel(t, root)
	if err := k.Load(vfiobind.Modules...); err != nil {
		t.Fatal(err)
	}
	cfg := initramfs.Defaults()
	cfg.Profile, cfg.Net, cfg.TPM = profile, initramfs.NetOff, initramfs.TPMOff
	// The line as the boot reads it (cmd/passage's boot: initramfs.ReadConfig).
	if c, err := initramfs.ReadConfig(root); err == nil {
		cfg.Cmdline, cfg.ATS, cfg.Erase, cfg.Key = c.Cmdline, c.ATS, c.Erase, c.Key
	}
	b := &boot.Boot{Root: root, Config: cfg, Sysfs: k, OpenNVMe: nvme, Now: func() time.Time { return time.Unix(1e9, 0) }}
	var run []stages.Stage
	for _, s := range b.Stages() {
		switch s.Name {
		case "scan", "decide", "acs", "erase", "vfio", "manifest":
			run = append(run, s)
		}
	}
	st := &stages.State{}
	rn := &stages.Runner{Stages: run, Timeout: 10 * time.Second}
	if _, err := rn.Run(context.Background(), st); err != nil {
		t.Fatal(err)
	}
	if b.Manifest == nil {
		t.Fatal("boot wrote no manifest")
	}
	r := bootRun{verdicts: verdicts{}, kernelArg: b.Decision.KernelArg, worst: stages.OK}
	for _, u := range b.Manifest.Units {
		r.verdicts[u.ID] = u.Status + ": " + strings.Join(u.Reasons, "; ")
	}
	for _, u := range st.Units() {
		r.worst = stages.Worse(r.worst, u.Status)
	}
	if b.ACSRun != nil {
		r.changes = b.ACSRun.Changes
	}
	if im := b.Manifest.ImagePlan; im != nil {
		r.imagePlan = &imagePlanDoc{Matched: im.Matched}
		if len(im.Differences) > 0 {
			r.imagePlan.Differences = im.Differences
		}
	}
	return r
}

// sameVerdicts reports every unit on which got differs from want.
func sameVerdicts(t *testing.T, name string, got, want verdicts, wantName string) {
	t.Helper()
	if reflect.DeepEqual(got, want) {
		return
	}
	for id := range want {
		if got[id] != want[id] {
			t.Errorf("%s: %s is %q; %s says %q", name, id, got[id], wantName, want[id])
		}
	}
	if len(got) != len(want) {
		t.Errorf("%s: %d units, %s %d", name, len(got), wantName, len(want))
	}
}

func anyFailed(vs verdicts) bool {
	for _, s := range vs {
		if strings.HasPrefix(s, "failed:") {
			return true
		}
	}
	return false
}

func exitFor1(failed bool) int {
	if failed {
		return 1
	}
	return 0
}

// TestDecisionAgrees is the differential test of the decision: on every variant, under
// every erase policy, plan predicts the command it is asked for. plan (for the boot)
// gives every unit the status and reasons the boot's manifest gives, and the same kernel
// argument; plan --for apply, apply --dry-run and apply agree the same way (apply erases
// nothing, so under auto or require they differ from the boot, and the decision knows it
// before any write: no port is written whose units all end failed, by apply or the
// boot). Under erase off all four agree. The exit codes follow the verdict.
func TestDecisionAgrees(t *testing.T) {
	for _, v := range variants() {
		for _, policy := range erasePolicies {
			// Each variant builds its own trees: the subtests share nothing, and they spend
			// their time writing and reading those trees, so two at once fill both cores.
			t.Run(v.name+"/erase="+policy, func(t *testing.T) { t.Parallel(); checkAgrees(t, v, policy) })
		}
	}
}

func checkAgrees(t *testing.T, v variant, policy string) {
	profile := v.profile
	if profile == "" {
		profile = "b300"
	}
	root, _ := buildVariant(t, v, policy)
	run := func(cmd func([]string, io.Writer, io.Writer) int, what string, args ...string) (commandDoc, int) {
		var out, errb bytes.Buffer
		code := cmd(append([]string{"--root", root, "--profile", profile, "--json"}, args...), &out, &errb)
		return parseCommandDoc(t, what, out.String()), code
	}
	planBoot, planBootCode := run(cmdPlan, "plan")
	planApply, planApplyCode := run(cmdPlan, "plan --for apply", "--for", "apply")
	dry, dryCode := run(cmdApply, "apply --dry-run", "--dry-run")

	root2, _ := buildVariant(t, v, policy)
	k := simulatedKernel(t, root2)
	env := applyEnv{sysfs: func(string) vfiobind.Sysfs { return k },
		modules: func(string, string) vfiobind.ModuleLoader { return k }}
	var out, errb bytes.Buffer
	applyCode := runApply([]string{"--root", root2, "--profile", profile, "--json"}, &out, &errb, env)
	applied := parseCommandDoc(t, "apply", out.String())
	if errb.Len() > 0 {
		t.Errorf("apply stderr: %s", errb.String())
	}

	bootRoot, nvme := buildVariant(t, v, policy)
	booted := runBootStages(t, bootRoot, profile, nvme)

	pb, pa := planBoot.verdicts(), planApply.verdicts()
	if len(pb) == 0 {
		t.Fatalf("plan found no units")
	}
	sameVerdicts(t, "boot manifest", booted.verdicts, pb, "plan")
	sameVerdicts(t, "apply --dry-run", dry.verdicts(), pa, "plan --for apply")
	sameVerdicts(t, "apply", applied.verdicts(), dry.verdicts(), "apply --dry-run")
	if policy == "off" {
		sameVerdicts(t, "plan --for apply", pa, pb, "plan (for the boot)")
	}
	if !reflect.DeepEqual(booted.imagePlan, planBoot.ImagePlan) {
		t.Errorf("boot manifest's image plan %+v, plan's %+v", booted.imagePlan, planBoot.ImagePlan)
	}
	if v.image != nil && v.image.cut && (planBoot.ImagePlan == nil || planBoot.ImagePlan.Matched) {
		t.Errorf("a line the kernel may have cut: plan's image plan %+v, want it unmatched", planBoot.ImagePlan)
	}
	if booted.kernelArg != planBoot.KernelArg {
		t.Errorf("boot kernel argument %q, plan %q", booted.kernelArg, planBoot.KernelArg)
	}
	for name, arg := range map[string]string{"apply --dry-run": dry.KernelArg, "apply": applied.KernelArg} {
		if arg != planApply.KernelArg {
			t.Errorf("%s kernel argument %q, plan --for apply %q", name, arg, planApply.KernelArg)
		}
	}
	for _, c := range writtenForFailed(applied.applyChanges(t), applied.verdicts()) {
		t.Errorf("apply wrote a port whose units all end failed: %s", c)
	}
	for _, c := range writtenForFailed(booted.changes, booted.verdicts) {
		t.Errorf("the boot wrote a port whose units all end failed: %s", c)
	}

	id := fmt.Sprintf("gpu%d", v.unit)
	t.Logf("%s: boot %s; apply %s; kernel argument %q", id, pb[id], pa[id], planBoot.KernelArg)
	if !strings.HasPrefix(pb[id], v.want+":") {
		t.Errorf("%s: %s, want %s", id, pb[id], v.want)
	}
	if policy != "off" {
		// apply erases nothing: every unit carries the reason, at least as bad as the
		// policy makes it.
		for uid, s := range pa {
			bad := strings.HasPrefix(s, "failed:") || (policy == "auto" && strings.HasPrefix(s, "degraded:"))
			if !bad || !strings.Contains(s, "erase ("+policy+"): not run: apply does not erase") {
				t.Errorf("plan --for apply under erase=%s: %s %s", policy, uid, s)
			}
		}
	}
	wantBoot, wantApply := exitFor1(anyFailed(pb)), exitFor1(anyFailed(pa))
	if planBootCode != wantBoot || planApplyCode != wantApply || dryCode != wantApply || applyCode != wantApply {
		t.Errorf("exit codes plan %d (want %d), plan --for apply %d, apply --dry-run %d, apply %d (want %d)",
			planBootCode, wantBoot, planApplyCode, dryCode, applyCode, wantApply)
	}
	if anyFailed(pb) != (booted.worst == stages.Failed) {
		t.Errorf("boot's units end %s; plan has a failed unit: %v", booted.worst, anyFailed(pb))
	}
}
