package main

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
)

// cmdAttest is remote attestation's enrolment round and the node's on-demand quote
// (package attest). The verification of an attestation is verify --attest: one
// verification path for manifests.
//
//	verifier: passage attest enroll --ek-ca CA --challenge C --pending P ATTESTATION
//	node:     passage attest activate -o ANSWER C
//	verifier: passage attest enroll --pending P --answer ANSWER -o NODE [--tpm-pub-out KEY]
//	node:     passage attest quote --nonce HEX -o ATTESTATION (a control plane's nonce)
//	verifier: passage attest nonce --nonces STORE (issue one: what passage.url's GET answers)
func cmdAttest(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("attest", stderr)
	ekCA := fs.String("ek-ca", "", "enroll: the operator's EK CA certificates `FILE` (PEM): the TPM vendor's, in CI swtpm_localca's")
	challenge := fs.String("challenge", "", "enroll: write the node's challenge to `FILE`")
	pending := fs.String("pending", "", "enroll: the verifier's half of the round, written then read back (`FILE`)")
	answer := fs.String("answer", "", "enroll: the node's answer `FILE` (passage attest activate)")
	out := fs.String("o", "", "write the node record (enroll), the answer (activate) or the attestation (quote) to `FILE`")
	pubOut := fs.String("tpm-pub-out", "", "enroll: also write the certified signing key to `FILE`, what verify --tpm-pub reads")
	dev := fs.String("tpm-device", tpmkey.DefaultDevice, "activate, quote: the TPM character `DEVICE` (or swtpm's socket)")
	nonce := fs.String("nonce", "", "quote: the verifier's nonce, `HEX` (1 to 64 bytes; default: 32 random bytes, printed)")
	dir := fs.String("dir", "/run/passage", "quote: the `DIR` of the boot's manifest and its event log")
	nonces := fs.String("nonces", "", "nonce: the verifier's nonce store `FILE` (nonces.json beside the node records), created when missing")
	pos, code, ok := parseFlags(fs, args, stdout)
	if !ok {
		return code
	}
	if len(pos) == 0 {
		fmt.Fprintln(stderr, "passage attest: give enroll, activate, quote or nonce; see passage help attest")
		return 2
	}
	a := attestCmd{stdout: stdout, stderr: stderr}
	switch pos[0] {
	case "enroll":
		if *answer != "" {
			if len(pos) != 1 || *pending == "" || *out == "" {
				fmt.Fprintln(stderr, "passage attest enroll --answer: give --pending FILE and -o NODE, no argument")
				return 2
			}
			return a.complete(*pending, *answer, *out, *pubOut)
		}
		if len(pos) != 2 || *ekCA == "" || *challenge == "" || *pending == "" {
			fmt.Fprintln(stderr, "passage attest enroll: give --ek-ca FILE --challenge FILE --pending FILE ATTESTATION")
			return 2
		}
		return a.start(pos[1], *ekCA, *challenge, *pending)
	case "activate":
		if len(pos) != 2 || *out == "" {
			fmt.Fprintln(stderr, "passage attest activate: give -o ANSWER CHALLENGE")
			return 2
		}
		return a.activate(*dev, pos[1], *out)
	case "quote":
		if len(pos) != 1 || *out == "" {
			fmt.Fprintln(stderr, "passage attest quote: give -o FILE, no argument")
			return 2
		}
		return a.quote(*dev, *dir, *nonce, *out)
	case "nonce":
		if len(pos) != 1 || *nonces == "" {
			fmt.Fprintln(stderr, "passage attest nonce: give --nonces FILE, no argument")
			return 2
		}
		n, err := (&attest.NonceStore{Path: *nonces, Logf: a.logf}).Issue()
		if err != nil {
			return a.fail(2, "%v", err)
		}
		fmt.Fprintln(stdout, hex.EncodeToString(n))
		return 0
	}
	fmt.Fprintf(stderr, "passage attest: %q: not enroll, activate, quote or nonce\n", pos[0])
	return 2
}

type attestCmd struct{ stdout, stderr io.Writer }

// logf is a nonce store's log (what it repaired): the command's stderr.
func (a attestCmd) logf(format string, args ...any) {
	fmt.Fprintf(a.stderr, "passage attest: "+format+"\n", args...)
}

func (a attestCmd) fail(code int, format string, args ...any) int {
	fmt.Fprintf(a.stderr, "passage attest: "+format+"\n", args...)
	return code
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return manifest.WriteAtomic(filepath.Dir(path), filepath.Base(path), append(b, '\n'))
}

