package boot

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/initramfs/kubelet"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
	"github.com/passage-boot/passage/record"
	"github.com/passage-boot/passage/stages"
	"github.com/passage-boot/passage/topology"

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
	mnt, err := Beneath(b.Root, OutMount)
	if err != nil {
		return "", nil, fmt.Errorf("passage.out %s: mount point: %w", out, err)
	}
	dev, err := deviceBeneath(b.Root, out.Device)
	if err != nil {
		return "", nil, fmt.Errorf("passage.out %s: %w", out, err)
	}
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
	un, err := m(dev, mnt)
	if err != nil {
		return "", nil, fmt.Errorf("passage.out %s: mount: %w", out, err)
	}
	// The device's own file system cannot lead out of itself either.
	if dir, err = Beneath(mnt, out.Path); err != nil {
		un()
		return "", nil, fmt.Errorf("passage.out %s: %w", out, err)
	}
	return dir, un, nil
}

// conclude is every unit's final verdict: the decision's, worsened by what the acs and
// vfio stages completed (decision.Conclude). A stage that failed, panicked, ran past
// its deadline or was skipped committed no report, and its units end failed.
func (b *Boot) conclude(st *stages.State) []decision.Verdict {
	d, acsRun, bind := b.results()
	if d == nil {
		return nil
	}
	stageErr := map[string]error{}
	for _, r := range st.Results() {
		if r.Err != nil {
			stageErr[r.Name] = fmt.Errorf("stage %s %s: %w", r.Name, r.Status, r.Err)
		} else {
			stageErr[r.Name] = fmt.Errorf("stage %s %s", r.Name, r.Status)
		}
	}
	errOf := func(name string) error {
		if e, ok := stageErr[name]; ok {
			return e
		}
		return fmt.Errorf("stage %s did not run", name)
	}
	return d.Conclude(decision.Execution{DryRun: b.DryRun, ACS: acsRun, ACSErr: errOf("acs"),
		Binding: !b.DryRun, Bind: bind, BindErr: errOf("vfio"), Erase: b.eraseResult(), EraseErr: errOf("erase")})
}

func (b *Boot) manifestUnits(vs []decision.Verdict) []manifest.Unit {
	d, acsRun, bindRep := b.results()
	return record.Units(d, vs, record.Execution{ACS: acsRun, Bind: bindRep, Erase: b.eraseResult()}, record.Drivers(b.Root))
}

