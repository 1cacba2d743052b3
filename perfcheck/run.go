package perfcheck

import (
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
)

// Config is one `passage perfcheck` invocation.
type Config struct {
	HostDir, GuestDir string
	// HostFS and GuestFS, when set, are read instead of the directories (tests);
	// the Dir names still label the report and errors.
	HostFS, GuestFS fs.FS
	Options         Options
	JSON            bool   // print the report as JSON instead of text
	HTMLFile        string // also write the HTML report here
}

// Run loads both sides, compares them and writes the report. An error means bad input
// (unreadable or malformed files, nothing to compare); a crossed threshold is a report
// with Pass false.
func Run(cfg Config, stdout io.Writer) (*Report, error) {
	var sides [2]*Side
	for i, s := range []struct {
		dir  string
		fsys fs.FS
	}{{cfg.HostDir, cfg.HostFS}, {cfg.GuestDir, cfg.GuestFS}} {
		fsys := s.fsys
		if fsys == nil {
			st, err := os.Stat(s.dir)
			if err != nil {
				return nil, fmt.Errorf("%w", err)
			}
			if !st.IsDir() {
				return nil, fmt.Errorf("%s: not a directory", s.dir)
			}
			fsys = os.DirFS(s.dir)
		}
		side, err := Load(fsys, s.dir)
		if err != nil {
			return nil, err
		}
		sides[i] = side
	}
	rep := CompareSides(sides[0], sides[1], cfg.Options)
	if cfg.HTMLFile != "" {
		if err := writeHTMLFile(cfg.HTMLFile, rep); err != nil {
			return nil, err
		}
	}
	var err error
	if cfg.JSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		err = enc.Encode(rep)
	} else {
		err = WriteText(stdout, rep)
	}
	if err != nil {
		return nil, fmt.Errorf("write report: %w", err)
	}
	return rep, nil
}

func writeHTMLFile(name string, rep *Report) error {
	f, err := os.Create(name)
	if err != nil {
		return fmt.Errorf("html %s: %w", name, err)
	}
	if err := WriteHTML(f, rep); err != nil {
		f.Close()
		return fmt.Errorf("html %s: %w", name, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("html %s: %w", name, err)
	}
	return nil
}
