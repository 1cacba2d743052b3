package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/pci/pcitest"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/stages/boot"
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
	}
}

// buildVariant builds a fresh tree of v (every command that writes gets its own).
func buildVariant(t *testing.T, v variant) string {
	t.Helper()
	n := pcitest.New(t, v.spec())
	// Every command reads passage.erase= from the node's command line, as the boot does:
	// off here, since plan and apply erase nothing (the erase step has its own tests).
	files := map[string]string{"proc/cmdline": "passage.erase=off"}
	for name, body := range v.files {
		if name == "proc/cmdline" {
			body += " " + files[name]
		}
		files[name] = body
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
	return n.Root
}

// verdicts is unit -> "status: reason; reason".
type verdicts map[string]string

func unitVerdicts(t *testing.T, what, out string) (verdicts, string) {
	t.Helper()
	var doc struct {
		Units []struct {
			ID      string   `json:"id"`
			Status  string   `json:"status"`
			Reasons []string `json:"reasons"`
		} `json:"units"`
		KernelArg string `json:"kernel_arg"`
	}
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		t.Fatalf("%s: %v\n%s", what, err, out)
	}
	vs := verdicts{}
	for _, u := range doc.Units {
		vs[u.ID] = u.Status + ": " + strings.Join(u.Reasons, "; ")
	}
	return vs, doc.KernelArg
}

func simulatedKernel(t *testing.T, root string) *vfiotest.Kernel {
	t.Helper()
	k, err := vfiotest.New(root)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// bootVerdicts runs the boot's stages from scan to manifest on root, binding through a
// simulated kernel, and returns the manifest's units and kernel argument.
func bootVerdicts(t *testing.T, root, profile string) (verdicts, string, stages.Status) {
	t.Helper()
	k := simulatedKernel(t, root)
	if err := k.Load(vfiobind.Modules...); err != nil {
		t.Fatal(err)
	}
	cfg := initramfs.Defaults()
	cfg.Profile, cfg.Net, cfg.TPM = profile, initramfs.NetOff, initramfs.TPMOff
	if b, err := os.ReadFile(filepath.Join(root, "proc/cmdline")); err == nil {
		cfg.Cmdline = string(b)
		c := initramfs.ParseCmdline(cfg.Cmdline)
		cfg.ATS, cfg.Erase = c.ATS, c.Erase
	}
	b := &boot.Boot{Root: root, Config: cfg, Sysfs: k, Now: func() time.Time { return time.Unix(1e9, 0) }}
	var run []stages.Stage
	for _, s := range b.Stages() {
		switch s.Name {
		case "scan", "decide", "acs", "vfio", "manifest":
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
	vs := verdicts{}
	for _, u := range b.Manifest.Units {
		vs[u.ID] = u.Status + ": " + strings.Join(u.Reasons, "; ")
	}
	worst := stages.OK
	for _, u := range st.Units() {
		worst = stages.Worse(worst, u.Status)
	}
	return vs, b.Decision.KernelArg, worst
}

// TestDecisionAgrees is the differential test of the decision: on every variant, plan,
// apply --dry-run, apply and the boot's manifest give every unit the same status and
// reasons and the same kernel argument, and the exit codes follow the verdict.
func TestDecisionAgrees(t *testing.T) {
	for _, v := range variants() {
		t.Run(v.name, func(t *testing.T) {
			profile := v.profile
			if profile == "" {
				profile = "b300"
			}
			root := buildVariant(t, v)
			var out, errb bytes.Buffer
			planCode := cmdPlan([]string{"--root", root, "--profile", profile, "--json"}, &out, &errb)
			plan, planArg := unitVerdicts(t, "plan", out.String())

			out.Reset()
			errb.Reset()
			dryCode := cmdApply([]string{"--root", root, "--profile", profile, "--dry-run", "--json"}, &out, &errb)
			dry, dryArg := unitVerdicts(t, "apply --dry-run", out.String())

			root2 := buildVariant(t, v)
			k := simulatedKernel(t, root2)
			env := applyEnv{sysfs: func(string) vfiobind.Sysfs { return k },
				modules: func(string, string) vfiobind.ModuleLoader { return k }}
			out.Reset()
			errb.Reset()
			applyCode := runApply([]string{"--root", root2, "--profile", profile, "--json"}, &out, &errb, env)
			applied, applyArg := unitVerdicts(t, "apply", out.String())
			if errb.Len() > 0 {
				t.Errorf("apply stderr: %s", errb.String())
			}

			booted, bootArg, worst := bootVerdicts(t, buildVariant(t, v), profile)

			if len(plan) == 0 {
				t.Fatalf("plan found no units")
			}
			for name, got := range map[string]verdicts{"apply --dry-run": dry, "apply": applied, "boot manifest": booted} {
				if !reflect.DeepEqual(got, plan) {
					for id := range plan {
						if got[id] != plan[id] {
							t.Errorf("%s: %s is %q; plan says %q", name, id, got[id], plan[id])
						}
					}
					if len(got) != len(plan) {
						t.Errorf("%s: %d units, plan %d", name, len(got), len(plan))
					}
				}
			}
			for name, arg := range map[string]string{"apply --dry-run": dryArg, "apply": applyArg, "boot": bootArg} {
				if arg != planArg {
					t.Errorf("%s kernel argument %q, plan %q", name, arg, planArg)
				}
			}
			id := fmt.Sprintf("gpu%d", v.unit)
			t.Logf("%s: %s; kernel argument %q", id, plan[id], planArg)
			if !strings.HasPrefix(plan[id], v.want+":") {
				t.Errorf("%s: %s, want %s", id, plan[id], v.want)
			}
			failed := false
			for _, s := range plan {
				failed = failed || strings.HasPrefix(s, "failed:")
			}
			want := 0
			if failed {
				want = 1
			}
			if planCode != want || dryCode != want || applyCode != want {
				t.Errorf("exit codes plan %d, apply --dry-run %d, apply %d; want %d (a unit failed: %v)", planCode, dryCode, applyCode, want, failed)
			}
			if failed != (worst == stages.Failed) {
				t.Errorf("boot's units end %s; a unit failed: %v", worst, failed)
			}
		})
	}
}