// guestPlan is the guest topology of the units that may be passed through (their final
// verdict is not failed), with the host matrix over the same units and the matrix the
// guest should show.
func (b *Boot) guestPlan(vs []decision.Verdict) (*manifest.GuestPlan, error) {
	d, _, _ := b.results()
	if d == nil {
		return nil, nil
	}
	var ids []topology.UnitID
	for _, v := range vs {
		if v.Usable() {
			ids = append(ids, v.Unit)
		}
	}
	if len(ids) == 0 {
		return nil, nil
	}
	ok := make(map[topology.UnitID]bool, len(ids))
	for _, id := range ids {
		ok[id] = true
	}
	var chosen []*topology.Unit
	for _, u := range d.Units() {
		if ok[u.ID] {
			chosen = append(chosen, u)
		}
	}
	nv := d.Profile.NVLinks
	g, err := topology.GuestPlan(d.Units(), topology.GuestOptions{Units: ids})
	if err != nil {
		return nil, err
	}
	plan, err := json.Marshal(g)
	if err != nil {
		return nil, fmt.Errorf("guest plan: %w", err)
	}
	host := topology.HostMatrix(chosen, nv)
	return &manifest.GuestPlan{Plan: plan, MatrixLabels: host.Names, HostMatrix: host.Cells, ExpectedGuest: g.Matrix(nv).Cells}, nil
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

// profileDigest is the sha256 of the profile's JSON encoding: the rules as labelling
// used them, whatever file or built-in they came from.
func profileDigest(p *topology.Profile) string {
	j, err := json.Marshal(p)
	if err != nil {
		return ""
	}
	sum := sha256.Sum256(j)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// manifest builds, signs and writes the manifest; it runs whatever happened before so the
// hypervisor always learns what this boot did. Failing to sign still leaves the unsigned
// payload in /run/passage for an operator, and fails the stage.
//
// A dry run signs nothing: it is a decision, not a boot. Nothing was bound, erased or
// written, so a signed record could only call a unit ready that nothing prepared; the
// decision is on the console and in log.jsonl.
func (b *Boot) manifest(ctx context.Context, st *stages.State, r *stages.Result) error {
	if b.DryRun {
		vs := b.conclude(st)
		b.commit(ctx, func() { b.Verdicts = vs })
		return stages.Skip("dry run: nothing was prepared, nothing is signed (the decision is on the console and in log.jsonl)")
	}
	var errs []string
	m, err := manifest.Build(b.Root, b.now())
	if err != nil {
		// Without a boot id the hypervisor cannot match the manifest to this boot, but an
		// operator still needs it, with the identity that was read (Sign refuses it when
		// nothing was).
		errs = append(errs, err.Error())
		if m.KernelCmdline == "" {
			m.KernelCmdline = b.Config.Cmdline
		}
	}
	errs = append(errs, b.Config.ErrorStrings()...)
	if m.Node.Hostname == "" {
		// Signed empty, never as the kernel's "(none)" (manifest.ReadNode): a name no
		// consumer may take for the node's.
		errs = append(errs, "manifest: no hostname: the node has no name (the hostname stage says where none was found)")
	}
	if cpus, err := record.NUMACPUs(b.Root); err != nil {
		errs = append(errs, fmt.Sprintf("numa cpus: %v", err))
	} else {
		m.NUMACPUs = cpus
	}
	if d, _, _ := b.results(); d != nil {
		m.Profile = manifest.Profile{Name: d.Profile.Name, Digest: profileDigest(d.Profile)}
		m.NVLink = record.NVLink(d.Profile)
		if im := d.Image; im != nil {
			m.ImagePlan = &manifest.ImagePlan{Digest: im.Digest, ConfigACS: im.ConfigACS, Matched: im.Matched,
				Differences: append([]string{}, im.Differences...), Kernel: im.Kernel}
		}
	} else {
		m.Profile = manifest.Profile{Name: b.Config.Profile}
	}
	vs := b.conclude(st)
	b.mu.Lock()
	b.Verdicts = vs
	b.mu.Unlock()
	for _, v := range vs {
		st.Mark(UnitID(v.Unit), toStatus(v.Status), "")
		for _, why := range v.Reasons {
			st.Mark(UnitID(v.Unit), toStatus(v.Status), why)
		}
	}
	m.Units = b.manifestUnits(vs)
	if gp, err := b.guestPlan(vs); err != nil {
		errs = append(errs, err.Error())
		r.Degrade("%v", err)
	} else {
		m.GuestPlan = gp
	}
	m.Stages = stageResults(st.Results())

	prep := b.joinTPM(ctx)
	for _, f := range prep.findings {
		r.Findingf("%s", f)
	}
	if prep.silent {
		// The finding comes with the signers' below.
		r.Status = stages.Worse(r.Status, stages.Degraded)
	}
	tpm := prep.tpm
	if tpm.closer != nil {
		defer tpm.closer.Close()
	}
	// A dry run returned above: passage.out is mounted and counted on only by a boot.
	outDir, unmount, err := b.mountOut()
	if err != nil {
		errs = append(errs, err.Error())
		r.Degrade("%v", err)
	}
	// TPM NV first (monotonic in hardware), then the file on passage.out; with neither
	// the generation is 0 from source "none", which a verifier cannot order.
	var counters []manifest.Counter
	if tpm.counter != nil {
		counters = append(counters, prep.counted)
	}
	if outDir != "" {
		counters = append(counters, manifest.FileCounter{Path: filepath.Join(outDir, GenerationFile)})
	}
	gen, src, gerr := manifest.NextGeneration(counters...)
	m.Generation, m.GenerationSource = gen, src
	switch {
	case gerr != nil && src == manifest.GenerationNone:
		errs = append(errs, gerr.Error())
		r.Degrade("%v", gerr)
	case gerr != nil:
		r.Findingf("%v", gerr)
	case len(counters) == 0:
		r.Findingf("generation 0: no TPM and no passage.out, nothing persistent to count on")
	}
	if b.Config.Handoff == initramfs.HandoffSwitchRoot {
		// Before the manifest is signed: it carries the key's digest.
		if err := b.kubeletKey(tpm, m, r); err != nil {
			errs = append(errs, err.Error())
			r.Degrade("%v", err)
		}
	}
	m.Errors = errs
	if !b.commit(ctx, func() { b.Manifest = m }) {
		return fmt.Errorf("manifest: %w before anything was written", ctx.Err())
	}

	dir, err := Beneath(b.Root, initramfs.RunDir)
	if err != nil {
		return fmt.Errorf("manifest: %w", err)
	}
	payload, err := manifest.Marshal(m)
	if err != nil {
		return err
	}
	if err := manifest.WriteAtomic(dir, PayloadName, payload); err != nil {
		return err
	}

	signers, serr := b.signers(tpm)
	if len(signers) == 0 {
		b.Mark("manifest-written")
		b.writeMetrics(ctx, r, dir, m, "")
		return fmt.Errorf("manifest: unsigned (%s written): %w", PayloadName, serr)
	}
	if serr != nil {
		r.Findingf("%v", serr)
	}
	// The node's generation lock, as every generation writer holds it (recycle, unbind,
	// the plugin), from the log's append through the quote. In the initramfs nothing
	// else writes (the counter was advanced before it, StartTPM), so it is had at once;
	// were it not, the manifest is written anyway: a boot without one cannot go on.
	if lock, lerr := manifest.LockGenerations(ctx, dir, "boot", bootLockWait); lerr != nil {
		r.Findingf("%v: written without it", lerr)
	} else {
		defer lock.Unlock()
	}
	signed, err := manifest.WriteSigned(ctx, m, dir, EnvelopeName, tpm.measurer, signers...)
	if signed == nil {
		b.Mark("manifest-written")
		b.writeMetrics(ctx, r, dir, m, "")
		return err
	}
	b.commit(ctx, func() { b.Signed = signed })
	if err != nil {
		// Written and signed, short of a signature or a measurement: the hypervisor can
		// still verify it with the keys that signed.
		r.Degrade("%v", err)
	} else if tpm.measurer != nil {
		r.Changef("PCR %d extended with %s (event log %s)", tpm.measurer.PCR(), signed.Digest, EnvelopeName+manifest.EventLogSuffix)
	}
	b.Mark("manifest-written")
	r.Changef("%s %s generation %d (%s), %d signatures", EnvelopeName, signed.Digest, m.Generation, m.GenerationSource, len(signed.KeyIDs))
	b.writeMetrics(ctx, r, dir, m, strings.Join(signed.KeyIDs, " "))
	if k, ok := tpm.signer.(*tpmkey.TPM); ok && err == nil && tpm.measurer != nil {
		// Only once the manifest is measured: the attestation's quote covers PCR 13
		// ending in this manifest. It is published with the manifest (copied below).
		if aerr := b.writeAttestation(k, dir, signed); aerr != nil {
			r.Findingf("attestation: %v", aerr)
		} else {
			r.Changef("%s: quote of PCRs %v with the payload digest as nonce, the signing key certified by the AK", EnvelopeName+attest.Suffix, attest.QuotedPCRs)
		}
	}

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
	if serr != nil && b.Config.TPM == initramfs.TPMOn && tpm.signer == nil {
		return fmt.Errorf("passage.tpm=on: signed without the TPM: %w", serr)
	}
	if b.Config.TPM == initramfs.TPMOn && tpm.signer != nil {
		if id, _ := tpm.signer.KeyID(); !slices.Contains(signed.KeyIDs, id) {
			return fmt.Errorf("passage.tpm=on: the TPM key did not sign: %w", err)
		}
	}
	return nil
}

// kubeletKey makes the kubelet's client key for the root this boot hands off to
// (package kubelet): from the TPM's random number generator, so it waits on no kernel
// pool, and only when the TPM signs, since only a TPM's attestation gets its
// certificate approved. The manifest signs its digest (node.kubelet_key). Without a TPM
// the kubelet makes a key of its own, which passage-control never approves.
func (b *Boot) kubeletKey(tpm bootTPM, m *manifest.Manifest, r *stages.Result) error {
	rng, ok := tpm.signer.(interface{ Random(int) ([]byte, error) })
	if !ok {
		r.Findingf("kubelet key: none made (no TPM signs this manifest: passage-control approves a kubelet's certificate only for a TPM-attested boot)")
		return nil
	}
	dir, err := Beneath(b.Root, kubelet.CertDir)
	if err != nil {
		return fmt.Errorf("kubelet key: %w", err)
	}
	digest, err := kubelet.Make(dir, rng.Random)
	if err != nil {
		return fmt.Errorf("%w: this boot's kubelet will not be approved", err)
	}
	m.Node.KubeletKey = digest
	r.Changef("kubelet client key %s made for %s (node.kubelet_key)", digest, filepath.Join(kubelet.CertDir, kubelet.KeyFile))
	return nil
}

// bootLockWait bounds the manifest stage's wait for the generation lock: nothing else
// should hold it in the initramfs.
const bootLockWait = 2 * time.Second

// writeAttestation attests the manifest just measured (package attest) offline: the
// nonce is its payload digest, so the attestation is fresh exactly when the manifest is
// (its generation and boot id). With passage.url the publish stage replaces it with one
// quoted over the control plane's nonce (attestOnline).
func (b *Boot) writeAttestation(k *tpmkey.TPM, dir string, signed *manifest.Signed) error {
	return WriteAttestation(b.Root, k, dir, signed.Payload, nil)
}

// WriteAttestation writes the attestation (package attest) of the manifest in dir
// (EnvelopeName, whose payload is payload, just measured into PCR 13: its event log is
// beside it) made by the TPM k: quoted over nonce, the control plane's; with none, over
// the payload digest, and the file says which (nonce_source). The firmware's event log
// is read beneath root; a missing one is written empty, which a verifier refuses. The
// boot and recycle write every generation's attestation through it.
func WriteAttestation(root string, k *tpmkey.TPM, dir string, payload, nonce []byte) error {
	var ev attest.Evidence
	fw, err := ReadBeneath(root, attest.FirmwareLogPath, attest.MaxFirmwareLog)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		// No log (no TPM driver log, or securityfs not mounted): attested empty.
	case err != nil:
		return fmt.Errorf("firmware event log: %w", err)
	default:
		ev.FirmwareLog = fw
	}
	if ev.PassageLog, err = os.ReadFile(filepath.Join(dir, EnvelopeName+manifest.EventLogSuffix)); err != nil {
		return err
	}
	source := attest.NonceControlPlane
	if len(nonce) == 0 {
		sum := sha256.Sum256(payload)
		nonce, source = sum[:], attest.NoncePayloadDigest
	}
	a, err := attest.Collect(k.Transport(), tpmkey.Template(), nonce, ev)
	if err != nil {
		return err
	}
	a.NonceSource = source
	out, err := a.Marshal()
	if err != nil {
		return err
	}
	return manifest.WriteAtomic(dir, EnvelopeName+attest.Suffix, out)
}

// tpmPrep is the TPM opened and its generation counter advanced, ahead of the manifest
// stage when StartTPM ran, else by the manifest stage itself.
type tpmPrep struct {
	tpm      bootTPM
	counted  countedGeneration // the NV counter's answer, when tpm.counter is set
	findings []string          // what opening the TPM found, for the manifest stage's result
	silent   bool              // the TPM did not answer in time (joinTPM)
}

// countedGeneration is a generation counter that was already advanced: Next returns
// what the counter said then, once.
type countedGeneration struct {
	gen uint64
	err error
}

func (c countedGeneration) Next() (uint64, error)           { return c.gen, c.err }
func (countedGeneration) Source() manifest.GenerationSource { return manifest.GenerationTPMNV }

// StartTPM opens the TPM and advances its NV generation counter in the background, so
// the TPM's own latency (CreatePrimary of the signing key, an NV increment: 108 ms under
// QEMU with swtpm, and more on a discrete TPM) passes while the PCIe stages run instead
// of inside the manifest stage. Neither depends on the PCIe stages: the key and the
// counter are the TPM's. The manifest stage joins it (joinTPM); without StartTPM it does
// the same work itself. passage boot calls it before running the stages.
func (b *Boot) StartTPM() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.Config.TPM == initramfs.TPMOff || b.tpmReady != nil {
		return
	}
	ch := make(chan tpmPrep, 1)
	b.tpmReady = ch
	go func() { ch <- b.prepareTPM() }()
}

