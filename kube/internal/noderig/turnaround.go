package noderig

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/google/go-tpm/tpm2/transport/linuxudstpm"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/attesttest"
	"github.com/passage-boot/passage/kube/control/controltest"
	"github.com/passage-boot/passage/kube/internal/signedtest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/tpmkey"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/recycle"
	"github.com/passage-boot/passage/vfiobind"
)

// BootID is the boot_id of a rig made ready for the turnaround.
const BootID = "6f1c2a4e-8d3b-4c7a-9e15-2b7d0f4a9c31"

// ForTurnaround makes the rig a node whose plugin can recycle its units itself, as the
// boot left it: the proc files a recycle reads, every function resettable by FLR
// (reset_method, reset), the vfio modules loaded, the node's ed25519 key at
// etc/passage/key (its public key enrolled in Keys), a swtpm TPM made by a fresh CA at
// dev/tpmrm0 (a link to its socket) with its PCRs extended by the firmware log fw (also
// at attest.FirmwareLogPath, as securityfs shows it), and the manifest of the generation
// that TPM counted signed into run/passage, the directory a recycle replaces: Path. It
// returns the CA (the control plane's EK CA) and the TPM's socket. NVMe controllers are
// the caller's (the erase's Opener).
func (r *Rig) ForTurnaround(t testing.TB, fw []byte) (*attesttest.CA, string) {
	t.Helper()
	root := r.Root
	host := r.M.Node.Hostname
	for p, c := range map[string]string{"proc/sys/kernel/random/boot_id": BootID + "\n",
		"proc/sys/kernel/osrelease": "6.12.48\n", "proc/cmdline": "console=ttyS0\n", "proc/sys/kernel/hostname": host + "\n"} {
		write(t, filepath.Join(root, p), []byte(c))
	}
	if err := r.Kernel.Load(vfiobind.Modules...); err != nil {
		t.Fatal(err)
	}
	tree, err := pci.Scan(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range tree.Devices {
		dir := filepath.Join(root, pci.DevicesDir, d.Addr.String())
		write(t, filepath.Join(dir, "reset_method"), []byte("flr\n"))
		write(t, filepath.Join(dir, "reset"), nil)
	}
	priv, _, err := manifest.GenerateKey(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(priv)
	if err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(root, "etc/passage/key"), b)
	s, err := manifest.LoadSigner(priv)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := manifest.MarshalPublicKey(s.Public())
	if err != nil {
		t.Fatal(err)
	}
	r.Key = &signedtest.Key{Signer: s, Pub: filepath.Join(r.Keys, host+".pub")}
	write(t, r.Key.Pub, pub)
	id, _ := s.KeyID()
	e, err := manifest.NewEnrolment(id, manifest.Node{DMIUUID: r.M.Node.DMIUUID}, false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := manifest.WriteEnrolment(r.Key.Pub, e); err != nil {
		t.Fatal(err)
	}
	ca := attesttest.NewCA(t)
	sock := attesttest.StartSocket(t, ca)
	tp, err := linuxudstpm.Open(sock)
	if err != nil {
		t.Fatal(err)
	}
	if err := controltest.ExtendLog(tp, fw); err != nil {
		t.Fatal(err)
	}
	// The boot counted its generation in the TPM: the boot's manifest has the count.
	tk, err := tpmkey.New(tp)
	if err != nil {
		t.Fatal(err)
	}
	if r.M.Generation, err = tk.Next(); err != nil {
		t.Fatal(err)
	}
	tk.Close()
	run := filepath.Join(root, "run/passage")
	if err := os.MkdirAll(run, 0o755); err != nil {
		t.Fatal(err)
	}
	r.Path = r.Key.Sign(t, r.M, filepath.Join(run, recycle.EnvelopeName))
	write(t, filepath.Join(root, attest.FirmwareLogPath), fw)
	if err := os.Symlink(sock, filepath.Join(root, "dev/tpmrm0")); err != nil {
		t.Fatal(err)
	}
	return ca, sock
}

// Hold makes process pid hold unit u's GPU group open, as a VMM does (what recycle.Holders
// reads under proc/); the returned func lets go, as the process ending does.
func (r *Rig) Hold(t testing.TB, pid, u int) func() {
	t.Helper()
	dir := filepath.Join(r.Root, "proc", strconv.Itoa(pid))
	write(t, filepath.Join(dir, "comm"), []byte("qemu-system-x86\n"))
	if err := os.MkdirAll(filepath.Join(dir, "fd"), 0o755); err != nil {
		t.Fatal(err)
	}
	g := r.M.Units[u].Functions[0].IOMMUGroup
	if err := os.Symlink("/dev/vfio/"+strconv.Itoa(g), filepath.Join(dir, "fd", "17")); err != nil {
		t.Fatal(err)
	}
	return func() { os.RemoveAll(dir) }
}

func write(t testing.TB, p string, b []byte) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
}