func (a attestCmd) start(attPath, caPath, chPath, pendPath string) int {
	att, err := attest.ReadAttestation(attPath)
	if err != nil {
		return a.fail(2, "%v", err)
	}
	caPEM, err := os.ReadFile(caPath)
	if err != nil {
		return a.fail(2, "--ek-ca: %v", err)
	}
	pool, err := attest.CAPool(caPEM)
	if err != nil {
		return a.fail(2, "--ek-ca %s: %v", caPath, err)
	}
	ch, p, err := attest.Enrol(att, pool)
	if err != nil {
		return a.fail(1, "%s: REFUSED: %v", attPath, err)
	}
	if err := writeJSON(pendPath, p); err != nil {
		return a.fail(2, "%v", err)
	}
	if err := writeJSON(chPath, ch); err != nil {
		return a.fail(2, "%v", err)
	}
	fmt.Fprintf(a.stdout, "%s: EK certificate and AK accepted\n  challenge %s (for passage attest activate on the node)\n  pending   %s\n", pr(attPath), pr(chPath), pr(pendPath))
	return 0
}

func (a attestCmd) complete(pendPath, ansPath, out, pubOut string) int {
	var p attest.Pending
	if err := attest.ReadJSON(pendPath, attest.PendingFormat, &p); err != nil {
		return a.fail(2, "--pending: %v", err)
	}
	ans, err := os.ReadFile(ansPath)
	if err != nil {
		return a.fail(2, "--answer: %v", err)
	}
	secret, err := hex.DecodeString(string(trimSpace(ans)))
	if err != nil {
		return a.fail(1, "--answer %s: REFUSED: not hex", ansPath)
	}
	rec, err := attest.Complete(&p, secret)
	if err != nil {
		return a.fail(1, "%s: REFUSED: %v", ansPath, err)
	}
	if err := writeJSON(out, rec); err != nil {
		return a.fail(2, "%v", err)
	}
	fmt.Fprintf(a.stdout, "node record %s: the AK is in the TPM of the certified EK\n", pr(out))
	if pubOut != "" {
		pemBytes, err := rec.SigningKeyPEM()
		if err != nil {
			return a.fail(1, "%v", err)
		}
		if err := manifest.WriteAtomic(filepath.Dir(pubOut), filepath.Base(pubOut), pemBytes); err != nil {
			return a.fail(2, "%v", err)
		}
		fmt.Fprintf(a.stdout, "public key  %s (certified by the AK)\n", pr(pubOut))
	}
	return 0
}

func trimSpace(b []byte) []byte {
	for len(b) > 0 && (b[len(b)-1] == '\n' || b[len(b)-1] == ' ' || b[len(b)-1] == '\r') {
		b = b[:len(b)-1]
	}
	return b
}

func (a attestCmd) activate(dev, chPath, out string) int {
	var ch attest.Challenge
	if err := attest.ReadJSON(chPath, attest.ChallengeFormat, &ch); err != nil {
		return a.fail(2, "%v", err)
	}
	k, err := tpmkey.Open(dev)
	if err != nil {
		return a.fail(2, "%v", err)
	}
	defer k.Close()
	secret, err := attest.Activate(k.Transport(), &ch)
	if err != nil {
		return a.fail(1, "%s: %v", chPath, err)
	}
	if err := manifest.WriteAtomic(filepath.Dir(out), filepath.Base(out), []byte(hex.EncodeToString(secret)+"\n")); err != nil {
		return a.fail(2, "%v", err)
	}
	fmt.Fprintf(a.stdout, "answer %s\n", pr(out))
	return 0
}

func (a attestCmd) quote(dev, dir, nonceHex, out string) int {
	var nonce []byte
	if nonceHex == "" {
		nonce = make([]byte, 32)
		rand.Read(nonce)
	} else {
		var err error
		if nonce, err = hex.DecodeString(nonceHex); err != nil || len(nonce) == 0 || len(nonce) > 64 {
			return a.fail(2, "--nonce %q: want 1 to 64 bytes of hex", nonceHex)
		}
	}
	var ev attest.Evidence
	var err error
	if ev.PassageLog, err = os.ReadFile(filepath.Join(dir, "manifest.dsse.json"+manifest.EventLogSuffix)); err != nil {
		return a.fail(2, "%v", err)
	}
	if ev.FirmwareLog, err = readAtMost(attest.FirmwareLogPath, attest.MaxFirmwareLog); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return a.fail(2, "firmware event log: %v", err)
	}
	k, err := tpmkey.Open(dev)
	if err != nil {
		return a.fail(2, "%v", err)
	}
	defer k.Close()
	att, err := attest.Collect(k.Transport(), tpmkey.Template(), nonce, ev)
	if err != nil {
		return a.fail(1, "%v", err)
	}
	b, err := att.Marshal()
	if err != nil {
		return a.fail(2, "%v", err)
	}
	if err := manifest.WriteAtomic(filepath.Dir(out), filepath.Base(out), b); err != nil {
		return a.fail(2, "%v", err)
	}
	fmt.Fprintf(a.stdout, "attestation %s, nonce %x\n", pr(out), nonce)
	return 0
}