func (b *Boot) prepareTPM() tpmPrep {
	var r stages.Result
	p := tpmPrep{tpm: b.openTPM(&r)}
	if p.tpm.counter != nil {
		p.counted.gen, p.counted.err = p.tpm.counter.Next()
	}
	p.findings = r.Findings
	return p
}

// joinTPM takes StartTPM's result, waiting for it while the manifest stage still has
// time to sign and write without it (a quarter of what is left, at most tpmReserve): a
// TPM that has not answered by then is left behind (closed whenever it answers) and the
// manifest is signed without it. Without StartTPM it prepares the TPM now.
func (b *Boot) joinTPM(ctx context.Context) tpmPrep {
	b.mu.Lock()
	ch := b.tpmReady
	b.tpmReady = nil
	b.mu.Unlock()
	if ch == nil {
		return b.prepareTPM()
	}
	wait := ctx
	if dl, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		wait, cancel = context.WithDeadline(ctx, dl.Add(-min(tpmReserve, time.Until(dl)/4)))
		defer cancel()
	}
	select {
	case p := <-ch:
		return p
	case <-wait.Done():
		go func() {
			if p := <-ch; p.tpm.closer != nil {
				p.tpm.closer.Close()
			}
		}()
		err := errors.New("tpm: no answer in time for the manifest; signing without it")
		return tpmPrep{tpm: bootTPM{err: err}, silent: true}
	}
}

