package qemutest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/passage-boot/passage/decision"
	"github.com/passage-boot/passage/initramfs/emit"
	"github.com/passage-boot/passage/internal/checkout"
)

// Options says what to boot. Zero values give the default: the image from Build, the
// default topology, a fresh TPM, no disk.
type Options struct {
	Build  string // build dir of `make kernel initramfs`: kernel/vmlinuz, initramfs.cpio.gz
	Kernel string // overrides Build/kernel/vmlinuz
	Initrd string // overrides Build/initramfs.cpio.gz
	// Overlay files are appended to the initramfs as a second cpio archive (the kernel
	// unpacks both, later files winning): test-only binaries or configuration.
	Overlay []OverlayFile
	// Key is an ed25519 private key file (manifest.GenerateKey) put into the image at
	// /etc/passage/key, passage.key's default.
	Key string

	Topology Topology
	// Devices, when set, replaces Topology's arguments (a rendered guest plan).
	Devices []string

	// Append goes on the kernel command line after the defaults; a passage.* key given
	// here replaces the default for that key.
	Append []string
	// Without leaves default kernel arguments off, by key: "passage.hostname" for a
	// node whose name must come from DHCP (Topology.DHCPHostname) or nowhere.
	Without []string

	TPMState string // swtpm state dir; kept across boots when the caller reuses it. "" = fresh
	NoTPM    bool
	// KeepTPM keeps the TPM's running state (PCRs) for OpenTPM after the boot: the guest
	// holds instead of powering off (passage.handoff=hold, unless Append says otherwise),
	// QEMU is killed once the guest has said PASSAGE-DONE and handed off, so neither the
	// guest's TPM2_Shutdown nor QEMU's CMD_SHUTDOWN ends the TPM, and swtpm is told to
	// store its volatile state in the state dir before it is stopped.
	KeepTPM bool
	Disk    string // raw disk image attached as virtio-blk (/dev/vda in the guest); "" = none

	// Name labels the boot in logs and the timing summary ("" = the topology's name).
	Name    string
	WorkDir string        // console.log, swtpm socket; "" = a new temp dir
	Timeout time.Duration // hard limit for the whole boot; 0 = 5 minutes
	MemMiB  int           // 0 = 2048
	SMP     int           // 0 = 2
	Log     io.Writer     // gets the console live when set (go test -v)

	// NVMe are raw disk images attached as host NVMe controllers on the root complex
	// (00:11.0, 00:12.0, ...), outside every unit: disks the node keeps, beside the
	// units' passthrough NVMe. Their names in the guest follow probe order.
	NVMe []string

	// OVMF boots the kernel directly through UEFI firmware (Debian's OVMF_CODE_4M.fd,
	// Secure Boot off) instead of SeaBIOS: the firmware that sizes a guest's 64-bit MMIO
	// window from its address width. PhysBits, when set, is the guest CPU's physical
	// address width (QEMU's phys-bits).
	OVMF     bool
	PhysBits int

	// NetBoot boots through UEFI Secure Boot and iPXE over QEMU's TFTP instead of
	// -kernel/-initrd (netboot.go); nil: direct kernel boot.
	NetBoot *NetBoot
	// NoRDRAND leaves RDRAND out of the guest CPU (QEMU's plain qemu64): the kernel's
	// random pool is then not ready for a minute or more, as on a node whose CPU RNG the
	// kernel does not trust.
	NoRDRAND bool
	// Plan is a saved plan (`passage plan --out`) whose image arguments
	// (decision.ImageArgs: its pci=config_acs= and passage.plan=) go on the command line,
	// as `make uki PLAN=` bakes them into the signed image.
	Plan []byte
	// Console is called with each console line and a writer to the guest's serial
	// input (the keyboard of an operator at the console). Returning true ends the boot:
	// QEMU is killed, which Run does not count as an error.
	Console func(line string, keyboard io.Writer) (end bool)
	// Forward joins addresses on the management NIC's user network to the host's
	// loopback: each key, "IP:PORT" in 10.0.2.0/24, is a guestfwd whose connections
	// internal/fwd carries to the value, "127.0.0.1:PORT" (restrict=on still keeps the
	// guest off every other address).
	Forward map[string]string
	// UUID is the machine's SMBIOS system UUID (QEMU's -uuid), which the kernel shows as
	// /sys/class/dmi/id/product_uuid, as a server's firmware does: the manifest's
	// node.dmi_uuid, by which passage-dra tells its node's manifest from another's.
	// "": QEMU gives none.
	UUID string
}

