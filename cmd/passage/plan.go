package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/passage-boot/passage/topology"
)

// planFlags are the inputs plan and render share.
type planFlags struct {
	src            treeSource
	profile, units string
	numa           bool
}

func (f *planFlags) register(fs *flag.FlagSet) {
	f.src.register(fs)
	fs.StringVar(&f.profile, "profile", "b300", "built-in profile ("+strings.Join(topology.Builtins(), ", ")+") or a YAML/JSON file")
	fs.StringVar(&f.units, "units", "all", "units to pass through: all, or IDs like 0,1")
	fs.BoolVar(&f.numa, "numa", false, "one pxb-pcie expander per unit on its NUMA node (guest NODE/SYS distances)")
}

// errUsage marks bad input (exit 2); other errors are failed checks (exit 1).
type errUsage struct{ error }

// plan loads the tree and the profile and builds the plan. A labelling error comes
// back with the plan.
func (f *planFlags) plan(fs *flag.FlagSet) (*topology.Plan, error) {
	var units []int
	if f.units != "all" {
		for _, s := range strings.Split(f.units, ",") {
			id, err := strconv.Atoi(strings.TrimSpace(s))
			if err != nil || id < 0 {
				return nil, errUsage{fmt.Errorf("--units %q: want all or unit IDs like 0,1", f.units)}
			}
			units = append(units, id)
		}
	}
	prof, err := topology.LoadProfile(f.profile)
	if err != nil {
		return nil, errUsage{err}
	}
	tree, err := f.src.load(fs)
	if err != nil {
		return nil, errUsage{err}
	}
	pl, err := topology.NewPlan(tree, prof, topology.GuestOptions{Units: units, NUMA: f.numa})
	if pl == nil {
		return nil, errUsage{err}
	}
	if err != nil && pl.Guest == nil && units != nil {
		// A unit the operator named does not exist or is failed: bad input.
		return pl, errUsage{err}
	}
	return pl, err
}

func exitFor(stderr io.Writer, err error) int {
	if err == nil {
		return 0
	}
	fmt.Fprintf(stderr, "passage: %s\n", strings.ReplaceAll(err.Error(), "\n", "; "))
	var u errUsage
	if errors.As(err, &u) {
		return 2
	}
	return 1
}

func cmdPlan(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("plan", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var f planFlags
	f.register(fs)
	asJSON := fs.Bool("json", false, "print the plan as JSON")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "passage plan: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	pl, err := f.plan(fs)
	if pl == nil {
		return exitFor(stderr, err)
	}
	var werr error
	if *asJSON {
		werr = pl.WriteJSON(stdout)
	} else {
		werr = pl.WriteText(stdout)
	}
	if werr != nil {
		fmt.Fprintf(stderr, "passage plan: %v\n", werr)
		return 1
	}
	if err == nil {
		for _, u := range pl.Labels.Units {
			if u.Status == topology.StatusFailed {
				err = fmt.Errorf("unit %d failed: %s", u.ID, strings.Join(u.Reasons, "; "))
				break
			}
		}
	}
	return exitFor(stderr, err)
}