// tpmReserve is the most of the manifest stage's time kept for signing and writing when
// the TPM is slow to answer.
const tpmReserve = 5 * time.Second

// bootTPM is the TPM as the manifest stage uses it; every field nil without one.
type bootTPM struct {
	signer   manifest.Signer
	measurer manifest.Measurer
	counter  manifest.Counter
	closer   io.Closer
	err      error // why there is none (passage.tpm=off is not an error)
}

func (b *Boot) openTPM(r *stages.Result) bootTPM {
	if b.Config.TPM == initramfs.TPMOff {
		return bootTPM{}
	}
	open := b.OpenTPM
	if open == nil {
		open = tpmkey.ForBoot
	}
	s, m, err := open(b.Root)
	if err != nil {
		if b.Config.TPM == initramfs.TPMAuto && errors.Is(err, fs.ErrNotExist) {
			err = fmt.Errorf("tpm: none (%w)", err)
		}
		r.Findingf("%v", err)
		return bootTPM{err: err}
	}
	t := bootTPM{signer: s, measurer: m}
	t.counter, _ = s.(manifest.Counter)
	t.closer, _ = s.(io.Closer)
	if b.DryRun {
		// A dry run leaves the TPM's state as it found it: no generation counted, no
		// PCR extended (and the manifest stage signs nothing).
		t.counter, t.measurer = nil, nil
		r.Findingf("dry run: no NV counter increment, no PCR extend")
	}
	return t
}