// DefaultKernel is the kernel line the suite boots unless PASSAGE_KERNEL names another
// (the Makefile's KERNEL).
const DefaultKernel = "6.12"

// DefaultCmdline is the kernel command line every boot starts from. no_timer_check:
// under TCG on a busy host the IO-APIC timer check in setup_IO_APIC can miss its
// window and, with interrupt remapping on, panics ("timer doesn't work through
// Interrupt-remapped IO-APIC"); VMs skip that check for this reason.
var DefaultCmdline = []string{
	"console=ttyS0,115200", "intel_iommu=on", "no_timer_check", "panic=-1", "oops=panic",
	"passage.profile=qemu", "passage.handoff=poweroff", "passage.emit=console",
	// Named per machine on the command line, as a fleet's iPXE script names a node
	// (${hostname}); Options.Without drops it for a boot named by DHCP or not at all.
	"passage.hostname=" + DefaultHostname,
	// Scenarios with a failed unit end by the handoff too, as they were written to;
	// the emergency scenario sets passage.emergency_on= itself.
	"passage.emergency_on=never",
}

// DefaultHostname is the name every boot's command line gives the node.
const DefaultHostname = "passage-qemu"

// Run is one finished boot.
type Run struct {
	*Report
	Console  string        // path of the full console log
	Args     []string      // qemu-system-x86_64 arguments
	Cmdline  string        // kernel command line
	TPMState string        // the swtpm state dir used ("" without a TPM)
	Wall     time.Duration // QEMU start to QEMU exit
	WallDone time.Duration // QEMU start to the PASSAGE-DONE line (0 if never)
	ExitErr  error         // QEMU's exit error, or the timeout
}

// Find returns the files of a build dir, checking they are there.
func (o *Options) paths() (kernel, initrd string, err error) {
	kernel, initrd = o.Kernel, o.Initrd
	if kernel == "" {
		kernel = filepath.Join(o.Build, "kernel", "vmlinuz")
	}
	if initrd == "" {
		initrd = filepath.Join(o.Build, "initramfs.cpio.gz")
	}
	for _, p := range []string{kernel, initrd} {
		if _, err := os.Stat(p); err != nil {
			return "", "", fmt.Errorf("boot: %w (run make kernel initramfs)", err)
		}
	}
	return kernel, initrd, nil
}

// Cmdline joins the default kernel arguments with extra ones; an extra passage.* key
// (or any key=) replaces the default with that key, and a default whose key is in
// without is left off.
func Cmdline(extra []string, without ...string) string {
	key := func(a string) string { k, _, _ := strings.Cut(a, "="); return k }
	over := map[string]bool{}
	for _, a := range extra {
		over[key(a)] = true
	}
	for _, k := range without {
		over[k] = true
	}
	var out []string
	for _, a := range DefaultCmdline {
		if !over[key(a)] {
			out = append(out, a)
		}
	}
	return strings.Join(append(out, extra...), " ")
}

