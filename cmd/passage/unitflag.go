package main

import (
	"flag"
	"fmt"
	"slices"
	"strings"

	"github.com/passage-boot/passage/topology"
)

// unitList is --unit, the one spelling of a unit list in plan, render, recycle and
// unbind: units as plan labels them (gpu3 or 3), the flag repeated (--unit gpu0 --unit
// gpu1) or its values comma-separated (--unit gpu0,gpu1), or both. Where every unit is
// a meaningful default (plan, render), "all" names it and is the default; elsewhere the
// list starts empty and the command says what it wants.
type unitList struct {
	ids      []topology.UnitID // in the order given, each once
	all      bool              // every unit; ids is empty
	allowAll bool
	given    bool // set on the command line: the first --unit replaces the default
}

// register registers u as --unit on fs; plan and render (allowAll) also keep their
// old spelling, --units, which says on stderr that it goes.
func (u *unitList) register(fs *flag.FlagSet, usage string, allowAll bool) {
	u.allowAll, u.all = allowAll, allowAll
	fs.Var(u, "unit", usage)
	if allowAll {
		deprecatedAlias(fs, "units", "unit")
	}
}

func (u *unitList) String() string {
	if u == nil {
		return ""
	}
	if u.all {
		return "all"
	}
	return u.names()
}

func (u *unitList) names() string {
	names := make([]string, len(u.ids))
	for i, id := range u.ids {
		names[i] = id.String()
	}
	return strings.Join(names, ",")
}

func (u *unitList) Set(v string) error {
	if !u.given {
		u.ids, u.all, u.given = nil, false, true
	}
	for _, s := range strings.Split(v, ",") {
		s = strings.TrimSpace(s)
		if s == "all" && u.allowAll {
			u.all = true
			continue
		}
		id, err := topology.ParseUnitName(s)
		if err != nil {
			return fmt.Errorf("unit %q: want %s", s, u.want())
		}
		if !slices.Contains(u.ids, id) {
			u.ids = append(u.ids, id)
		}
	}
	if u.all && len(u.ids) > 0 {
		return fmt.Errorf("all is every unit: not with %s", u.names())
	}
	return nil
}

func (u *unitList) want() string {
	if u.allowAll {
		return "all, or units like gpu0,gpu1 (or 0,1)"
	}
	return "units like gpu0,gpu1 (or 0,1)"
}

// units is the list given, nil for all.
func (u *unitList) units() []topology.UnitID {
	if u.all {
		return nil
	}
	return u.ids
}
