package initramfs

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestIPXEScriptListsEveryArgument builds boot.ipxe with image/ipxe.sh from a stand-in
// kernel and initramfs and checks its comment names every argument initramfs/README.md
// documents: the script is what an operator edits, and an argument missing there (as
// passage.erase was, while b300 erases every unit's NVMe by default) is one nobody sets.
func TestIPXEScriptListsEveryArgument(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	var args []string
	row := regexp.MustCompile("(?m)^\\| `(passage\\.[a-z_]+)=")
	for _, m := range row.FindAllStringSubmatch(string(readme), -1) {
		args = append(args, m[1])
	}
	if len(args) < 20 {
		t.Fatalf("README.md's table gives %d arguments: %v", len(args), args)
	}

	build := t.TempDir()
	for name, content := range map[string]string{
		"kernel/vmlinuz":    "kernel",
		"kernel/release":    "6.12.0-test-amd64\n",
		"initramfs.cpio.gz": "initramfs",
	} {
		p := filepath.Join(build, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out, err := exec.Command("bash", filepath.Join("..", "image", "ipxe.sh"), build).CombinedOutput()
	if err != nil {
		t.Fatalf("ipxe.sh: %v\n%s", err, out)
	}
	script, err := os.ReadFile(filepath.Join(build, "boot.ipxe"))
	if err != nil {
		t.Fatal(err)
	}
	var comment strings.Builder
	for _, l := range strings.Split(string(script), "\n") {
		if strings.HasPrefix(l, "#") {
			comment.WriteString(l + "\n")
		}
	}
	for _, a := range args {
		if !regexp.MustCompile(regexp.QuoteMeta(a) + "=").MatchString(comment.String()) {
			t.Errorf("boot.ipxe does not document %s=", a)
		}
	}
	if !strings.Contains(string(script), "\nkernel vmlinuz ") {
		t.Errorf("boot.ipxe has no kernel line:\n%s", script)
	}
}