// Boot runs QEMU once and returns what the guest reported. The error is for a boot
// the harness could not run or read (missing files, QEMU not starting, corrupted file
// blocks); a guest that ran and reported "failed" is not an error: check Run.Done.
// A timeout is reported in Run.ExitErr and as the error.
func Boot(ctx context.Context, o Options) (*Run, error) {
	kernel, initrd, err := o.paths()
	if err != nil {
		return nil, err
	}
	work := o.WorkDir
	if work == "" {
		if work, err = os.MkdirTemp("", "passage-qemu-"); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(work, 0o755); err != nil {
		return nil, err
	}
	overlay := o.Overlay
	if o.Key != "" {
		k, err := os.ReadFile(o.Key)
		if err != nil {
			return nil, fmt.Errorf("boot: key: %w", err)
		}
		overlay = append(append([]OverlayFile{}, overlay...), OverlayFile{Name: "etc/passage/key", Data: k, Mode: 0o600})
	}
	if len(overlay) > 0 {
		ov := filepath.Join(work, "overlay.cpio")
		if err := writeOverlay(ov, overlay); err != nil {
			return nil, err
		}
		combined := filepath.Join(work, "initrd.img")
		if err := concat(combined, initrd, ov); err != nil {
			return nil, err
		}
		initrd = combined
	}
	timeout := o.Timeout
	if timeout == 0 {
		timeout = 5 * time.Minute
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	extra := o.Append
	if o.KeepTPM {
		extra = append([]string{"passage.handoff=hold"}, extra...)
	}
	if o.NoRDRAND {
		// A kernel that trusts the TPM's RNG (6.12 credits it as a hwrng at full
		// quality) seeds its pool from it as soon as tpm_tis probes: credit none, so the
		// pool stays cold as on a node whose firmware gives the kernel nothing.
		extra = append([]string{"rng_core.default_quality=0"}, extra...)
	}
	if len(o.Plan) > 0 {
		a, err := decision.ImageArgs(o.Plan)
		if err != nil {
			return nil, fmt.Errorf("boot: plan: %w", err)
		}
		extra = append(extra, strings.Fields(a)...)
	}
	cmdline := Cmdline(extra, o.Without...)
	mem, smp := o.MemMiB, o.SMP
	if mem == 0 {
		mem = 2048
	}
	if smp == 0 {
		smp = 2
	}
	// +rdrand: TCG emulates RDRAND, and Debian's kernel trusts the CPU's RNG to seed
	// the crng at boot. Without it getrandom() blocks for a minute or more under TCG;
	// the boot path must not care (NoRDRAND tests that it does not).
	cpu, machine := "qemu64,+rdrand", "q35"
	if o.NoRDRAND {
		cpu = "qemu64"
	}
	if o.NetBoot != nil {
		machine = "q35,smm=on"
	}
	if o.PhysBits != 0 {
		// OVMF takes a width above 40 bits only from a CPU with 1 GiB pages
		// (PlatformAddressWidthFromCpuid: "if (!Page1GSupport && (PhysBits > 40))
		// PhysBits = 40"), which qemu64 lacks: without pdpe1gb its window stays 128 GiB.
		cpu += fmt.Sprintf(",+pdpe1gb,phys-bits=%d", o.PhysBits)
	}
	// thread=single: one host thread runs both vCPUs in turn. Multi-threaded TCG (QEMU
	// 7.2) does not keep another vCPU's translated code coherent while the kernel patches
	// its own text: 6.12 oopsed with "int3" in sched_clock_cpu, right after "sched_clock:
	// Marking stable" flipped a static key, in about one boot in twenty.
	args := []string{
		"-machine", machine, "-accel", "tcg,thread=single", "-cpu", cpu,
		"-m", fmt.Sprint(mem), "-smp", fmt.Sprint(smp),
		"-nographic", "-nodefaults", "-serial", "stdio", "-monitor", "none", "-no-reboot",
		"-device", "intel-iommu,intremap=on,caching-mode=on,device-iotlb=on",
	}
	devices := o.Devices
	if devices == nil {
		devices = o.Topology.Args()
	}
	if o.NetBoot != nil {
		if devices, err = o.NetBoot.args(work, kernel, initrd, cmdline, devices); err != nil {
			return nil, err
		}
	} else {
		args = append(args, "-kernel", kernel, "-initrd", initrd, "-append", cmdline)
	}
	if o.OVMF && o.NetBoot == nil {
		vars := filepath.Join(work, "OVMF_VARS.fd")
		b, err := os.ReadFile(OVMFVarsNoKeys)
		if err == nil {
			err = os.WriteFile(vars, b, 0o600)
		}
		if err != nil {
			return nil, fmt.Errorf("boot: OVMF vars: %w", err)
		}
		args = append(args, "-drive", "if=pflash,format=raw,unit=0,readonly=on,file="+OVMFCodeNoSecureBoot,
			"-drive", "if=pflash,format=raw,unit=1,file="+vars)
	}
	if len(o.Forward) > 0 {
		if devices, err = forward(work, devices, o.Forward); err != nil {
			return nil, err
		}
	}
	args = append(args, devices...)
	if o.UUID != "" {
		args = append(args, "-uuid", o.UUID)
	}
	if o.Disk != "" {
		args = append(args,
			"-drive", fmt.Sprintf("file=%s,if=none,id=disk0,format=raw,cache=unsafe", o.Disk),
			"-device", fmt.Sprintf("virtio-blk-pci,drive=disk0,bus=pcie.0,addr=0x%x.0,serial=passage", diskSlot))
	}
	for i, img := range o.NVMe {
		args = append(args,
			"-drive", fmt.Sprintf("file=%s,if=none,id=hostnvme%d,format=raw,cache=unsafe", img, i),
			"-device", fmt.Sprintf("nvme,drive=hostnvme%d,serial=hostnvme%d,bus=pcie.0,addr=0x%x.0", i, i, diskSlot+1+i))
	}
	var tpm *swtpm
	if !o.NoTPM {
		state := o.TPMState
		if state == "" {
			state = filepath.Join(work, "tpm")
		}
		if tpm, err = startSwtpm(ctx, state, o.KeepTPM); err != nil {
			return nil, err
		}
		defer tpm.stop()
		args = append(args,
			"-chardev", "socket,id=chrtpm,path="+tpm.sock,
			"-tpmdev", "emulator,id=tpm0,chardev=chrtpm",
			"-device", "tpm-tis,tpmdev=tpm0")
	}

	run := &Run{Console: filepath.Join(work, "console.log"), Args: args, Cmdline: cmdline}
	if tpm != nil {
		run.TPMState = tpm.state
	}
	logf, err := os.Create(run.Console)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	fmt.Fprintf(logf, "# qemu-system-x86_64 %s\n", shellQuote(args))

	cmd := exec.CommandContext(ctx, "qemu-system-x86_64", args...)
	// -serial stdio: what is written to QEMU's stdin arrives on the guest's ttyS0.
	var keyboard io.WriteCloser
	if o.Console != nil {
		if keyboard, err = cmd.StdinPipe(); err != nil {
			return nil, err
		}
		defer keyboard.Close()
	}
	cmd.Stderr = logf // QEMU's own warnings go into the same log
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	// HostAt counts from the parser's creation: made here, it is QEMU's start.
	p := emit.NewParser(time.Now)
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("boot: start qemu-system-x86_64: %w", err)
	}
	// With KeepTPM the guest holds after its report: QEMU is killed once the handoff
	// marker is out (or shortly after PASSAGE-DONE, should it never come).
	var killed, ended bool
	var killTimer *time.Timer
	kill := func() {
		if !killed {
			killed = true
			cmd.Process.Kill()
		}
	}
	var wg sync.WaitGroup
	var readErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		sc := bufio.NewScanner(out)
		defer func() {
			// A line beyond the scanner's buffer ends the scan; QEMU must still have
			// its stdout drained, or it blocks writing and the boot only times out.
			if readErr = sc.Err(); readErr != nil {
				fmt.Fprintf(logf, "\n# harness: console read: %v; the rest is kept unparsed\n", readErr)
				io.Copy(logf, out)
			}
		}()
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			fmt.Fprintln(logf, line)
			if o.Log != nil {
				fmt.Fprintln(o.Log, line)
			}
			p.Line(line)
			if o.Console != nil && !ended && o.Console(line, keyboard) {
				ended = true
				kill()
			}
			if o.NetBoot != nil && o.NetBoot.StopAt != "" && strings.Contains(line, o.NetBoot.StopAt) {
				kill()
			}
			if !o.KeepTPM {
				continue
			}
			if _, ok := p.Report().Markers["handoff"]; ok {
				kill()
			} else if p.Report().Done != "" && killTimer == nil {
				killTimer = time.AfterFunc(3*time.Second, func() { cmd.Process.Kill() })
			}
		}
	}()
	wg.Wait()
	run.ExitErr = cmd.Wait()
	if killTimer != nil {
		killTimer.Stop()
	}
	if ended {
		run.ExitErr = nil // the Console function ended the boot
	}
	if o.KeepTPM && p.Report().Done != "" {
		// Killed on purpose after the report.
		run.ExitErr = nil
		if tpm != nil {
			if err := tpm.storeVolatile(); err != nil {
				return run, fmt.Errorf("boot: %w", err)
			}
		}
	}
	run.Wall = time.Since(start)
	run.Report = p.Finish()
	run.WallDone = run.HostAt["done"]
	name := o.Name
	if name == "" {
		name = o.Topology.Name()
		if o.Devices != nil {
			name = "rendered devices"
		}
		// A test's temp dir is named after it: /tmp/TestX1234/001/work.
		for d := work; d != filepath.Dir(d); d = filepath.Dir(d) {
			if b := filepath.Base(d); strings.HasPrefix(b, "Test") {
				name = strings.TrimRight(b, "0123456789") + " (" + name + ")"
				break
			}
		}
	}
	recordTiming(run.timing(name))
	if ctx.Err() != nil {
		run.ExitErr = fmt.Errorf("boot: no power-off within %v (console %s): %w", timeout, run.Console, ctx.Err())
		return run, run.ExitErr
	}
	if readErr != nil {
		return run, fmt.Errorf("boot: console %s: read: %w", run.Console, readErr)
	}
	if len(run.Errors) > 0 {
		return run, fmt.Errorf("boot: console %s: %w", run.Console, errors.Join(run.Errors...))
	}
	return run, nil
}

