package boot

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/topology"
	"github.com/passage-boot/passage/vfiobind"

	"github.com/u-root/u-root/pkg/mount"
)

// EnvelopeName and PayloadName are the files the manifest stage writes in /run/passage.
const (
	EnvelopeName = "manifest.dsse.json"
	PayloadName  = "manifest.json"
	// OutMount is where passage.out's device is mounted.
	OutMount = "/run/passage-out"
	// GenerationFile keeps the generation counter in passage.out's directory.
	GenerationFile = "generation"
)

func (b *Boot) mountOut() (dir string, unmount func() error, err error) {
	out := b.Config.Out
	if out.Device == "" {
		return "", func() error { return nil }, nil
	}
	mnt := b.path(OutMount)
	m := b.Mount
	if m == nil {
		m = func(dev, dir string) (func() error, error) {
			mp, err := mount.TryMount(dev, dir, "", 0, func() error { return os.MkdirAll(dir, 0o755) })
			if err != nil {
				return nil, err
			}
			return func() error { return mp.Unmount(0) }, nil
		}
	}
	un, err := m(b.path(out.Device), mnt)
	if err != nil {
		return "", nil, fmt.Errorf("passage.out %s: mount: %w", out, err)
	}
	dir = filepath.Join(mnt, out.Path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		un()
		return "", nil, fmt.Errorf("passage.out %s: %w", out, err)
	}
	return dir, un, nil
}

func (b *Boot) manifestUnits() []manifest.Unit {
	bind := map[string]vfiobind.FunctionReport{}
	if b.Bind != nil {
		for _, u := range b.Bind.Units {
			for _, f := range u.Functions {
				bind[f.Addr.String()] = f
			}
		}
	}
	ats := map[int][]manifest.Finding{}
	for _, f := range b.ATS {
		sev := "info"
		if f.Missing() {
			sev = "warning"
		}
		ats[f.Unit] = append(ats[f.Unit], manifest.Finding{Object: f.Addr.String(), Severity: sev, Message: f.String()})
	}
	var out []manifest.Unit
	for _, u := range b.Units {
		mu := manifest.Unit{ID: UnitID(u.ID), Status: string(u.Status), Reasons: u.Reasons, NUMANode: u.NUMANode,
			ACSChanges: b.ACS[u.ID], ATSFindings: ats[u.ID]}
		if mu.Status == "" {
			mu.Status = string(topology.StatusReady)
		}
		roles := map[string]topology.Role{}
		if u.GPU != nil {
			roles[u.GPU.Addr.String()] = topology.RoleGPU
		}
		for _, d := range u.NICs {
			roles[d.Addr.String()] = topology.RoleGPUNIC
		}
		for _, d := range u.DataDirect {
			roles[d.Addr.String()] = topology.RoleDataDirect
		}
		for _, d := range u.NVMe {
			roles[d.Addr.String()] = topology.RoleGPUNVMe
		}
		for _, d := range u.Functions() {
			if d == nil {
				continue
			}
			bdf := d.Addr.String()
			f := manifest.Function{
				BDF: bdf, Vendor: fmt.Sprintf("0x%04x", d.VendorID), Device: fmt.Sprintf("0x%04x", d.DeviceID),
				SubsystemVendor: fmt.Sprintf("0x%04x", d.SubsystemVendor), SubsystemDevice: fmt.Sprintf("0x%04x", d.SubsystemDevice),
				Class: fmt.Sprintf("0x%06x", d.Class), Role: string(roles[bdf]), IOMMUGroup: d.IOMMUGroup, NUMANode: d.NUMANode,
				DriverBefore: d.Driver, DriverAfter: d.Driver,
			}
			if br, ok := bind[bdf]; ok {
				f.DriverBefore, f.DriverAfter, f.IOMMUGroup = br.DriverBefore, br.DriverAfter, br.Group
			}
			mu.Functions = append(mu.Functions, f)
		}
		out = append(out, mu)
	}
	return out
}

func stageResults(rs []stages.Result) []manifest.StageResult {
	out := make([]manifest.StageResult, 0, len(rs))
	for _, r := range rs {
		sr := manifest.StageResult{Name: r.Name, Status: string(r.Status), Duration: r.Duration, Changes: r.Changes}
		for _, f := range r.Findings {
			sr.Findings = append(sr.Findings, manifest.Finding{Object: r.Name, Severity: "info", Message: f})
		}
		if r.Err != nil {
			sev := "error"
			if r.Status == stages.Skipped {
				sev = "info"
			}
			sr.Findings = append(sr.Findings, manifest.Finding{Object: r.Name, Severity: sev, Message: r.Err.Error()})
		}
		out = append(out, sr)
	}
	return out
}

