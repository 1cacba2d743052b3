package manifest_test

import (
	"crypto/ed25519"
	"os"
	"path/filepath"
	"testing"

	. "github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// testKey is fixed so the committed fuzz seeds stay valid envelopes.
func testKey(seed byte) ed25519.PrivateKey {
	s := make([]byte, ed25519.SeedSize)
	for i := range s {
		s[i] = seed + byte(i)
	}
	return ed25519.NewKeyFromSeed(s)
}

func testSigner(t testing.TB, seed byte) *Ed25519Signer {
	t.Helper()
	s, err := NewEd25519Signer(testKey(seed))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func testVerifier(t testing.TB, seed byte) *PublicKeyVerifier {
	t.Helper()
	v, err := NewVerifier(testKey(seed).Public())
	if err != nil {
		t.Fatal(err)
	}
	return v
}

const testBootID = manifesttest.BootID

// writeRoot lays out the /proc and /sys files Build reads.
func writeRoot(t testing.TB, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for rel, content := range files {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func defaultRootFiles() map[string]string {
	return map[string]string{
		"proc/sys/kernel/random/boot_id":  testBootID + "\n",
		"proc/sys/kernel/hostname":        "b300-r07-n3\n",
		"proc/sys/kernel/osrelease":       "6.12.48\n",
		"proc/cmdline":                    "console=ttyS0 passage.tpm=on passage.handoff=poweroff\n",
		"sys/class/dmi/id/product_serial": "S3R1AL-0042\n",
		"sys/class/dmi/id/product_uuid":   "4c4c4544-0042-3810-8057-b3c04f4b4d32\n",
		"sys/class/dmi/id/sys_vendor":     "Supermicro\n",
		"sys/class/dmi/id/product_name":   "SYS-A22GA-NBRT\n",
		"sys/class/dmi/id/board_name":     "X14DBG-AP\n",
	}
}
