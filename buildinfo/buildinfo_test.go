package buildinfo

import (
	"runtime/debug"
	"testing"
)

func TestFromBuildInfo(t *testing.T) {
	vcs := []debug.BuildSetting{{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: "0123456789abcdef0123456789abcdef01234567"}, {Key: "vcs.modified", Value: "true"}}
	for name, tc := range map[string]struct {
		bi   debug.BuildInfo
		want Info
		str  string
	}{
		"main module from a work tree": {
			bi:   debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Path: ModulePath, Version: "(devel)"}, Settings: vcs},
			want: Info{Version: "(devel)", Revision: "0123456789abcdef0123456789abcdef01234567", Modified: true, GoVersion: "go1.26.0"},
			str:  "passage (devel) (revision 0123456789abcdef0123456789abcdef01234567-dirty, go1.26.0)",
		},
		"go install of a tag": {
			bi:   debug.BuildInfo{GoVersion: "go1.26.1", Main: debug.Module{Path: ModulePath, Version: "v1.4.0"}},
			want: Info{Version: "v1.4.0", GoVersion: "go1.26.1"},
			str:  "passage v1.4.0 (revision unknown, go1.26.1)",
		},
		// u-root's busybox is the main module; its VCS settings are not passage's.
		"dependency of a busybox": {
			bi: debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Path: "bb.u-root.com/bb"}, Settings: vcs,
				Deps: []*debug.Module{{Path: "github.com/u-root/u-root", Version: "v0.16.0"},
					{Path: ModulePath, Version: "v0.0.0-00010101000000-000000000000", Replace: &debug.Module{Path: "/src/passage"}}}},
			want: Info{Version: "(devel)", GoVersion: "go1.26.0"},
			str:  "passage (devel) (revision unknown, go1.26.0)",
		},
		"dependency at a tagged version": {
			bi:   debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Path: "example.com/tool"}, Deps: []*debug.Module{{Path: ModulePath, Version: "v1.4.0"}}},
			want: Info{Version: "v1.4.0", GoVersion: "go1.26.0"},
			str:  "passage v1.4.0 (revision unknown, go1.26.0)",
		},
		"nothing recorded": {
			bi:  debug.BuildInfo{Main: debug.Module{Path: "other"}},
			str: "passage unknown (revision unknown, unknown)",
		},
	} {
		t.Run(name, func(t *testing.T) {
			got := FromBuildInfo(&tc.bi)
			if got != tc.want {
				t.Errorf("FromBuildInfo = %+v, want %+v", got, tc.want)
			}
			if got.String() != tc.str {
				t.Errorf("String = %q, want %q", got.String(), tc.str)
			}
		})
	}
}

// TestReadNamesThisModule: a test binary is built from passage's own module, so Read finds
// it and the toolchain.
func TestReadNamesThisModule(t *testing.T) {
	i := Read()
	if i.GoVersion == "" || i.Version == "" {
		t.Errorf("Read() = %+v: want the module version and the Go version", i)
	}
}

// TestStamped: the image's linker stamp fills in a dependency build's missing revision,
// and never overrides the toolchain's own record.
func TestStamped(t *testing.T) {
	bb := Info{GoVersion: "go1.26.0"} // u-root's busybox: nothing of passage's recorded
	for _, c := range []struct {
		name               string
		in                 Info
		ver, rev, modified string
		want               Info
	}{
		{"image build", bb, "(devel)", "0123abcd", "true", Info{Version: "(devel)", Revision: "0123abcd", Modified: true, GoVersion: "go1.26.0"}},
		{"clean tree", bb, "(devel)", "0123abcd", "false", Info{Version: "(devel)", Revision: "0123abcd", GoVersion: "go1.26.0"}},
		{"-buildvcs=false", Info{Version: "(devel)"}, "(devel)", "0123abcd", "false", Info{Version: "(devel)", Revision: "0123abcd"}},
		{"no stamp", bb, "", "", "", bb},
		{"toolchain's record wins", Info{Version: "v1.2.0", Revision: "feed"}, "(devel)", "0123abcd", "true", Info{Version: "v1.2.0", Revision: "feed"}},
	} {
		if got := stamped(c.in, c.ver, c.rev, c.modified); got != c.want {
			t.Errorf("%s: stamped = %+v, want %+v", c.name, got, c.want)
		}
	}
}
