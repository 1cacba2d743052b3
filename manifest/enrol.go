package manifest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
)

// EnrolmentFormat names the enrolment file's shape; it changes only with a new name.
const EnrolmentFormat = "passage-enrolment/1"

// EnrolmentSuffix ends an enrolment file's name: node-a.pub is enrolled by
// node-a.enrol.json beside it.
const EnrolmentSuffix = ".enrol.json"

// Enrolment binds a public key to one node: written when the key is made on the node
// (passage keygen --enrol, passage tpm-pubkey --enrol), kept beside the .pub in the
// hypervisor's key directory. A manifest signed by the key is accepted only when its
// node is the enrolled one (Enrolment.Check): a node's key cannot speak for another node.
type Enrolment struct {
	Format string `json:"format"` // EnrolmentFormat
	KeyID  string `json:"key_id"` // KeyID of the public key beside it
	// Node is the identity read on the node at enrolment: DMI product UUID and serial
	// (at least one), and the hostname when the operator wants it held too ("" : not
	// checked).
	Node EnrolledNode `json:"node"`
}

// EnrolledNode is the node an enrolment names.
type EnrolledNode struct {
	DMIUUID   string `json:"dmi_uuid"`
	DMISerial string `json:"dmi_serial"`
	Hostname  string `json:"hostname,omitempty"`
}

// ErrWrongNode: the manifest's node is not the one its key is enrolled for, or the key
// is not enrolled for any.
var ErrWrongNode = errors.New("signed by a key not enrolled for this node")

// EnrolmentPath is where the enrolment of the public key file pub lives: its name without
// the extension, plus EnrolmentSuffix.
func EnrolmentPath(pub string) string {
	return strings.TrimSuffix(pub, filepath.Ext(pub)) + EnrolmentSuffix
}

// NewEnrolment enrols the key keyID (KeyID) for node, whose DMI UUID or serial must be
// known; withHostname holds the hostname too.
func NewEnrolment(keyID string, node Node, withHostname bool) (*Enrolment, error) {
	e := &Enrolment{Format: EnrolmentFormat, KeyID: keyID,
		Node: EnrolledNode{DMIUUID: node.DMIUUID, DMISerial: node.DMISerial}}
	if withHostname {
		e.Node.Hostname = node.Hostname
	}
	if err := e.valid(); err != nil {
		return nil, err
	}
	return e, nil
}

// WriteEnrolment writes e beside the public key file pub (EnrolmentPath).
func WriteEnrolment(pub string, e *Enrolment) (string, error) {
	b, err := json.MarshalIndent(e, "", "  ")
	if err != nil {
		return "", fmt.Errorf("enrolment: %w", err)
	}
	path := EnrolmentPath(pub)
	if err := WriteAtomic(filepath.Dir(path), filepath.Base(path), append(b, '\n')); err != nil {
		return "", fmt.Errorf("enrolment: %w", err)
	}
	return path, nil
}

// LoadEnrolment reads an enrolment file (a regular file of at most MaxKeyFileSize bytes,
// decoded strictly) and checks it names a node and the key v.
func LoadEnrolment(path string, v Verifier) (*Enrolment, error) {
	b, err := ReadRegular(path, MaxKeyFileSize)
	if err != nil {
		return nil, fmt.Errorf("enrolment %s: %w", path, err)
	}
	id, err := v.KeyID()
	if err != nil {
		return nil, err
	}
	e, err := ParseEnrolment(b, id)
	if err != nil {
		return nil, fmt.Errorf("enrolment %s: %w", path, err)
	}
	return e, nil
}

// ParseEnrolment decodes an enrolment strictly (no unknown field, no key given twice,
// nothing after it) and checks it names a node and the key keyID.
func ParseEnrolment(b []byte, keyID string) (*Enrolment, error) {
	if err := checkUniqueKeys(b); err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var e Enrolment
	if err := dec.Decode(&e); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, errors.New("trailing data")
	}
	if err := e.valid(); err != nil {
		return nil, err
	}
	if e.KeyID != keyID {
		return nil, fmt.Errorf("for key %s, the key beside it is %s", e.KeyID, keyID)
	}
	return &e, nil
}

func (e *Enrolment) valid() error {
	if e.Format != EnrolmentFormat {
		return fmt.Errorf("format %q, want %q", e.Format, EnrolmentFormat)
	}
	if e.Node.DMIUUID == "" && e.Node.DMISerial == "" {
		return errors.New("names no node: neither a DMI UUID nor a serial")
	}
	return nil
}

// String names the enrolled node.
func (e *Enrolment) String() string {
	s := "uuid " + orNone(e.Node.DMIUUID) + " serial " + orNone(e.Node.DMISerial)
	if e.Node.Hostname != "" {
		s += " hostname " + e.Node.Hostname
	}
	return s
}

func orNone(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// Check refuses m unless its node is the enrolled one: every field the enrolment holds
// equal (the DMI UUID without regard to case, as firmware varies in it).
func (e *Enrolment) Check(m *Manifest) error {
	n := m.Node
	var diff []string
	if e.Node.DMIUUID != "" && !strings.EqualFold(n.DMIUUID, e.Node.DMIUUID) {
		diff = append(diff, fmt.Sprintf("dmi_uuid %q", n.DMIUUID))
	}
	if e.Node.DMISerial != "" && n.DMISerial != e.Node.DMISerial {
		diff = append(diff, fmt.Sprintf("dmi_serial %q", n.DMISerial))
	}
	if e.Node.Hostname != "" && n.Hostname != e.Node.Hostname {
		diff = append(diff, fmt.Sprintf("hostname %q", n.Hostname))
	}
	if len(diff) == 0 {
		return nil
	}
	return verr(ErrWrongNode, "key %s is enrolled for %s; the manifest says %s", e.KeyID, e, strings.Join(diff, ", "))
}