// signers are who signs the envelope: the TPM key when there is one, and the key file
// when it loads. Both sign the same payload in one envelope, so a hypervisor that
// enrolled either key verifies it. The error says what is missing and why; with no
// signer at all the manifest stays unsigned.
func (b *Boot) signers(tpm bootTPM) ([]manifest.Signer, error) {
	var out []manifest.Signer
	var errs []error
	if tpm.signer != nil {
		out = append(out, tpm.signer)
	} else if tpm.err != nil {
		errs = append(errs, tpm.err)
	}
	s, err := b.loadSigner()
	if err != nil {
		errs = append(errs, fmt.Errorf("key %s: %w", b.Config.Key, err))
	} else {
		out = append(out, s)
	}
	return out, errors.Join(errs...)
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
		// Not a dot name: a write's temporary (manifest.WriteAtomic), the generation
		// lock; neither is one of the boot's files.
		if !e.Type().IsRegular() || strings.HasPrefix(e.Name(), ".") {
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

// loadSigner reads passage.key= beneath the root (ReadBeneath).
func (b *Boot) loadSigner() (*manifest.Ed25519Signer, error) {
	data, err := ReadBeneath(b.Root, b.Config.Key, manifest.MaxKeyFileSize)
	if err != nil {
		return nil, err
	}
	return manifest.ParseSigner(b.Config.Key, data)
}
