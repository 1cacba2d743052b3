package manifest

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/passage-boot/passage/buildinfo"
)

// Build starts a manifest for this boot: schema version, this binary's build, node
// identity, boot id, kernel release and command line, all read under root ("/" on a live
// node, a temp dir in tests), and the time. The stages fill in the rest. A missing
// optional file (DMI on a VM, a root-only product_serial) leaves its field empty.
// boot_id is required because the hypervisor matches manifests to boots with it: without
// it Build returns the error and the manifest with everything else it read (the DMI
// serial and UUID, the hostname still say which node wrote it); Sign refuses a manifest
// with no identity at all.
func Build(root string, now time.Time) (*Manifest, error) {
	m := &Manifest{
		SchemaVersion:    SchemaVersion,
		Build:            ThisBuild(),
		GenerationSource: GenerationNone,
		Time:             now.UTC(),
	}
	var errs []error
	var err error
	if m.BootID, err = readTrimmed(root, "proc/sys/kernel/random/boot_id"); err != nil {
		errs = append(errs, fmt.Errorf("manifest: boot id: %w", err))
	} else if m.BootID == "" {
		errs = append(errs, fmt.Errorf("manifest: boot id: %s is empty", filepath.Join(root, "proc/sys/kernel/random/boot_id")))
	}
	if m.Node, err = ReadNode(root); err != nil {
		errs = append(errs, err)
	}
	if err := readOptional(root, []optionalFile{
		{&m.KernelRelease, "proc/sys/kernel/osrelease"},
		{&m.KernelCmdline, "proc/cmdline"},
	}); err != nil {
		errs = append(errs, err)
	}
	return m, errors.Join(errs...)
}

// Identified says whether m names the node that wrote it: a boot id, a hostname (not
// the kernel's "(none)" before one is set), a DMI serial or a DMI UUID. A manifest with
// none of them could be any node's and is never signed.
func (m *Manifest) Identified() error {
	host := m.Node.Hostname != "" && m.Node.Hostname != UnsetHostname
	if m.BootID == "" && !host && m.Node.DMISerial == "" && m.Node.DMIUUID == "" {
		return errors.New("manifest: no node identity (boot_id, hostname, dmi_serial and dmi_uuid all empty): it could be any node's")
	}
	return nil
}

// UnsetHostname is what the kernel's hostname reads before anything sets one (the
// default CONFIG_DEFAULT_HOSTNAME, init/Kconfig).
const UnsetHostname = "(none)"

// ReadNode reads the node's identity under root: hostname and DMI fields, each empty
// when its file is absent or unreadable (DMI on a VM, a root-only product_serial). The
// kernel's "(none)", what its hostname reads before anything sets one, is no name: the
// hostname is then empty, and nothing downstream (passage-dra's pool, passage-control's
// record) takes "(none)" for a node.
func ReadNode(root string) (Node, error) {
	var n Node
	err := readOptional(root, []optionalFile{
		{&n.Hostname, "proc/sys/kernel/hostname"},
		{&n.DMISerial, "sys/class/dmi/id/product_serial"},
		{&n.DMIUUID, "sys/class/dmi/id/product_uuid"},
		{&n.BoardName, "sys/class/dmi/id/board_name"},
		{&n.Vendor, "sys/class/dmi/id/sys_vendor"},
		{&n.Product, "sys/class/dmi/id/product_name"},
	})
	if n.Hostname == UnsetHostname {
		n.Hostname = ""
	}
	return n, err
}

type optionalFile struct {
	dst  *string
	path string
}

func readOptional(root string, files []optionalFile) error {
	for _, o := range files {
		v, err := readTrimmed(root, o.path)
		if err != nil && !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, fs.ErrPermission) {
			return fmt.Errorf("manifest: %w", err)
		}
		*o.dst = v
	}
	return nil
}

// ThisBuild is the running binary's build, as a manifest records it.
func ThisBuild() *buildinfo.Info {
	b := buildinfo.Read()
	return &b
}

func readTrimmed(root, rel string) (string, error) {
	b, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(b)), nil
}

// Marshal returns the canonical payload bytes: struct field order, no indentation, nil
// slices as [], time in UTC. The same Manifest always gives the same bytes, and
// Unmarshal(Marshal(m)) marshals back to them.
func Marshal(m *Manifest) ([]byte, error) {
	if m == nil {
		return nil, errors.New("manifest: marshal: nil manifest")
	}
	c := normalize(*m)
	b, err := encodeJSON(&c)
	if err != nil {
		return nil, fmt.Errorf("manifest: marshal: %w", err)
	}
	return b, nil
}

// encodeJSON is the payload's encoding of v: encoding/json without indentation or the
// trailing newline, and without HTML escaping (the payload is read by tools, not
// browsers: "<", ">" and "&" stay literal, in a Unit's MarshalJSON as everywhere).
func encodeJSON(v any) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}

// Digest is the payload's identity: "sha256:<hex>" of the canonical bytes. It is what the
// TPM PCR is extended with and what the event log records.
func Digest(payload []byte) string {
	sum := sha256.Sum256(payload)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func normalize(m Manifest) Manifest {
	m.Time = m.Time.UTC()
	m.NUMACPUs = nonNil(m.NUMACPUs)
	m.Units = nonNil(m.Units)
	for i := range m.Units {
		u := &m.Units[i]
		u.schema = m.SchemaVersion
		u.Reasons = nonNil(u.Reasons)
		u.Functions = nonNil(u.Functions)
		u.ACSChanges = nonNil(u.ACSChanges)
		u.ATSFindings = nonNil(u.ATSFindings)
		u.Erase = normalizeErase(u.Erase)
	}
	if m.NVLink != nil {
		nv := *m.NVLink
		nv.Partitions = nonNil(nv.Partitions)
		for i := range nv.Partitions {
			nv.Partitions[i] = nonNil(nv.Partitions[i])
		}
		m.NVLink = &nv
	}
	if m.GuestPlan != nil {
		g := *m.GuestPlan
		g.MatrixLabels = nonNil(g.MatrixLabels)
		g.HostMatrix = nonNil(g.HostMatrix)
		g.ExpectedGuest = nonNil(g.ExpectedGuest)
		if len(g.Plan) > 0 {
			var compact bytes.Buffer
			if json.Compact(&compact, g.Plan) == nil {
				g.Plan = compact.Bytes()
			}
		}
		m.GuestPlan = &g
	}
	m.Stages = nonNil(m.Stages)
	for i := range m.Stages {
		m.Stages[i].Findings = nonNil(m.Stages[i].Findings)
		m.Stages[i].Changes = nonNil(m.Stages[i].Changes)
	}
	m.Errors = nonNil(m.Errors)
	return m
}

// nonNil copies so that normalising never writes into the caller's slices.
func nonNil[T any](s []T) []T {
	out := make([]T, len(s))
	copy(out, s)
	return out
}
