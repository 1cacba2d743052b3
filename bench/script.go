package bench

import (
	"bufio"
	"bytes"
	"fmt"
	"os/exec"
	"strconv"
	"strings"

	"github.com/passage-boot/passage/internal/checkout"
	"github.com/passage-boot/passage/pci"
)

// ScriptPort is one line of acs-plan.sh's output: a planned port, where it sits, its ACS
// Control now and the value the plan wants.
type ScriptPort struct {
	Addr     pci.Address
	Position string // "nic-port" or "other"
	Current  pci.ACSBits
	Target   pci.ACSBits
}

// ScriptPath is bench/acs-plan.sh of the checkout, so the test and cmd/benchtable
// work from any directory of it.
func ScriptPath() string {
	p, err := checkout.Path("bench/acs-plan.sh")
	if err != nil {
		return "bench/acs-plan.sh"
	}
	return p
}

// RunScript runs acs-plan.sh on root (with --apply when apply is set) and returns its
// raw output.
func RunScript(script, root string, apply bool) ([]byte, error) {
	args := []string{script, root}
	if apply {
		args = append(args, "--apply")
	}
	cmd := exec.Command("bash", args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("acs-plan.sh %s: %w: %s", root, err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// ParseScript reads acs-plan.sh's "<bdf> <position> 0x<current> 0x<target>" lines.
func ParseScript(out []byte) ([]ScriptPort, error) {
	var ports []ScriptPort
	sc := bufio.NewScanner(bytes.NewReader(out))
	for n := 1; sc.Scan(); n++ {
		f := strings.Fields(sc.Text())
		if len(f) != 4 {
			return nil, fmt.Errorf("acs-plan.sh line %d %q: want 4 fields", n, sc.Text())
		}
		a, err := pci.ParseAddress(f[0])
		if err != nil {
			return nil, fmt.Errorf("acs-plan.sh line %d: %w", n, err)
		}
		cur, err1 := strconv.ParseUint(f[2], 0, 16)
		tgt, err2 := strconv.ParseUint(f[3], 0, 16)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("acs-plan.sh line %d %q: bad ACS Control value", n, sc.Text())
		}
		ports = append(ports, ScriptPort{Addr: a, Position: f[1], Current: pci.ACSBits(cur), Target: pci.ACSBits(tgt)})
	}
	return ports, sc.Err()
}