// readAtMost reads path, refusing more than max bytes (securityfs reports no size).
func readAtMost(path string, max int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err == nil && int64(len(b)) > max {
		err = fmt.Errorf("%s: over %d bytes", path, max)
	}
	return b, err
}

// attestFlags are verify's --attest flags: the attestation published beside the
// manifest, and what the verifier holds it to.
type attestFlags struct {
	att, node, ekCA, approved, nonce, nonces string
	update                                   bool
}

func (f *attestFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.att, "attest", "", "also verify the attestation `FILE` beside the manifest (MANIFEST.attest.json): with --node, --ek-ca, --approved")
	fs.StringVar(&f.node, "node", "", "with --attest: the node record `FILE` (passage attest enroll)")
	fs.StringVar(&f.ekCA, "ek-ca", "", "with --attest: the operator's EK CA certificates `FILE` (PEM)")
	fs.StringVar(&f.approved, "approved", "", "with --attest: the approved image `FILE` (Authenticode hashes, PCR 11 values, db certificates)")
	fs.StringVar(&f.nonce, "nonce", "", "with --attest: the nonce given to the node, `HEX` (default: the manifest's payload digest, the boot's own)")
	fs.StringVar(&f.nonces, "nonces", "", "with --attest: the verifier's nonce store `FILE` (passage attest nonce, passage.url's GET): the attestation's nonce must be one it issued and not yet used, and is used up")
	fs.BoolVar(&f.update, "update-node", false, "with --attest: record the accepted reset count and generation in the node record")
}

// check verifies the attestation for the manifest v, which the TPM key in tpmPub
// verified; it prints why it refuses and returns the exit status (0: accepted, with
// lines for the summary).
func (f *attestFlags) check(path string, v *manifest.Verified, tpmPub string, stderr io.Writer) ([]string, int) {
	fail := func(code int, format string, args ...any) ([]string, int) {
		fmt.Fprintf(stderr, "passage verify: "+format+"\n", args...)
		return nil, code
	}
	if f.node == "" || f.ekCA == "" || f.approved == "" {
		return fail(2, "--attest needs --node, --ek-ca and --approved")
	}
	var nonce []byte
	if f.nonce != "" {
		var err error
		if nonce, err = hex.DecodeString(f.nonce); err != nil || len(nonce) == 0 {
			return fail(2, "--nonce %q: not hex", f.nonce)
		}
	}
	var store *attest.NonceStore
	if f.nonces != "" {
		if nonce != nil {
			return fail(2, "--nonce and --nonces: give one")
		}
		store = &attest.NonceStore{Path: f.nonces, Logf: func(format string, args ...any) {
			fmt.Fprintf(stderr, "passage verify: "+format+"\n", args...)
		}}
	}
	var rec attest.NodeRecord
	if err := attest.ReadJSON(f.node, attest.NodeFormat, &rec); err != nil {
		return fail(2, "--node: %v", err)
	}
	caPEM, err := os.ReadFile(f.ekCA)
	if err != nil {
		return fail(2, "--ek-ca: %v", err)
	}
	pool, err := attest.CAPool(caPEM)
	if err != nil {
		return fail(2, "--ek-ca %s: %v", f.ekCA, err)
	}
	ap, err := attest.ReadApproved(f.approved)
	if err != nil {
		return fail(2, "--approved: %v", err)
	}
	att, err := attest.ReadAttestation(f.att)
	if err != nil {
		return fail(2, "%v", err)
	}
	key, err := manifest.LoadVerifier(tpmPub)
	if err != nil {
		return fail(2, "--tpm-pub: %v", err)
	}
	res, err := attest.Verify(&rec, att, attest.Manifest{Payload: v.Payload, Generation: v.Manifest.Generation, Signer: key.Public()},
		attest.Policy{EKCA: pool, Approved: ap, Nonce: nonce, Nonces: store})
	if err != nil {
		return fail(1, "%s: REFUSED: attestation %s: %s", path, f.att, oneLine(err))
	}
	if f.update {
		// Read again and written under the record's lock: another verify of this node
		// may have recorded a newer generation since this one read the record.
		if err := attest.RecordSeen(f.node, res.Seen); err != nil {
			if attest.CheckOf(err) != "" {
				return fail(1, "%s: REFUSED: --update-node %s: %s", path, f.node, oneLine(err))
			}
			return fail(2, "--update-node: %v", err)
		}
	}
	return []string{
		fmt.Sprintf("attested    EK certified by the operator's CA, AK enrolled, signing key certified; TPM reset count %d", res.ResetCount),
		fmt.Sprintf("  image     Secure Boot by %s, Authenticode %x, PCR 11 %x", pr(res.Firmware.Authority), res.Firmware.Image, []byte(att.PCRs[11])),
	}, 0
}
