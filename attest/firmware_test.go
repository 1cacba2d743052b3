package attest

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"math/big"
	"os"
	"strings"
	"testing"
	"time"
)

// The fixture is a real boot (testdata/README.md): OVMF's Secure Boot build started the
// signed UKI scenario 9 builds, the TPM quoted its PCRs, and the approved set is what
// the operator computed from that UKI with osslsigncode and systemd-measure.
func firmwareFixture(t *testing.T) (raw []byte, quoted map[int]HexBytes, ap *Approved) {
	t.Helper()
	raw, err := os.ReadFile("testdata/ovmf-secureboot.log")
	if err != nil {
		t.Fatal(err)
	}
	var p struct {
		PCRs map[int]HexBytes `json:"pcrs"`
	}
	b, err := os.ReadFile("testdata/ovmf-secureboot.pcrs.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &p); err != nil {
		t.Fatal(err)
	}
	ap = &Approved{}
	if b, err = os.ReadFile("testdata/ovmf-secureboot.approved.json"); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, ap); err != nil {
		t.Fatal(err)
	}
	if err := ap.Parse(); err != nil {
		t.Fatal(err)
	}
	return raw, p.PCRs, ap
}

// appendApplication appends to a TCG crypto-agile log an EV_EFI_BOOT_SERVICES_APPLICATION
// event in PCR 4 with digest as its sha256, as firmware logs an image it starts, and
// returns the log and the quoted PCR 4 extended with it.
func appendApplication(t *testing.T, raw []byte, pcr4 HexBytes, digest []byte) ([]byte, HexBytes) {
	t.Helper()
	// UEFI_IMAGE_LOAD_EVENT: location, length and link address of the image, an empty
	// device path.
	load := binary.LittleEndian.AppendUint32(make([]byte, 24), 8)
	load = append(load, make([]byte, 8)...)
	return appendEvent(t, raw, 4, pcr4, evBootServicesApplication, digest, load)
}

// appendEvent appends to a TCG crypto-agile log an event of type typ in PCR pcr with
// digest as its sha256 (the other banks the log declares get the digest's hash in their
// size) and data as its data, and returns the log and the quoted value (was) extended
// with it: an event that really happened, however the log labels it.
func appendEvent(t *testing.T, raw []byte, pcr int, was HexBytes, typ uint32, digest, data []byte) ([]byte, HexBytes) {
	t.Helper()
	// The first event is the TCG_PCR_EVENT of the Spec ID Event03 (TCG PC Client
	// Platform Firmware Profile 10.4.5.1): its algorithms follow a 24-byte header.
	le := binary.LittleEndian
	size := le.Uint32(raw[28:])
	ev := raw[32 : 32+size]
	if !bytes.HasPrefix(ev, []byte("Spec ID Event03\x00")) {
		t.Fatalf("the fixture's first event is not a Spec ID Event03")
	}
	n := int(le.Uint32(ev[24:]))
	var e bytes.Buffer
	binary.Write(&e, le, uint32(pcr))
	binary.Write(&e, le, typ)
	binary.Write(&e, le, uint32(n))
	for i := 0; i < n; i++ {
		alg, dsize := le.Uint16(ev[28+4*i:]), int(le.Uint16(ev[30+4*i:]))
		binary.Write(&e, le, alg)
		d := digest
		if alg != 0x000b { // TPM_ALG_SHA256
			h := sha256.Sum256(digest)
			d = bytes.Repeat(h[:], 2)[:dsize]
		}
		e.Write(d)
	}
	binary.Write(&e, le, uint32(len(data)))
	e.Write(data)
	h := sha256.New()
	h.Write(was)
	h.Write(digest)
	return append(append([]byte(nil), raw...), e.Bytes()...), h.Sum(nil)
}