// manifest builds, signs and writes the manifest; it runs whatever happened before so the
// hypervisor always learns what this boot did. Failing to sign still leaves the unsigned
// payload in /run/passage for an operator, and fails the stage.
func (b *Boot) manifest(ctx context.Context, st *stages.State, r *stages.Result) error {
	var errs []string
	m, err := manifest.Build(b.Root, b.now())
	if err != nil {
		// Without a boot id the hypervisor cannot match the manifest to this boot, but an
		// operator still needs it.
		errs = append(errs, err.Error())
		m = &manifest.Manifest{SchemaVersion: manifest.SchemaVersion, GenerationSource: manifest.GenerationNone, Time: b.now().UTC(), KernelCmdline: b.Config.Cmdline}
	}
	errs = append(errs, b.Config.ErrorStrings()...)
	if b.Profile != nil {
		m.Profile = manifest.Profile{Name: b.Profile.Name}
	} else {
		m.Profile = manifest.Profile{Name: b.Config.Profile}
	}
	m.Units = b.manifestUnits()
	m.Stages = stageResults(st.Results())

	outDir, unmount, err := b.mountOut()
	if err != nil {
		errs = append(errs, err.Error())
		r.Degrade("%v", err)
	}
	var counters []manifest.Counter
	if outDir != "" {
		counters = append(counters, manifest.FileCounter{Path: filepath.Join(outDir, GenerationFile)})
	}
	if len(counters) > 0 {
		gen, src, err := manifest.NextGeneration(counters...)
		m.Generation, m.GenerationSource = gen, src
		if err != nil {
			errs = append(errs, err.Error())
		}
	}
	m.Errors = errs
	b.Manifest = m

	dir := b.RunDir()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("manifest %s: %w", dir, err)
	}
	payload, err := manifest.Marshal(m)
	if err != nil {
		return err
	}
	if err := manifest.WriteAtomic(dir, PayloadName, payload); err != nil {
		return err
	}

	signer, meas, serr := b.signer()
	if serr != nil {
		r.Findingf("%v", serr)
	}
	if signer == nil {
		b.Mark("manifest-written")
		return fmt.Errorf("manifest: unsigned (%s written): %w", PayloadName, serr)
	}
	signed, err := manifest.WriteSigned(ctx, m, dir, EnvelopeName, signer, meas)
	if err != nil {
		return err
	}
	b.Signed = signed
	b.Mark("manifest-written")
	r.Changef("%s %s generation %d (%s)", EnvelopeName, signed.Digest, m.Generation, m.GenerationSource)

	if outDir != "" {
		if err := copyFiles(dir, outDir); err != nil {
			r.Degrade("passage.out: %v", err)
		} else {
			r.Changef("copied to %s", b.Config.Out)
		}
		if err := unmount(); err != nil {
			r.Degrade("passage.out: unmount: %v", err)
		}
	}
	return nil
}

// signer prefers the TPM when passage.tpm allows one and finds one; else the key file.
// An error with a signer is a note (why not the TPM); without one, why nothing signs.
func (b *Boot) signer() (manifest.Signer, manifest.Measurer, error) {
	var tpmErr error
	if b.Config.TPM != initramfs.TPMOff {
		if b.Domain.TPM == nil {
			tpmErr = errors.New("tpm: not built yet")
		} else {
			s, m, err := b.Domain.TPM(b.Root)
			if err == nil {
				return s, m, nil
			}
			tpmErr = err
		}
		if b.Config.TPM == initramfs.TPMOn {
			return nil, nil, fmt.Errorf("passage.tpm=on: %w", tpmErr)
		}
	}
	s, err := manifest.LoadSigner(b.path(b.Config.Key))
	if err != nil {
		return nil, nil, errors.Join(tpmErr, fmt.Errorf("key %s: %w", b.Config.Key, err))
	}
	if tpmErr != nil {
		// Signed all the same; the finding says why not by the TPM.
		return s, nil, fmt.Errorf("signed with %s: %w", b.Config.Key, tpmErr)
	}
	return s, nil, nil
}

// copyFiles copies every regular file of src into dst atomically, so a power cut leaves
// either the previous boot's files or this one's.
func copyFiles(src, dst string) error {
	ents, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	sort.Slice(ents, func(i, j int) bool { return ents[i].Name() < ents[j].Name() })
	var errs []string
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		data, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err == nil {
			err = manifest.WriteAtomic(dst, e.Name(), data)
		}
		if err != nil {
			errs = append(errs, err.Error())
		}
	}
	if len(errs) > 0 {
		return errors.New(strings.Join(errs, "; "))
	}
	return nil
}
