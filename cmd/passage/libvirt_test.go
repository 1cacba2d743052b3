package main

import (
	"bytes"
	"context"
	"encoding/xml"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/pci/pcitest"
)

// libvirtXML is the part of a domain this test compares: every PCI controller and
// every hostdev, with their addresses.
type libvirtXML struct {
	Type        string `xml:"type,attr"`
	Name        string `xml:"name"`
	Controllers []struct {
		Type    string     `xml:"type,attr"`
		Index   int        `xml:"index,attr"`
		Model   string     `xml:"model,attr"`
		Address *lvAddrXML `xml:"address"`
	} `xml:"devices>controller"`
	Hostdevs []struct {
		Managed string    `xml:"managed,attr"`
		Source  lvAddrXML `xml:"source>address"`
		Address lvAddrXML `xml:"address"`
	} `xml:"devices>hostdev"`
}

type lvAddrXML struct {
	Domain   string `xml:"domain,attr"`
	Bus      string `xml:"bus,attr"`
	Slot     string `xml:"slot,attr"`
	Function string `xml:"function,attr"`
}

// key reads the address as numbers, so 0x0 and 0x00 compare equal.
func (a lvAddrXML) key(t *testing.T) string {
	t.Helper()
	var out []string
	for _, s := range []string{a.Domain, a.Bus, a.Slot, a.Function} {
		v, err := strconv.ParseUint(strings.TrimPrefix(s, "0x"), 16, 32)
		if err != nil {
			t.Fatalf("address %+v: %q: %v", a, s, err)
		}
		out = append(out, fmt.Sprint(v))
	}
	return strings.Join(out, ":")
}

// privateLibvirtd starts libvirtd as root in a mount namespace of its own: tmpfs over
// /run, /var/lib, /var/cache and /var/log, and a private /etc/libvirt whose qemu.conf
// runs QEMU as root, so the daemon's state, its domain definitions and its sockets live
// and die with the test and nothing on the host changes. No network is defined, so none
// is started. It returns the qemu:///system URI of its socket; cleanup stops it and
// waits for it.
func privateLibvirtd(t *testing.T) string {
	t.Helper()
	if os.Getuid() != 0 {
		t.Fatal("libvirtd's system instance needs root (CI runs as root)")
	}
	for _, tool := range []string{"libvirtd", "virsh", "unshare"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is needed for this test (image/deps.sh installs it): %v", tool, err)
		}
	}
	dir := t.TempDir()
	for _, d := range []string{"etc", "run"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	files := map[string]string{
		"etc/qemu.conf": "user = \"root\"\ngroup = \"root\"\n",
		"libvirtd.conf": fmt.Sprintf("unix_sock_dir = %q\nauth_unix_rw = \"none\"\nauth_unix_ro = \"none\"\nlog_outputs = \"3:file:%s\"\n",
			filepath.Join(dir, "run"), filepath.Join(dir, "libvirtd.log")),
		"start.sh": fmt.Sprintf("set -e\nfor d in /run /var/lib /var/cache /var/log; do mount -t tmpfs -o mode=0755 passage-libvirt $d; done\n"+
			"mount --bind %s /etc/libvirt\nexec libvirtd -f %s -p %s\n",
			filepath.Join(dir, "etc"), filepath.Join(dir, "libvirtd.conf"), filepath.Join(dir, "run/libvirtd.pid")),
	}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	var out bytes.Buffer
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", filepath.Join(dir, "start.sh"))
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	sock := filepath.Join(dir, "run", "libvirt-sock")
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		select {
		case err := <-done:
			log, _ := os.ReadFile(filepath.Join(dir, "libvirtd.log"))
			t.Fatalf("libvirtd exited: %v\n%s\n%s", err, out.String(), log)
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("libvirtd: no socket %s after 30 s\n%s", sock, out.String())
		}
	}
	return "qemu:///system?socket=" + sock
}