// swtpm is a running TPM emulator; QEMU connects to its control socket.
type swtpm struct {
	proc   *os.Process
	exited chan error
	dir    string
	sock   string
	state  string
}

// startSwtpm starts swtpm for QEMU on its control socket. keep leaves out --terminate,
// so swtpm outlives a killed QEMU and storeVolatile can still reach it.
func startSwtpm(ctx context.Context, state string, keep bool) (*swtpm, error) {
	if err := os.MkdirAll(state, 0o700); err != nil {
		return nil, fmt.Errorf("swtpm %s: %w", state, err)
	}
	// A unix socket path must fit in sun_path (108 bytes); test temp dirs may not.
	dir, err := os.MkdirTemp("", "swtpm-")
	if err != nil {
		return nil, err
	}
	s := &swtpm{dir: dir, sock: filepath.Join(dir, "sock"), state: state, exited: make(chan error, 1)}
	args := []string{"socket", "--tpm2", "--tpmstate", "dir=" + state, "--ctrl", "type=unixio,path=" + s.sock}
	if !keep {
		args = append(args, "--terminate")
	}
	cmd := exec.CommandContext(ctx, "swtpm", args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("swtpm %s: start: %w", state, err)
	}
	s.proc = cmd.Process
	go func() { s.exited <- cmd.Wait() }()
	deadline := time.After(10 * time.Second)
	for {
		if _, err := os.Stat(s.sock); err == nil {
			return s, nil
		}
		select {
		case err := <-s.exited:
			os.RemoveAll(dir)
			return nil, fmt.Errorf("swtpm %s: exited before its socket appeared: %v: %s", state, err, stderr.String())
		case <-deadline:
			s.stop()
			return nil, fmt.Errorf("swtpm %s: no socket after 10 s", state)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// stop ends swtpm (with --terminate it ends by itself when QEMU disconnects; this is
// for a QEMU that never connected) and removes the socket dir. The state dir stays.
func (s *swtpm) stop() {
	s.proc.Kill()
	select {
	case <-s.exited:
	case <-time.After(5 * time.Second):
	}
	os.RemoveAll(s.dir)
}

func concat(dst string, srcs ...string) error {
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	for _, s := range srcs {
		in, err := os.Open(s)
		if err != nil {
			out.Close()
			return err
		}
		n, err := io.Copy(out, in)
		in.Close()
		if err == nil && n%4 != 0 {
			// The kernel finds the next archive only at a 4-byte boundary and skips
			// zero bytes up to it (init/initramfs.c, unpack_to_rootfs).
			_, err = out.Write(make([]byte, 4-n%4))
		}
		if err != nil {
			out.Close()
			return fmt.Errorf("initrd %s: %w", s, err)
		}
	}
	return out.Close()
}

func shellQuote(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		if strings.ContainsAny(a, " ',\"$") {
			q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		} else {
			q[i] = a
		}
	}
	return strings.Join(q, " ")
}

// Timing is one boot's timeline: guest seconds since kernel start from the PASSAGE-T
// markers, and host wall time from QEMU's start.
type Timing struct {
	Name                                 string
	UinitStart, ManifestWritten, Handoff float64 // guest clock; 0 when the marker never came
	HostManifest, HostDone, Wall         time.Duration
}

func (r *Run) timing(name string) Timing {
	return Timing{Name: name, UinitStart: r.Markers["uinit-start"], ManifestWritten: r.Markers["manifest-written"],
		Handoff: r.Markers["handoff"], HostManifest: r.HostAt["manifest-written"], HostDone: r.WallDone, Wall: r.Wall}
}

// TimingLine is the boot-to-manifest line of a run, for the test log.
func (r *Run) TimingLine(name string) string { return r.timing(name).String() }

func (t Timing) String() string {
	return fmt.Sprintf("%s: boot-to-manifest %.3f s (guest clock: uinit %.3f s, handoff %.3f s); host: QEMU start to manifest %.1f s, to PASSAGE-DONE %.1f s, to exit %.1f s",
		t.Name, t.ManifestWritten, t.UinitStart, t.Handoff, t.HostManifest.Seconds(), t.HostDone.Seconds(), t.Wall.Seconds())
}

var (
	timingsMu sync.Mutex
	timings   []Timing
)

func recordTiming(t Timing) {
	timingsMu.Lock()
	defer timingsMu.Unlock()
	timings = append(timings, t)
}

// Timings returns every boot this process ran, in order: the suite's summary.
func Timings() []Timing {
	timingsMu.Lock()
	defer timingsMu.Unlock()
	return append([]Timing(nil), timings...)
}

// BuildFwd builds internal/fwd, the program a guestfwd runs for each guest connection,
// into dir and returns its path.
func BuildFwd(dir string) (string, error) {
	src, err := checkout.Path("qemu-tests")
	if err != nil {
		return "", fmt.Errorf("fwd: %w", err)
	}
	fwd := filepath.Join(dir, "fwd")
	build := exec.Command("go", "build", "-o", fwd, "./internal/fwd")
	build.Dir = src
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build internal/fwd: %v: %s", err, out)
	}
	return fwd, nil
}

// forward adds a guestfwd to the management NIC's netdev for each of fwds.
func forward(work string, devices []string, fwds map[string]string) ([]string, error) {
	fwd, err := BuildFwd(work)
	if err != nil {
		return nil, err
	}
	out := append([]string(nil), devices...)
	for i, a := range out {
		if !strings.HasPrefix(a, "user,id=mgmt0,") {
			continue
		}
		for _, guest := range slices.Sorted(maps.Keys(fwds)) {
			host := fwds[guest]
			if strings.ContainsAny(guest+host, ", ") {
				return nil, fmt.Errorf("forward %q -> %q: no commas or spaces", guest, host)
			}
			a += ",guestfwd=tcp:" + guest + "-cmd:" + fwd + " " + host
		}
		out[i] = a
		return out, nil
	}
	return nil, fmt.Errorf("forward: no management NIC (user,id=mgmt0) among the devices")
}
