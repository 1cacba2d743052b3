//go:build cluster && node

package harness_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"maps"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/harness"
	"github.com/passage-boot/passage/manifest"
	qemutest "github.com/passage-boot/passage/qemu-tests"
)

// guestControlAddr is where a QEMU guest dials passage-control: an address of the
// management NIC's user network (10.0.2.0/24) that Options.Forward joins to a replica on
// the host's loopback. It is outside QEMU's DHCP pool (10.0.2.15 and the 15 after it) and
// outside the Service range realnode_test.go carves for a real kubelet (10.0.2.96/28),
// so one guest can hold both.
const guestControlAddr = "10.0.2.80"

// guestCABundle is where Go's crypto/x509 looks first for the system's roots on Linux:
// the initramfs has no CA bundle of its own, so the one the overlay puts there is all
// the boot trusts for passage.url.
const guestCABundle = "etc/ssl/certs/ca-certificates.crt"

// guestControl is passage-control as a booting guest sees it: replicas running as host
// processes against the real API server, serving https://guestControlAddr/ with a
// certificate the guest's image trusts, holding the EK CA of the guest's TPM and the
// approved list of exactly the image Boot serves.
type guestControl struct {
	Replicas   []*replica // host processes; url is https://127.0.0.1:PORT/
	Kubeconfig string     // passage-control's service account (the shipped role)
	CA         []byte     // PEM: the issuer of the replicas' serving certificate
	// Args are the kernel arguments that point the boot at the control plane.
	Args []string
	// TPMState is the swtpm state whose EK certificate the replicas' --ek-ca issued.
	TPMState string
	// Image is the signed UKI the replicas approve (Approved, written to ApprovedFile).
	Image        string
	Approved     *attest.Approved
	ApprovedFile string
	// Boot boots Image: the caller's options with Args, the CA bundle in the initramfs,
	// TPMState, NetBoot serving Image, and Forward to Replicas[0].
	Boot qemutest.Options
}

// ForwardTo is Boot's Forward map with guestControlAddr:443 joined to replica i.
func (g *guestControl) ForwardTo(i int) map[string]string {
	f := maps.Clone(g.Boot.Forward)
	f[guestControlAddr+":443"] = strings.TrimSuffix(strings.TrimPrefix(g.Replicas[i].url, "https://"), "/")
	return f
}

// controlForGuest readies c for a QEMU guest booted as boot says (Build, Topology, Append,
// Name; its TPMState, NetBoot, Forward and Overlay are the control plane's to set): the
// CRDs and passage-control's RBAC applied, a TPM state manufactured with an EK certificate
// from a private swtpm_localca (the replicas' --ek-ca), the signed UKI of that boot built
// by the harness itself (Secure Boot, snakeoil db key) and its approved entry computed
// from it by the real tools (approveImage), and replicas passage-control processes
// started with both and extra flags. work holds everything; each replica logs to
// work/control/control-N.log. boot's Forward is kept beside the one to replica 0.
func controlForGuest(t *testing.T, ctx context.Context, c *harness.Cluster, work string, replicas int, boot qemutest.Options, extra ...string) *guestControl {
	t.Helper()
	dir := filepath.Join(work, "control")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	began, last := time.Now(), time.Now()
	var took []string
	step := func(what string) {
		took = append(took, fmt.Sprintf("%s %.1f s", what, time.Since(last).Seconds()))
		last = time.Now()
	}
	defer func() { t.Logf("controlForGuest %.1f s: %s", time.Since(began).Seconds(), strings.Join(took, ", ")) }()
	ctlBin := goBuild(t, dir, "passage-control")
	step("passage-control built")
	applyCRDs(t, ctx, c)
	g := &guestControl{Kubeconfig: filepath.Join(dir, "passage-control.kubeconfig"), TPMState: filepath.Join(work, "tpm")}
	deployControlRBAC(t, ctx, c, g.Kubeconfig)

	// The TPM is manufactured first: swtpm_localca makes its CA (root and the
	// intermediate that signs EK certificates) on first use.
	ekCA := attesttest.NewCA(t)
	attesttest.Manufacture(t, ekCA, g.TPMState)
	step("CRDs, RBAC, TPM manufactured")
	var crt, key []byte
	g.CA, crt, key = guestServing(t, net.ParseIP(guestControlAddr))
	secret := make([]byte, control.MinKey)
	rand.Read(secret)
	// The names startReplica reads from its work directory.
	for name, b := range map[string][]byte{"ek-ca.pem": ekCA.PEM(t), "tls.crt": crt, "tls.key": key, "exchange.key": secret} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}

	g.Args = []string{"passage.url=https://" + guestControlAddr + "/"}
	o := boot
	o.Append = append(slices.Clone(o.Append), g.Args...)
	o.Overlay = append(slices.Clone(o.Overlay), qemutest.OverlayFile{Name: guestCABundle, Data: g.CA})
	o.TPMState = g.TPMState
	img, err := signedImage(ctx, o, filepath.Join(dir, "image"))
	if err != nil {
		t.Fatal(err)
	}
	g.Image = img
	step("image signed")
	if g.Approved, err = approveImage(img, filepath.Join(dir, "image")); err != nil {
		t.Fatal(err)
	}
	step("approved")
	b, err := json.MarshalIndent(g.Approved, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	g.ApprovedFile = filepath.Join(dir, "approved.json")
	if err := os.WriteFile(g.ApprovedFile, b, 0o644); err != nil {
		t.Fatal(err)
	}

	for i := range replicas {
		// startReplica passes the fixture's approved list first; a flag given again
		// takes the later value (package flag), so this image's list is the one judged.
		g.Replicas = append(g.Replicas, startReplica(t, ctx, ctlBin, g.Kubeconfig, dir, i+1,
			append([]string{"--approved", g.ApprovedFile, "--reconcile-every", "1s"}, extra...)...))
	}
	step(fmt.Sprintf("%d replicas started", replicas))
	o.Forward = maps.Clone(boot.Forward)
	if o.Forward == nil {
		o.Forward = map[string]string{}
	}
	o.Forward[guestControlAddr+":443"] = strings.TrimSuffix(strings.TrimPrefix(g.Replicas[0].url, "https://"), "/")
	o.NetBoot = &qemutest.NetBoot{Tamper: func(uki string) error {
		// The harness signs the image again from the same options, and no two of
		// uki.sh's images are the same bytes (objcopy stamps the PE header's
		// TimeDateStamp, which the Authenticode hash covers): the guest boots the
		// approved file itself.
		b, err := os.ReadFile(img)
		if err != nil {
			return err
		}
		return os.WriteFile(uki, b, 0o644)
	}}
	g.Boot = o
	return g
}