func virsh(t *testing.T, uri string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "virsh", append([]string{"-c", uri}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("virsh %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestLibvirtAcceptsDomain: the domain rendered from a signed manifest validates against
// libvirt's own schema (virt-xml-validate), and a real libvirtd defines it (type qemu:
// no KVM here) and keeps every controller and hostdev address as rendered.
func TestLibvirtAcceptsDomain(t *testing.T) {
	if _, err := exec.LookPath("virt-xml-validate"); err != nil {
		t.Fatalf("virt-xml-validate is needed for this test (apt-get install libvirt-clients libxml2-utils): %v", err)
	}
	n := bootSigned(t, pcitest.B300())
	dir := t.TempDir()
	cases := []struct {
		name string
		args []string
	}{
		{"flat", []string{"--units", "0,1"}},
		{"numa", []string{"--units", "0,1,4", "--numa"}},
	}
	files := map[string]string{}
	for _, c := range cases {
		args := append([]string{n.envelope, "--pub", n.pub, "--format", "libvirt", "--domain-type", "qemu",
			"--vcpus", "2", "--memory", "1024", "--name", "passage-test-" + c.name}, c.args...)
		code, out, errs := runCmd(t, cmdRender, args...)
		if code != 0 {
			t.Fatalf("render %v: exit %d %s", args, code, errs)
		}
		f := filepath.Join(dir, c.name+".xml")
		if err := os.WriteFile(f, []byte(out), 0o644); err != nil {
			t.Fatal(err)
		}
		files[c.name] = f
		v, err := exec.Command("virt-xml-validate", f, "domain").CombinedOutput()
		if err != nil || !strings.Contains(string(v), "validates") {
			t.Errorf("%s: virt-xml-validate: %v\n%s\n%s", c.name, err, v, out)
		}
	}

	uri := privateLibvirtd(t)
	for _, c := range cases {
		rendered, err := os.ReadFile(files[c.name])
		if err != nil {
			t.Fatal(err)
		}
		name := "passage-test-" + c.name
		virsh(t, uri, "define", files[c.name])
		dumped := virsh(t, uri, "dumpxml", name)
		virsh(t, uri, "undefine", name)

		var want, got libvirtXML
		if err := xml.Unmarshal(rendered, &want); err != nil {
			t.Fatal(err)
		}
		if err := xml.Unmarshal([]byte(dumped), &got); err != nil {
			t.Fatalf("dumpxml: %v\n%s", err, dumped)
		}
		if got.Type != "qemu" || got.Name != name {
			t.Errorf("%s: libvirt keeps type %q name %q", c.name, got.Type, got.Name)
		}
		kept := map[int]string{}
		for _, ctl := range got.Controllers {
			if ctl.Type == "pci" {
				addr := ""
				if ctl.Address != nil {
					addr = ctl.Address.key(t)
				}
				kept[ctl.Index] = ctl.Model + "@" + addr
			}
		}
		controllers := 0
		for _, ctl := range want.Controllers {
			addr := ""
			if ctl.Address != nil {
				addr = ctl.Address.key(t)
			}
			if w := ctl.Model + "@" + addr; kept[ctl.Index] != w {
				t.Errorf("%s: controller index %d: libvirt keeps %q, rendered %q", c.name, ctl.Index, kept[ctl.Index], w)
			}
			controllers++
		}
		hostdevs := map[string]string{}
		for _, h := range got.Hostdevs {
			if h.Managed != "no" {
				t.Errorf("%s: hostdev %+v: managed %q", c.name, h.Source, h.Managed)
			}
			hostdevs[h.Source.key(t)] = h.Address.key(t)
		}
		for _, h := range want.Hostdevs {
			if g := hostdevs[h.Source.key(t)]; g != h.Address.key(t) {
				t.Errorf("%s: hostdev %s: libvirt puts it at %q, rendered %q", c.name, h.Source.key(t), g, h.Address.key(t))
			}
		}
		units := len(strings.Split(c.args[1], ","))
		if len(want.Hostdevs) != 4*units || len(got.Hostdevs) != len(want.Hostdevs) || controllers < 1+6*units {
			t.Errorf("%s: rendered %d hostdevs, %d controllers; libvirt kept %d hostdevs", c.name, len(want.Hostdevs), controllers, len(got.Hostdevs))
		}
		if c.name == "numa" {
			// Two guest cells (host nodes 0 and 1), one vCPU each, pinned to its node's CPUs.
			for _, pin := range []string{`<vcpupin vcpu='0' cpuset='0-63,128-191'/>`, `<vcpupin vcpu='1' cpuset='64-127,192-255'/>`, `<memnode cellid='1' mode='strict' nodeset='1'/>`} {
				if !strings.Contains(dumped, pin) {
					t.Errorf("numa: libvirt does not keep %s:\n%s", pin, dumped)
				}
			}
		}
		t.Logf("%s: libvirt kept %d controllers and %d hostdevs as rendered", c.name, controllers, len(got.Hostdevs))
	}
	// Nothing of the host's networking was touched: no network defined, no bridge.
	if nets := strings.TrimSpace(virsh(t, uri, "net-list", "--all", "--name")); nets != "" {
		t.Errorf("libvirt has networks: %q", nets)
	}
	if _, err := net.InterfaceByName("virbr0"); err == nil {
		t.Error("virbr0 exists")
	}
}
