package attest

import (
	"bytes"
	"crypto"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"slices"
	"strings"

	goattest "github.com/google/go-attestation/attest"
)

// ApprovedFormat names the approved-image file's shape.
const ApprovedFormat = "passage-approved/1"

// Approved is the image the operator approved: the Authenticode (PE image) SHA-256 of
// each approved signed UKI, the PCR 11 value each yields (systemd-measure calculate
// --phase=: of the UKI), and the db certificates whose signature the firmware may have
// checked it with.
type Approved struct {
	Format         string     `json:"format"`
	Authenticode   []HexBytes `json:"authenticode_sha256"`
	PCR11          []HexBytes `json:"pcr11_sha256"`
	DBCertificates []string   `json:"db_certificates"` // PEM
	certs          []*x509.Certificate
}

// ReadApproved reads and checks an approved-image file.
func ReadApproved(path string) (*Approved, error) {
	var a Approved
	if err := ReadJSON(path, ApprovedFormat, &a); err != nil {
		return nil, fmt.Errorf("approved image: %w", err)
	}
	if err := a.Parse(); err != nil {
		return nil, fmt.Errorf("approved image %s: %w", path, err)
	}
	return &a, nil
}

// Parse checks the lists are there and parses the certificates.
func (a *Approved) Parse() error {
	if len(a.Authenticode) == 0 || len(a.PCR11) == 0 || len(a.DBCertificates) == 0 {
		return errors.New("needs authenticode_sha256, pcr11_sha256 and db_certificates")
	}
	for _, l := range [][]HexBytes{a.Authenticode, a.PCR11} {
		for _, h := range l {
			if len(h) != 32 {
				return fmt.Errorf("digest %x: %d bytes, want 32", []byte(h), len(h))
			}
		}
	}
	a.certs = nil
	for i, p := range a.DBCertificates {
		b, _ := pem.Decode([]byte(p))
		if b == nil || b.Type != "CERTIFICATE" {
			return fmt.Errorf("db certificate %d: not a PEM CERTIFICATE", i+1)
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return fmt.Errorf("db certificate %d: %w", i+1, err)
		}
		a.certs = append(a.certs, c)
	}
	return nil
}

// FirmwareResult is what the firmware log showed.
type FirmwareResult struct {
	// Authority is the subject of the db certificate that verified the image.
	Authority string
	// Image is the approved Authenticode hash of the last application PCR 4's log shows.
	Image []byte
}

// evBootServicesApplication is EV_EFI_BOOT_SERVICES_APPLICATION (TCG PC Client Platform
// Firmware Profile section 10.4.1): a UEFI application loaded, its digest the
// Authenticode hash of the PE image.
const evBootServicesApplication = 0x80000003

// VerifyFirmware replays the firmware's TCG event log into the quoted PCRs (all but
// PCR 13, which only passage extends) with go-attestation and checks the approved image
// booted: Secure Boot on, every authority that verified an image after the separator an
// approved db certificate (PCR 7); every application PCR 4's log shows is an approved
// Authenticode hash (the raw PCR 4 value depends on the boot options tried first, so it
// is not pinned); PCR 11
// is an approved UKI's. A PCR the log says nothing about must hold its reset value:
// go-attestation accepts any value for a PCR without events.
func VerifyFirmware(raw []byte, quoted map[int]HexBytes, ap *Approved) (*FirmwareResult, error) {
	if len(raw) == 0 {
		return nil, refuse("firmware event log", "empty: the node gave no firmware event log (%s), so nothing shows what it booted", FirmwareLogPath)
	}
	if ap.certs == nil {
		if err := ap.Parse(); err != nil {
			return nil, fmt.Errorf("approved image: %w", err)
		}
	}
	el, err := goattest.ParseEventLog(raw)
	if err != nil {
		return nil, refuse("firmware event log", "%v", err)
	}
	var pcrs []goattest.PCR
	for _, i := range QuotedPCRs {
		if i == ManifestPCR {
			continue
		}
		pcrs = append(pcrs, goattest.PCR{Index: i, Digest: quoted[i], DigestAlg: crypto.SHA256})
	}
	events, err := el.Verify(pcrs)
	if err != nil {
		var re goattest.ReplayError
		if errors.As(err, &re) && len(re.InvalidPCRs) > 0 {
			names := make([]string, len(re.InvalidPCRs))
			for i, p := range re.InvalidPCRs {
				names[i] = fmt.Sprint(p)
			}
			return nil, refuse("PCR "+names[0], "the firmware event log does not replay to the quoted PCR(s) %s", strings.Join(names, ", "))
		}
		return nil, refuse("firmware event log", "%v", err)
	}
	logged := map[int]bool{}
	for _, e := range events {
		logged[e.Index] = true
	}
	for _, p := range pcrs {
		if !logged[p.Index] && !bytes.Equal(p.Digest, make([]byte, len(p.Digest))) {
			return nil, refuse(fmt.Sprintf("PCR %d", p.Index), "quoted %x but the firmware event log has no event for it", p.Digest)
		}
	}
	sb, err := goattest.ParseSecurebootState(events)
	if err != nil {
		return nil, refuse("PCR 7", "Secure Boot state: %v", err)
	}
	if !sb.Enabled {
		return nil, refuse("PCR 7", "Secure Boot is off")
	}
	if len(sb.PostSeparatorAuthority) == 0 {
		return nil, refuse("PCR 7", "no db certificate verified an image after the separator")
	}
	res := &FirmwareResult{}
	for _, c := range sb.PostSeparatorAuthority {
		if !slices.ContainsFunc(ap.certs, func(a *x509.Certificate) bool { return bytes.Equal(a.Raw, c.Raw) }) {
			return nil, refuse("PCR 7", "an image was verified by %q, not an approved db certificate", c.Subject.String())
		}
		res.Authority = c.Subject.String()
	}
	// Every application the firmware started is approved, not only one of them: an
	// application that ran first (one the db's other certificates sign) could have
	// started the approved image after doing what it liked.
	for _, e := range events {
		if e.Index != 4 || uint32(e.Type) != evBootServicesApplication {
			continue
		}
		if !slices.ContainsFunc(ap.Authenticode, func(h HexBytes) bool { return bytes.Equal(h, e.Digest) }) {
			return nil, refuse("PCR 4", "an image that is not approved was loaded (Authenticode sha256 %x)", e.Digest)
		}
		res.Image = e.Digest
	}
	if res.Image == nil {
		return nil, refuse("PCR 4", "no approved image was loaded (no EV_EFI_BOOT_SERVICES_APPLICATION event)")
	}
	if !slices.ContainsFunc(ap.PCR11, func(h HexBytes) bool { return bytes.Equal(h, quoted[11]) }) {
		return nil, refuse("PCR 11", "%x is not an approved UKI's", []byte(quoted[11]))
	}
	return res, nil
}