// errImageBuilt ends a Boot before QEMU starts: its image is all signedImage wants.
var errImageBuilt = errors.New("image built; not booted")

// signedImage is the signed UKI a NetBoot of o serves, built by qemutest.Boot itself
// (the initramfs with o's overlay, the command line with o's arguments, image/uki.sh with
// the snakeoil db key) and copied to dir/passage.efi. NetBoot's Tamper runs after the
// image is signed and before QEMU starts; an error from it ends the Boot there.
func signedImage(ctx context.Context, o qemutest.Options, dir string) (string, error) {
	img := filepath.Join(dir, "passage.efi")
	o.WorkDir = filepath.Join(dir, "build")
	o.Forward = nil
	o.NetBoot = &qemutest.NetBoot{Tamper: func(uki string) error {
		b, err := os.ReadFile(uki)
		if err == nil {
			err = os.WriteFile(img, b, 0o644)
		}
		if err != nil {
			return err
		}
		return errImageBuilt
	}}
	if _, err := qemutest.Boot(ctx, o); !errors.Is(err, errImageBuilt) {
		return "", fmt.Errorf("signed image: %v", err)
	}
	return img, nil
}

var (
	authenticodeDigest = regexp.MustCompile(`(?m)^Calculated message digest\s*:\s*([0-9A-Fa-f]{64})\s*$`)
	measuredPCR11      = regexp.MustCompile(`(?m)^11:sha256=([0-9a-f]{64})$`)
)

