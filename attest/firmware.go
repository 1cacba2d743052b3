package attest

import (
	"bytes"
	"crypto"
	"crypto/sha256"
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
	// PCR12Events are the sha256 digests of the PCR 12 events the operator allows (a
	// systemd-stub credential or command-line measurement they expect); none by default:
	// a UKI's command line is its own, in PCR 11, and an override of it lands in PCR 12.
	PCR12Events []HexBytes `json:"pcr12_event_sha256,omitempty"`
	certs       []*x509.Certificate
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
	for _, l := range [][]HexBytes{a.Authenticode, a.PCR11, a.PCR12Events} {
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

// Event types of the TCG PC Client Platform Firmware Profile (section 10.4.1) that may
// appear in the PCRs whose events are judged one by one.
const (
	evIPL                     = 0x0000000d
	evSeparator               = 0x00000004
	evEventTag                = 0x00000006
	evVariableDriverConfig    = 0x80000001
	evBootServicesApplication = 0x80000003 // a UEFI application loaded; digest: its Authenticode hash
	evEFIAction               = 0x80000007
	evVariableAuthority       = 0x800000e0
)

// eventRule is what makes one logged event acceptable. A PCR's digest covers each
// event's digest, never its type or data: a rule that trusted the type alone would let
// an image that really ran be relogged as something harmless and still replay.
type eventRule int

const (
	// overData: the digest is defined as the hash of the event's own data, and is. An
	// image relabelled to such a type fails it: its data is a UEFI_IMAGE_LOAD_EVENT,
	// whose hash is not the image's Authenticode hash.
	overData eventRule = iota + 1
	// approvedImage: the digest is an approved Authenticode hash.
	approvedImage
	// pinnedPCR: the digest is over something else (systemd-stub's EV_IPL events hash a
	// section's content, their data is its name); the PCR's value is approved whole.
	pinnedPCR
)

// eventRules are, per PCR judged event by event, the only event types allowed there and
// the rule each must meet (Keylime's measured-boot policy judges PCR 4 and 7 the same
// way; go-attestation's ParseSecurebootState checks PCR 7 again, with the variables'
// meaning). PCR 12 is judged by ap.PCR12Events alone.
var eventRules = map[int]map[uint32]eventRule{
	4:  {evBootServicesApplication: approvedImage, evEFIAction: overData, evSeparator: overData},
	7:  {evVariableDriverConfig: overData, evVariableAuthority: overData, evEFIAction: overData, evSeparator: overData},
	11: {evIPL: pinnedPCR, evEventTag: pinnedPCR, evEFIAction: overData, evSeparator: overData},
}

// eventName names the event for a refusal: its place among its PCR's events and its type.
func eventName(e goattest.Event, n int) string {
	return fmt.Sprintf("event %d of PCR %d (%s, 0x%08x)", n, e.Index, e.Type, uint32(e.Type))
}

// checkEvents holds every event of PCRs 4, 7 and 11 to its rule, in log order, and
// returns the last approved image PCR 4 shows.
func checkEvents(events []goattest.Event, ap *Approved) ([]byte, error) {
	var image []byte
	seen := map[int]int{}
	for _, e := range events {
		rules, judged := eventRules[e.Index]
		if !judged {
			continue
		}
		seen[e.Index]++
		name, check := eventName(e, seen[e.Index]), fmt.Sprintf("PCR %d", e.Index)
		switch rules[uint32(e.Type)] {
		case approvedImage:
			if !slices.ContainsFunc(ap.Authenticode, func(h HexBytes) bool { return bytes.Equal(h, e.Digest) }) {
				return nil, evidence(check, "%s: an image that is not approved was loaded (Authenticode sha256 %x)", name, e.Digest)
			}
			image = e.Digest
		case overData:
			if h := sha256.Sum256(e.Data); !bytes.Equal(h[:], e.Digest) {
				return nil, refuse(check, "%s: digest %x is not the sha256 of its data (%x): the event is not what it says", name, e.Digest, h)
			}
			if uint32(e.Type) == evSeparator && !bytes.Equal(e.Data, []byte{0, 0, 0, 0}) {
				return nil, refuse(check, "%s: separator data %x, not 00000000 (the firmware reported an error)", name, e.Data)
			}
		case pinnedPCR:
		default:
			return nil, refuse(check, "%s: a type this PCR may not hold (an event whose digest is neither an approved image nor the hash of its data)", name)
		}
	}
	return image, nil
}

// checkPCR12 allows in PCR 12 only the events the approved set names: systemd-stub
// measures there a command line it took instead of the UKI's own (from the loader, as
// it does with Secure Boot off) and credentials it was given.
func checkPCR12(events []goattest.Event, ap *Approved) error {
	n := 0
	for _, e := range events {
		if e.Index != 12 {
			continue
		}
		n++
		if !slices.ContainsFunc(ap.PCR12Events, func(h HexBytes) bool { return bytes.Equal(h, e.Digest) }) {
			return evidence("PCR 12", "%s, digest %x: not an event the approved policy names (pcr12_event_sha256; a command line or credential the UKI did not carry)", eventName(e, n), e.Digest)
		}
	}
	return nil
}

// VerifyFirmware replays the firmware's TCG event log into the quoted PCRs (all but
// PCR 13, which only passage extends) with go-attestation and checks the approved image
// booted, refusing on the first that fails: Secure Boot on, every authority that
// verified an image after the separator an approved db certificate (PCR 7, with
// go-attestation's ParseSecurebootState); every event of PCRs 4, 7 and 11 an approved
// image or of a type whose digest is the hash of its data, and is (checkEvents); at least
// one approved application in PCR 4 (whose raw value depends on the boot options tried
// first, so it is not pinned); PCR 11 an approved UKI's; PCR 12 only events the approved
// policy names (checkPCR12). A PCR the log says nothing about must hold its reset value:
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
		return nil, evidence("PCR 7", "Secure Boot is off")
	}
	if len(sb.PostSeparatorAuthority) == 0 {
		return nil, evidence("PCR 7", "no db certificate verified an image after the separator")
	}
	res := &FirmwareResult{}
	for _, c := range sb.PostSeparatorAuthority {
		if !slices.ContainsFunc(ap.certs, func(a *x509.Certificate) bool { return bytes.Equal(a.Raw, c.Raw) }) {
			return nil, evidence("PCR 7", "an image was verified by %q, not an approved db certificate", c.Subject.String())
		}
		res.Authority = c.Subject.String()
	}
	// After Secure Boot: without it the firmware starts what it likes, and that is the
	// refusal to give first.
	if res.Image, err = checkEvents(events, ap); err != nil {
		return nil, err
	}
	if res.Image == nil {
		return nil, evidence("PCR 4", "no approved image was loaded (no EV_EFI_BOOT_SERVICES_APPLICATION event)")
	}
	if !slices.ContainsFunc(ap.PCR11, func(h HexBytes) bool { return bytes.Equal(h, quoted[11]) }) {
		return nil, evidence("PCR 11", "%x is not an approved UKI's", []byte(quoted[11]))
	}
	if err := checkPCR12(events, ap); err != nil {
		return nil, err
	}
	return res, nil
}
