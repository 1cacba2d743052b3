package decision

import (
	"fmt"

	"github.com/passage-boot/passage/topology"
)

// Command is the command that will execute a decision. It fixes which steps run after
// the decision, and so what the decision can promise before the first write: a unit
// whose verdict a step the command does not run would settle is decided without it.
type Command string

const (
	// CommandBoot is passage boot: acs, erase (under an active policy), vfio.
	CommandBoot Command = "boot"
	// CommandApply is passage apply on a running node: acs and vfio, never erase (it
	// does not release a unit a tenant may hold; recycle does).
	CommandApply Command = "apply"
	// CommandRecycle is passage recycle: release, erase, reset, vfio.
	CommandRecycle Command = "recycle"
)

// Commands are the commands a decision can predict, as plan --for names them.
func Commands() []Command { return []Command{CommandBoot, CommandApply, CommandRecycle} }

// ParseCommand reads a command name; "" is the boot.
func ParseCommand(s string) (Command, error) {
	if s == "" {
		return CommandBoot, nil
	}
	for _, c := range Commands() {
		if string(c) == s {
			return c, nil
		}
	}
	return "", fmt.Errorf("command %q: want boot, apply or recycle", s)
}

// Erases says the command runs the erase step.
func (c Command) Erases() bool { return c == CommandBoot || c == CommandRecycle }

// steps are the steps the command runs after the decision.
func (c Command) steps() string {
	switch c {
	case CommandApply:
		return "acs, vfio (no erase)"
	case CommandRecycle:
		return "release, erase, reset, vfio"
	}
	return "acs, erase (under an active erase policy), vfio"
}

// notErased is why a command that does not erase cannot pass a unit through as
// erased.
func (c Command) notErased() string {
	return fmt.Sprintf("%s does not erase; the boot and passage recycle do", c)
}

// markSteps gives each unit, before anything is written, the verdict of the steps its
// executing command will not run: under an active erase policy a command that does not
// erase leaves every unit failed (require) or degraded (auto). A unit failed here has its
// ports left alone, like any unit failed before the first write.
func (d *Decision) markSteps(mark func(topology.UnitID, topology.Status, string)) {
	if !d.Erase.Active() || d.For.Erases() {
		return
	}
	s := d.erasePolicyStatus()
	why := fmt.Sprintf("erase (%s): not run: %s", d.Erase, d.For.notErased())
	for _, u := range d.Units() {
		mark(u.ID, s, why)
	}
}
