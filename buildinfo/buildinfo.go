// Package buildinfo says which build of passage is running: the module version, the VCS
// revision and whether the work tree had changes, and the Go toolchain, as the Go linker
// recorded them (runtime/debug.ReadBuildInfo). Every place that names the build (passage
// version, the manifest payload, log.jsonl, the console, verify, passage_build_info)
// takes it from Read, so they cannot disagree.
package buildinfo

import (
	"fmt"
	"runtime/debug"
)

// ModulePath is passage's module. In an image built by u-root the main module is
// u-root's generated busybox and passage one of its dependencies.
const ModulePath = "github.com/passage-boot/passage"

// Info is one build. Empty strings mean the linker recorded nothing (a build outside a
// VCS checkout, or with -buildvcs=false): the String forms say "unknown".
type Info struct {
	Version   string `json:"version"`    // module version: "v1.4.0", "(devel)" for a build from a work tree
	Revision  string `json:"revision"`   // vcs.revision: the commit the binary was built from
	Modified  bool   `json:"modified"`   // vcs.modified: the work tree had uncommitted changes
	GoVersion string `json:"go_version"` // the toolchain, "go1.26.0"
}

// The build stamped by the linker (-X, image/buildstamp.sh) where the toolchain records
// none: in the image, u-root's busybox copies passage into a module of its own and keeps
// nothing of passage's in its build information; a go build under -buildvcs=false
// records no vcs.* settings. The stamp is taken from git as go build takes them.
var (
	stampVersion  string
	stampRevision string
	stampModified string
)

// Read is this binary's build.
func Read() Info {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return stamped(Info{}, stampVersion, stampRevision, stampModified)
	}
	return stamped(FromBuildInfo(bi), stampVersion, stampRevision, stampModified)
}

// stamped fills in what the build information lacks from the linker's stamp; the
// toolchain's own record, where there is one, is the one that counts.
func stamped(i Info, version, revision, modified string) Info {
	if i.Version == "" {
		i.Version = version
	}
	if i.Revision == "" && revision != "" {
		i.Revision, i.Modified = revision, modified == "true"
	}
	return i
}

// FromBuildInfo picks passage's module out of a binary's build information. The VCS
// settings describe the main module only, so they count only when passage is the main
// module.
func FromBuildInfo(bi *debug.BuildInfo) Info {
	i := Info{GoVersion: bi.GoVersion}
	if bi.Main.Path != ModulePath {
		for _, d := range bi.Deps {
			if d.Path != ModulePath {
				continue
			}
			i.Version = d.Version
			if r := d.Replace; r != nil {
				// A replacement by a directory (how u-root's busybox takes passage's
				// tree) has no version: the build is of a work tree, as go build's.
				i.Version = r.Version
				if i.Version == "" {
					i.Version = "(devel)"
				}
			}
		}
		return i
	}
	i.Version = bi.Main.Version
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			i.Revision = s.Value
		case "vcs.modified":
			i.Modified = s.Value == "true"
		}
	}
	return i
}

// Rev is the revision as git describe --dirty writes it: "<commit>-dirty" for a
// modified tree, "unknown" when none was recorded.
func (i Info) Rev() string {
	r := i.Revision
	if r == "" {
		r = "unknown"
	}
	if i.Modified {
		r += "-dirty"
	}
	return r
}

// VersionString is the module version, "unknown" when none was recorded.
func (i Info) VersionString() string {
	if i.Version == "" {
		return "unknown"
	}
	return i.Version
}

// GoString is the toolchain, "unknown" when none was recorded.
func (i Info) GoString() string {
	if i.GoVersion == "" {
		return "unknown"
	}
	return i.GoVersion
}

// String is the one-line form: "passage v1.4.0 (revision 1f0c…-dirty, go1.26.0)".
func (i Info) String() string {
	return fmt.Sprintf("passage %s (revision %s, %s)", i.VersionString(), i.Rev(), i.GoString())
}
