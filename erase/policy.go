package erase

import "fmt"

// Policy is passage.erase=: whether a unit's NVMe is erased and its functions reset
// before it is passed through, and what a failure means (package decision judges it).
type Policy string

const (
	PolicyOff     Policy = "off"     // nothing is erased or reset
	PolicyAuto    Policy = "auto"    // erase and reset; a unit that could not be is degraded
	PolicyRequire Policy = "require" // erase and reset; a unit that could not be is failed, never bound
)

// ParsePolicy reads a policy word; "" is off.
func ParsePolicy(s string) (Policy, error) {
	switch Policy(s) {
	case "", PolicyOff:
		return PolicyOff, nil
	case PolicyAuto, PolicyRequire:
		return Policy(s), nil
	}
	return "", fmt.Errorf("erase policy %q: want off, auto or require", s)
}

// Active says the policy erases.
func (p Policy) Active() bool { return p == PolicyAuto || p == PolicyRequire }