// approveImage is what an operator approves of the signed UKI at uki, computed from the
// file by the real tools, as qemu-tests' scenario 9 does: its Authenticode hash
// (osslsigncode; what OVMF logs in PCR 4 as it loads it), the PCR 11 value systemd-stub
// extends from its sections (systemd-measure calculate of the sections objcopy extracts,
// --phase=: as no systemd-pcrphase runs in passage's boot), and the snakeoil db
// certificate that signed it (PCR 7's authority). passage-control judges a boot by these
// (attest.VerifyFirmware). scratch holds the extracted sections.
func approveImage(uki, scratch string) (*attest.Approved, error) {
	out, err := exec.Command("osslsigncode", "verify", "-in", uki).CombinedOutput()
	m := authenticodeDigest.FindSubmatch(out)
	if m == nil {
		return nil, fmt.Errorf("osslsigncode verify %s: %v: no calculated digest in\n%s", uki, err, out)
	}
	auth, _ := hex.DecodeString(string(m[1]))
	args := []string{"calculate", "--bank=sha256", "--phase=:"}
	for _, s := range []string{"linux", "osrel", "cmdline", "initrd"} {
		f := filepath.Join(scratch, "section."+s)
		if out, err := exec.Command("objcopy", "-O", "binary", "--only-section=."+s, uki, f).CombinedOutput(); err != nil {
			return nil, fmt.Errorf("objcopy .%s of %s: %v: %s", s, uki, err, out)
		}
		args = append(args, "--"+s+"="+f)
	}
	out, err = exec.Command("/usr/lib/systemd/systemd-measure", args...).CombinedOutput()
	m = measuredPCR11.FindSubmatch(out)
	if m == nil {
		return nil, fmt.Errorf("systemd-measure %v: %v: no PCR 11 in\n%s", args, err, out)
	}
	pcr11, _ := hex.DecodeString(string(m[1]))
	_, certPath, err := qemutest.SnakeoilKey(scratch)
	if err != nil {
		return nil, err
	}
	cert, err := os.ReadFile(certPath)
	if err != nil {
		return nil, err
	}
	ap := &attest.Approved{Format: attest.ApprovedFormat, Authenticode: []attest.HexBytes{auth},
		PCR11: []attest.HexBytes{pcr11}, DBCertificates: []string{string(cert)}}
	return ap, ap.Parse()
}

// guestServing is a CA, as an operator's, and the replicas' serving certificate it
// issues, naming 127.0.0.1 (the test's own requests) and the guest's address.
func guestServing(t testing.TB, guest net.IP) (caPEM, certPEM, keyPEM []byte) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "passage-control test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, caKey.Public(), caKey)
	if err != nil {
		t.Fatal(err)
	}
	if ca, err = x509.ParseCertificate(caDER); err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	leaf := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "passage-control"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), guest}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		KeyUsage: x509.KeyUsageDigitalSignature}
	der, err := x509.CreateCertificate(rand.Reader, leaf, ca, key.Public(), caKey)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})
}

// guestRecord is the PassageNode named name as the API holds it.
func guestRecord(t testing.TB, ctx context.Context, dyn dynamic.Interface, name string) control.Node {
	t.Helper()
	u, err := dyn.Resource(control.NodeResource).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("record %s: %v", name, err)
	}
	b, err := json.Marshal(u.Object)
	if err != nil {
		t.Fatal(err)
	}
	n := control.Node{Name: u.GetName(), ResourceVersion: u.GetResourceVersion(), Labels: u.GetLabels()}
	if err := json.Unmarshal(b, &n); err != nil {
		t.Fatalf("record %s: %v", name, err)
	}
	return n
}

// bootManifest is the manifest the guest wrote, verified with the signing key the
// record's enrolment certified: the generation and payload the record must show.
func bootManifest(t testing.TB, env []byte, rec control.Node) *manifest.Verified {
	t.Helper()
	if env == nil {
		t.Fatal("the guest wrote no manifest")
	}
	pemKey, err := (&attest.NodeRecord{SigningKeyPublic: rec.Spec.SigningKeyPublic}).SigningKeyPEM()
	if err != nil {
		t.Fatalf("record %s: signing key: %v", rec.Name, err)
	}
	v, err := manifest.ParsePublicKey(pemKey)
	if err != nil {
		t.Fatal(err)
	}
	ver, err := manifest.Verify(env, v, manifest.VerifyOptions{})
	if err != nil {
		t.Fatalf("the boot's manifest does not verify with the key enrolled in record %s: %v", rec.Name, err)
	}
	return ver
}

// stageLines is what the guest's console (con, its text) said of one stage: its result
// line and the findings, changes and error under it (stages.stageLine's layout).
func stageLines(con, stage string) string {
	var out []string
	in := false
	for _, l := range strings.Split(con, "\n") {
		l = strings.TrimRight(l, "\r")
		switch {
		case strings.HasPrefix(l, "passage: "+stage+" "):
			in = true
		case in && strings.HasPrefix(l, "passage:   "):
		default:
			in = false
		}
		if in {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

var stageResult = regexp.MustCompile(`^passage: (\S+)\s+(ok|degraded|failed|skipped)\s+[0-9.]+s\b`)

// notOK is what the guest's console (con, its text) said of each stage that did not
// end ok.
func notOK(con string) string {
	var out []string
	for _, l := range strings.Split(con, "\n") {
		if m := stageResult.FindStringSubmatch(strings.TrimRight(l, "\r")); m != nil && m[2] != "ok" {
			out = append(out, stageLines(con, m[1]))
		}
	}
	return strings.Join(out, "\n")
}