func TestVerifyFirmware(t *testing.T) {
	raw, quoted, ap := firmwareFixture(t)
	res, err := VerifyFirmware(raw, quoted, ap)
	if err != nil {
		t.Fatalf("the approved boot: %v", err)
	}
	if !bytes.Equal(res.Image, ap.Authenticode[0]) || !strings.Contains(res.Authority, "SnakeOil") {
		t.Errorf("result %+v: want image %x verified by the snakeoil db certificate", res, []byte(ap.Authenticode[0]))
	}

	other := sha256.Sum256([]byte("another application"))
	with := func(f func(q map[int]HexBytes, a *Approved) []byte) ([]byte, map[int]HexBytes, *Approved) {
		q := map[int]HexBytes{}
		for k, v := range quoted {
			q[k] = v
		}
		a := *ap
		return f(q, &a), q, &a
	}
	// relabel appends an unapproved application that really ran (PCR 4 holds it) and
	// relogs it as typ.
	relabel := func(q map[int]HexBytes, typ uint32) []byte {
		l, pcr4 := appendApplication(t, raw, q[4], other[:])
		q[4] = pcr4
		binary.LittleEndian.PutUint32(l[len(raw)+4:], typ)
		return l
	}
	// A UKI whose command line was overridden (systemd-stub measures the LoadOptions it
	// takes instead of .cmdline into PCR 12, as UTF-16 with the NUL).
	var cmdline []byte
	for _, r := range "console=ttyS0 rdinit=/bin/sh\x00" {
		cmdline = binary.LittleEndian.AppendUint16(cmdline, uint16(r))
	}
	override := sha256.Sum256(cmdline)
	withOverride := func(q map[int]HexBytes) []byte {
		l, pcr12 := appendEvent(t, raw, 12, q[12], evIPL, override[:], cmdline)
		q[12] = pcr12
		return l
	}

	// Events that are what they say pass: an EV_EFI_ACTION whose digest is its data's,
	// a PCR 12 event the approved policy names.
	ret := []byte("Returning from EFI Application from Boot Option")
	rh := sha256.Sum256(ret)
	l, q, a := with(func(q map[int]HexBytes, a *Approved) []byte {
		l, pcr4 := appendEvent(t, raw, 4, q[4], evEFIAction, rh[:], ret)
		q[4] = pcr4
		a.PCR12Events = []HexBytes{override[:]}
		if err := a.Parse(); err != nil {
			t.Fatal(err)
		}
		l, q[12] = appendEvent(t, l, 12, q[12], evIPL, override[:], cmdline)
		return l
	})
	if _, err := VerifyFirmware(l, q, a); err != nil {
		t.Errorf("an EV_EFI_ACTION over its data in PCR 4 and an approved PCR 12 event: %v", err)
	}

	for _, c := range []struct {
		name, check, words string
		change             func(q map[int]HexBytes, a *Approved) []byte
	}{
		{"the image is not approved", "PCR 4", "not approved was loaded", func(q map[int]HexBytes, a *Approved) []byte {
			a.Authenticode = []HexBytes{other[:]}
			return raw
		}},
		{"an application that is not approved ran too", "PCR 4", "not approved was loaded", func(q map[int]HexBytes, a *Approved) []byte {
			l, pcr4 := appendApplication(t, raw, q[4], other[:])
			q[4] = pcr4
			return l
		}},
		{"an event the quote does not hold", "PCR 4", "does not replay", func(q map[int]HexBytes, a *Approved) []byte {
			l, _ := appendApplication(t, raw, q[4], ap.Authenticode[0])
			return l
		}},
		{"PCR 11 not approved", "PCR 11", "not an approved UKI's", func(q map[int]HexBytes, a *Approved) []byte {
			a.PCR11 = []HexBytes{other[:]}
			return raw
		}},
		{"a PCR the log has no event for is not zero", "PCR 12", "no event for it", func(q map[int]HexBytes, a *Approved) []byte {
			q[12] = other[:]
			return raw
		}},
		{"another db certificate", "PCR 7", "not an approved db certificate", func(q map[int]HexBytes, a *Approved) []byte {
			a.DBCertificates = []string{testCA(t)}
			if err := a.Parse(); err != nil {
				t.Fatal(err)
			}
			return raw
		}},
		{"an unapproved image relogged as EV_EFI_ACTION", "PCR 4", "(EV_EFI_ACTION, 0x80000007): digest", func(q map[int]HexBytes, a *Approved) []byte {
			return relabel(q, evEFIAction)
		}},
		{"an unapproved image relogged as EV_IPL", "PCR 4", "(EV_IPL, 0x0000000d): a type this PCR may not hold", func(q map[int]HexBytes, a *Approved) []byte {
			return relabel(q, evIPL)
		}},
		{"an unapproved image relogged as EV_EFI_BOOT_SERVICES_DRIVER", "PCR 4", "(EV_EFI_BOOT_SERVICES_DRIVER, 0x80000004): a type this PCR may not hold", func(q map[int]HexBytes, a *Approved) []byte {
			return relabel(q, 0x80000004)
		}},
		{"an unapproved image relogged as EV_SEPARATOR", "PCR 4", "(EV_SEPARATOR, 0x00000004): digest", func(q map[int]HexBytes, a *Approved) []byte {
			return relabel(q, evSeparator)
		}},
		{"an EV_EFI_ACTION whose data is not its digest's", "PCR 4", "is not the sha256 of its data", func(q map[int]HexBytes, a *Approved) []byte {
			l, pcr4 := appendEvent(t, raw, 4, q[4], evEFIAction, other[:], []byte("Returning from EFI Application from Boot Option"))
			q[4] = pcr4
			return l
		}},
		{"a PCR 7 EV_EFI_ACTION whose data is not its digest's", "PCR 7", "invalid digest for EFI Action", func(q map[int]HexBytes, a *Approved) []byte {
			l, pcr7 := appendEvent(t, raw, 7, q[7], evEFIAction, other[:], []byte("DMA Protection Disabled"))
			q[7] = pcr7
			return l
		}},
		{"a PCR 7 separator whose data is not its digest's", "PCR 7", "separator", func(q map[int]HexBytes, a *Approved) []byte {
			l, pcr7 := appendEvent(t, raw, 7, q[7], evSeparator, other[:], []byte{0, 0, 0, 0})
			q[7] = pcr7
			return l
		}},
		{"a PCR 11 separator whose data is not its digest's", "PCR 11", "(EV_SEPARATOR, 0x00000004): digest", func(q map[int]HexBytes, a *Approved) []byte {
			l, pcr11 := appendEvent(t, raw, 11, q[11], evSeparator, other[:], []byte{0, 0, 0, 0})
			q[11] = pcr11
			a.PCR11 = append(a.PCR11, pcr11)
			return l
		}},
		{"a kernel command line override in PCR 12", "PCR 12", "event 1 of PCR 12 (EV_IPL, 0x0000000d), digest " + hex.EncodeToString(override[:]), func(q map[int]HexBytes, a *Approved) []byte {
			return withOverride(q)
		}},
		{"no log", "firmware event log", "empty", func(q map[int]HexBytes, a *Approved) []byte { return nil }},
		{"a truncated log", "firmware event log", "", func(q map[int]HexBytes, a *Approved) []byte { return raw[:len(raw)-7] }},
	} {
		l, q, a := with(c.change)
		_, err := VerifyFirmware(l, q, a)
		if CheckOf(err) != c.check || !strings.Contains(err.Error(), c.words) {
			t.Errorf("%s: %v, want refused by %s saying %q", c.name, err, c.check, c.words)
		}
	}
}

// testCA is a self-signed certificate that signed no image.
func testCA(t *testing.T) string {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "not the db"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
}
