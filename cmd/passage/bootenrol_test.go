package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/attest/verifiertest"
	"github.com/passage-boot/passage/stages"
)

// enrolNode is a synthetic B300 whose TPM is a swtpm with an EK certificate from a
// private CA, at <root>/dev/tpmrm0 (the socket) while a boot runs: `passage boot --root`
// opens it as the node's TPM.
type enrolNode struct {
	root, state string
}

func newEnrolNode(t *testing.T, ca *attesttest.CA) *enrolNode {
	t.Helper()
	n := &enrolNode{root: bootTree(t, ""), state: filepath.Join(t.TempDir(), "tpm")}
	attesttest.Manufacture(t, ca, n.state)
	if err := os.MkdirAll(filepath.Join(n.root, "dev"), 0o755); err != nil {
		t.Fatal(err)
	}
	return n
}

// boot powers the TPM on (a fresh swtpm process on the node's state: a TPM reset, PCRs
// cleared), runs `passage boot --root R --no-handoff` with a fresh /run, powers the TPM
// off, and returns the publish stage's record from log.jsonl and the console.
// passage.url is url, passage.net=off.
func (n *enrolNode) boot(t *testing.T, url string) (stages.ResultRecord, string) {
	t.Helper()
	cmdline := "console=ttyS0 passage.profile=b300 passage.key=/etc/passage/passage.key passage.tpm=on " +
		"passage.erase=off passage.host_modules= passage.net=off passage.url=" + url + "\n"
	if err := os.WriteFile(filepath.Join(n.root, "proc/cmdline"), []byte(cmdline), 0o644); err != nil {
		t.Fatal(err)
	}
	sock, stop := attesttest.Serve(t, n.state)
	defer stop()
	dev := filepath.Join(n.root, "dev/tpmrm0")
	os.Remove(dev)
	if err := os.Symlink(sock, dev); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(filepath.Join(n.root, "run")); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	cmdBoot([]string{"--root", n.root, "--no-handoff"}, &out, &errb)
	if errb.Len() > 0 {
		t.Errorf("stderr: %s", errb.String())
	}
	con := out.String()
	if os.Getenv("PASSAGE_SHOW") != "" {
		t.Log(con)
	}
	f, err := os.Open(filepath.Join(n.root, "run/passage/log.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	var found []stages.ResultRecord
	for sc.Scan() {
		var r stages.ResultRecord
		if json.Unmarshal(sc.Bytes(), &r) == nil && r.Type == "stage" && (r.Name == "publish" || r.Name == "manifest") {
			found = append(found, r)
		}
	}
	if len(found) != 2 || found[0].Name != "manifest" || found[1].Name != "publish" {
		t.Fatalf("log.jsonl: manifest and publish records %+v\n%s", found, con)
	}
	if found[0].Status != stages.OK {
		t.Fatalf("manifest %s %s %v\n%s", found[0].Status, found[0].Error, found[0].Findings, con)
	}
	return found[1], con
}

func lines(r stages.ResultRecord) string {
	return strings.Join(append(append([]string{r.Error}, r.Findings...), r.Changes...), "\n")
}

// exchange is the control plane's log as "METHOD TYPE STATUS" lines.
func exchange(cp *verifiertest.Enrolling) []string {
	var out []string
	for _, r := range cp.Requests() {
		out = append(out, r.Method+" "+r.Type+" "+strconv.Itoa(r.Status))
	}
	return out
}

func eqLines(t *testing.T, what string, got, want []string) {
	t.Helper()
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("%s:\n%s\nwant\n%s", what, strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

const (
	envPost  = "POST application/vnd.dsse.envelope.v1+json "
	attPost  = "POST application/vnd.passage.attestation+json "
	actPost  = "POST application/vnd.passage.activation+json "
	nonceGet = "GET GET "
)

// TestBootEnrols: `passage boot --root` with passage.net=off and passage.url on loopback
// publishes, and a control plane that never saw the node's TPM enrols it within that
// publish, with no other command: nonce, envelope, the attestation answered 428 with a
// challenge, the TPM's activation answered 204, the attestation again accepted. The
// next boot (the TPM reset, a newer generation) is accepted without a challenge.
func TestBootEnrols(t *testing.T) {
	ca := attesttest.NewCA(t)
	n := newEnrolNode(t, ca)
	cp := verifiertest.NewEnrolling(t, filepath.Join(t.TempDir(), "nonces.json"), verifiertest.EnrolOptions{EKCA: ca.PEM(t)})

	pub, con := n.boot(t, cp.URL+"/passage")
	if pub.Status != stages.OK {
		t.Fatalf("publish %s:\n%s\n%s", pub.Status, lines(pub), con)
	}
	eqLines(t, "first boot's exchange", exchange(cp), []string{
		envPost + "204", nonceGet + "200", attPost + "428", actPost + "204", attPost + "200"})
	a, err := attest.ReadAttestation(filepath.Join(n.root, "run/passage/manifest.dsse.json"+attest.Suffix))
	if err != nil {
		t.Fatal(err)
	}
	name := verifiertest.RecordName(a.EKPublic)
	if cp.Record(name) == nil {
		t.Fatalf("no record %s kept", name)
	}
	for _, want := range []string{"enrolled: credential activated in the TPM, record " + name,
		"posted to " + cp.URL + "/passage after enrolment as record " + name} {
		if !strings.Contains(lines(pub), want) {
			t.Errorf("publish lacks %q:\n%s", want, lines(pub))
		}
	}

	pub, con = n.boot(t, cp.URL+"/passage")
	if pub.Status != stages.OK {
		t.Fatalf("second boot: publish %s:\n%s\n%s", pub.Status, lines(pub), con)
	}
	got := exchange(cp)[5:]
	eqLines(t, "second boot's exchange", got, []string{envPost + "204", nonceGet + "200", attPost + "200"})
	if s := cp.Record(name).Seen; s.Generation != 2 {
		t.Errorf("record %s seen %+v, want generation 2", name, s)
	}
}

// TestBootEnrolRefused: what the control plane refuses reaches the publish stage's
// findings with its status and reason, and the stage is degraded, the boot otherwise
// unharmed: an EK not chained to the control plane's CA (no challenge), a wrong answer
// (the activation refused, the attestation not posted again), a challenge over 16 KiB
// (refused unread: no activation), a second challenge after enrolment (not answered: one
// round per publish), and a 503 on the activation, retried.
func TestBootEnrolRefused(t *testing.T) {
	nodeCA, otherCA := attesttest.NewCA(t), attesttest.NewCA(t)
	// swtpm_localca makes a CA's certificates when it first issues.
	attesttest.Manufacture(t, otherCA, filepath.Join(t.TempDir(), "tpm"))
	n := newEnrolNode(t, nodeCA)
	for _, tc := range []struct {
		name     string
		opts     verifiertest.EnrolOptions
		status   stages.Status
		exchange []string
		words    []string
	}{
		{"EK of another CA", verifiertest.EnrolOptions{EKCA: otherCA.PEM(t)}, stages.Degraded,
			[]string{envPost + "204", nonceGet + "200", attPost + "403"},
			[]string{"status 403 403 Forbidden: EK certificate: issued by", "not the operator's EK CA"}},
		{"wrong answer", verifiertest.EnrolOptions{EKCA: nodeCA.PEM(t), WrongSecret: true}, stages.Degraded,
			[]string{envPost + "204", nonceGet + "200", attPost + "428", actPost + "403"},
			[]string{"activation try 1: status 403 403 Forbidden: activation: wrong answer", "enrolment: record node-", "answer refused"}},
		{"challenge over the bound", verifiertest.EnrolOptions{EKCA: nodeCA.PEM(t), PadChallenge: 16 << 10}, stages.Degraded,
			[]string{envPost + "204", nonceGet + "200", attPost + "428"},
			[]string{"challenge over 16384 bytes: refused unread"}},
		{"challenged again after enrolment", verifiertest.EnrolOptions{EKCA: nodeCA.PEM(t), Forget: true}, stages.Degraded,
			[]string{envPost + "204", nonceGet + "200", attPost + "428", actPost + "204", attPost + "428"},
			[]string{"challenged again after enrolment as record node-", "one enrolment round per publish"}},
		{"a 503 on the activation", verifiertest.EnrolOptions{EKCA: nodeCA.PEM(t),
			Unavailable: map[string]int{"application/vnd.passage.activation+json": 1}}, stages.OK,
			[]string{envPost + "204", nonceGet + "200", attPost + "428", actPost + "503", actPost + "204", attPost + "200"},
			[]string{"activation try 1: status 503 503 Service Unavailable: replica unavailable", "activation try 2: status 204"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cp := verifiertest.NewEnrolling(t, filepath.Join(t.TempDir(), "nonces.json"), tc.opts)
			pub, con := n.boot(t, cp.URL)
			if pub.Status != tc.status {
				t.Errorf("publish %s, want %s:\n%s\n%s", pub.Status, tc.status, lines(pub), con)
			}
			eqLines(t, "exchange", exchange(cp), tc.exchange)
			for _, w := range tc.words {
				if !strings.Contains(lines(pub), w) {
					t.Errorf("publish lacks %q:\n%s", w, lines(pub))
				}
			}
		})
	}
}
