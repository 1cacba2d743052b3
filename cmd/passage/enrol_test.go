package main

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// enrolledNode makes a node's key with keygen --enrol on a tree whose DMI says uuid and
// serial, and copies the public key and its enrolment into keys as NAME.pub and
// NAME.enrol.json, as an operator fills a hypervisor's key directory.
func enrolledNode(t *testing.T, keys, name, uuid, serial string) *manifest.Ed25519Signer {
	t.Helper()
	root, out := t.TempDir(), t.TempDir()
	for p, v := range map[string]string{"sys/class/dmi/id/product_uuid": uuid, "sys/class/dmi/id/product_serial": serial, "proc/sys/kernel/hostname": name} {
		os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o755)
		if err := os.WriteFile(filepath.Join(root, p), []byte(v+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	code, stdout, errs := runCmd(t, cmdKeygen, "-o", out, "--enrol", "--root", root)
	if code != 0 || !strings.Contains(stdout, "enrolment   "+filepath.Join(out, "passage.enrol.json")+" (uuid "+uuid+" serial "+serial+")") {
		t.Fatalf("keygen --enrol: exit %d\n%s%s", code, stdout, errs)
	}
	for from, to := range map[string]string{"passage.pub": name + ".pub", "passage.enrol.json": name + manifest.EnrolmentSuffix} {
		b, err := os.ReadFile(filepath.Join(out, from))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(keys, to), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	s, err := manifest.LoadSigner(filepath.Join(out, "passage.key"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func signedFile(t *testing.T, path string, m *manifest.Manifest, s manifest.Signer) string {
	t.Helper()
	signed, err := manifest.Sign(context.Background(), m, s)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, signed.Envelope, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// A key in a fleet's key directory speaks for the node it was enrolled for and no other:
// node A's key signing node B's identity (and a high generation) is refused by verify,
// render and metrics; a key without an enrolment is not a fleet key; every output names
// the key that signed.
func TestNodeKeyBinding(t *testing.T) {
	keys, dir := t.TempDir(), t.TempDir()
	const uuidA, uuidB = "4c4c4544-0000-0000-0000-00000000000a", "4c4c4544-0000-0000-0000-00000000000b"
	a := enrolledNode(t, keys, "nodeA", uuidA, "SER-A")
	enrolledNode(t, keys, "nodeB", uuidB, "SER-B")
	idA, _ := a.KeyID()

	own := manifesttest.B300(5)
	own.Node.Hostname, own.Node.DMIUUID, own.Node.DMISerial = "nodeA", uuidA, "SER-A"
	good := signedFile(t, filepath.Join(dir, "a.dsse.json"), own, a)
	forged := manifesttest.B300(999)
	forged.Node.Hostname, forged.Node.DMIUUID, forged.Node.DMISerial = "nodeB", uuidB, "SER-B"
	bad := signedFile(t, filepath.Join(dir, "b.dsse.json"), forged, a)

	signer := idA + " (nodeA.pub, enrolled for uuid " + uuidA + " serial SER-A)"
	code, out, errs := runCmd(t, cmdVerify, "--pub", keys, good)
	if code != 0 || !strings.Contains(out, good+": OK, signed by "+signer+"\n") {
		t.Errorf("verify own manifest: exit %d\n%s%s", code, out, errs)
	}
	code, out, _ = runCmd(t, cmdMetrics, "--pub", keys, "--manifest", good)
	if code != 0 || !strings.Contains(out, `signer="`+signer+`"`) {
		t.Errorf("metrics own manifest: exit %d\n%s", code, out)
	}
	why := "signed by a key not enrolled for this node: key " + idA + " is enrolled for uuid " + uuidA + " serial SER-A; the manifest says dmi_uuid \"" + uuidB + "\", dmi_serial \"SER-B\""
	for _, args := range [][]string{
		{"verify", "--pub", keys, bad},
		{"render", "--pub", keys, "--manifest", bad},
		{"metrics", "--pub", keys, "--manifest", bad},
	} {
		code, out, errs := runCmd(t, map[string]func([]string, io.Writer, io.Writer) int{"verify": cmdVerify, "render": cmdRender, "metrics": cmdMetrics}[args[0]], args[1:]...)
		if code != 1 || out != "" || !strings.Contains(errs, "REFUSED: manifest: "+why) {
			t.Errorf("%s: exit %d, want 1\nstdout %q\nstderr %q", args[0], code, out, errs)
		}
	}
	code, out, _ = runCmd(t, cmdVerify, "--pub", keys, good, bad)
	if code != 1 || !strings.Contains(out, "OK       "+good+": nodeA gen 5 (file) boot "+manifesttest.BootID+" signed by nodeA.pub units 8") ||
		!strings.Contains(out, "REFUSED  "+bad+": manifest: "+why+"\n") {
		t.Errorf("fleet: exit %d\n%s", code, out)
	}

	// The same key named alone with its enrolment beside it is held to it too.
	code, _, errs = runCmd(t, cmdVerify, "--pub", filepath.Join(keys, "nodeA.pub"), bad)
	if code != 1 || !strings.Contains(errs, why) {
		t.Errorf("verify --pub nodeA.pub: exit %d %s", code, errs)
	}

	// A key without an enrolment in the directory: the directory is refused.
	pub, _ := os.ReadFile(filepath.Join(keys, "nodeB.pub"))
	os.WriteFile(filepath.Join(keys, "nodeC.pub"), pub, 0o644)
	code, _, errs = runCmd(t, cmdVerify, "--pub", keys, good)
	if code != 2 || !strings.Contains(errs, "nodeC.pub: not enrolled for a node") {
		t.Errorf("unenrolled key: exit %d %s", code, errs)
	}
	os.Remove(filepath.Join(keys, "nodeC.pub"))

	// An enrolment for another key is refused.
	eb, _ := os.ReadFile(filepath.Join(keys, "nodeB.enrol.json"))
	os.WriteFile(filepath.Join(keys, "nodeA.enrol.json"), eb, 0o644)
	code, _, errs = runCmd(t, cmdVerify, "--pub", keys, good)
	if code != 2 || !strings.Contains(errs, "nodeA.enrol.json: for key") {
		t.Errorf("enrolment of another key: exit %d %s", code, errs)
	}
}
