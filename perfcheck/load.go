package perfcheck

import (
	"bytes"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strings"
)

// Side is everything read from one side's directory (host or guest).
type Side struct {
	Dir string
	// NCCL holds the rounds of each collective, in file-name order.
	NCCL map[string][]*NCCLRun
	// NVBandwidth holds the nvbandwidth files, in file-name order.
	NVBandwidth []*NVBRun
}

// maxFileSize bounds what one result file may hold: nccl-tests and nvbandwidth print
// kilobytes; anything larger is not their output.
const maxFileSize = 64 << 20

// Load reads every regular, non-hidden file below root in fsys (recursively) and
// sorts it into nccl-tests rounds and nvbandwidth runs, as doc.go describes. dir names
// the side in errors.
func Load(fsys fs.FS, dir string) (*Side, error) {
	side := &Side{Dir: dir, NCCL: map[string][]*NCCLRun{}}
	var files []string
	err := fs.WalkDir(fsys, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("%s: %w", path.Join(dir, p), err)
		}
		base := d.Name()
		if p != "." && strings.HasPrefix(base, ".") {
			if d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		if d.Type().IsRegular() {
			files = append(files, p)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	sort.Strings(files)
	for _, p := range files {
		name := path.Join(dir, p)
		fi, err := fs.Stat(fsys, p)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		if fi.Size() > maxFileSize {
			return nil, fmt.Errorf("%s: %d bytes is too large for a result file", name, fi.Size())
		}
		data, err := fs.ReadFile(fsys, p)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		switch Detect(path.Base(p), data) {
		case KindNVBandwidth:
			run, err := ParseNVBandwidth(name, bytes.NewReader(data))
			if err != nil {
				return nil, err
			}
			side.NVBandwidth = append(side.NVBandwidth, run)
		case KindNCCL:
			run, err := ParseNCCL(name, bytes.NewReader(data))
			if err != nil {
				return nil, err
			}
			byName := collectiveFromName(path.Base(p))
			switch {
			case run.Collective == "" && byName == "":
				return nil, fmt.Errorf("%s: nccl-tests output, but neither the file nor its name says which collective", name)
			case run.Collective == "":
				run.Collective = byName
			case byName != "" && byName != run.Collective:
				return nil, fmt.Errorf("%s: file is named for %s but holds %s_perf output", name, byName, run.Collective)
			}
			side.NCCL[run.Collective] = append(side.NCCL[run.Collective], run)
		default:
			return nil, fmt.Errorf("%s: neither nccl-tests nor nvbandwidth output", name)
		}
	}
	if len(side.NCCL) == 0 && len(side.NVBandwidth) == 0 {
		return nil, fmt.Errorf("%s: no nccl-tests or nvbandwidth results", dir)
	}
	return side, nil
}

// Kind says which tool printed a file.
type Kind int

const (
	KindUnknown Kind = iota
	KindNCCL
	KindNVBandwidth
)

func (k Kind) String() string {
	switch k {
	case KindNCCL:
		return "nccl-tests"
	case KindNVBandwidth:
		return "nvbandwidth"
	}
	return "unknown"
}

// Detect tells the tool from the content first (banner lines each tool prints), then
// from the file name, so that a run that died before its banner is still recognised.
func Detect(base string, data []byte) Kind {
	for _, l := range strings.Split(string(data), "\n") {
		s := stripLine(l)
		switch {
		case strings.HasPrefix(s, "nvbandwidth Version:"),
			strings.HasPrefix(s, "Running ") && strings.HasSuffix(s, "_ce.") || strings.HasPrefix(s, "Running ") && strings.HasSuffix(s, "_sm."):
			return KindNVBandwidth
		case strings.HasPrefix(s, "#"):
			body := strings.Fields(strings.TrimLeft(s, "#"))
			if len(body) > 0 && (body[0] == "nThread" || body[0] == "size" || body[0] == "nccl-tests" ||
				strings.HasPrefix(strings.Join(body, " "), "Avg bus bandwidth") ||
				strings.HasPrefix(strings.Join(body, " "), "Collective test starting")) {
				return KindNCCL
			}
		}
	}
	lb := strings.ToLower(base)
	if strings.Contains(lb, "nvbandwidth") {
		return KindNVBandwidth
	}
	if collectiveFromName(base) != "" {
		return KindNCCL
	}
	return KindUnknown
}
