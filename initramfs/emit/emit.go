// Package emit is both ends of the console protocol between `passage boot` and the QEMU
// harness: the files of /run/passage leave the guest as base64 blocks on the serial
// console, then one PASSAGE-DONE line; timeline markers say when each step happened.
// File, Dir, Done and Mark write it; Parser (live, line by line) and Parse (a whole
// capture) read it back, tolerating kernel messages interleaved on the console.
//
//	===PASSAGE-FILE-BEGIN <name> <size> <sha256-hex>===
//	<standard base64, wrapped at 76 columns>
//	===PASSAGE-FILE-END <name>===
//	===PASSAGE-DONE ok|degraded|failed===
//	PASSAGE-T <event> <seconds since boot, 3 decimals>
package emit

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
)

// The protocol's words, written by the encoder below and compiled into the decoder's
// patterns in parse.go, so the two cannot drift apart.
const (
	beginPrefix = "===PASSAGE-FILE-BEGIN "
	endPrefix   = "===PASSAGE-FILE-END "
	donePrefix  = "===PASSAGE-DONE "
	closer      = "==="
	markPrefix  = "PASSAGE-T "
	lineWidth   = 76

	// namePattern is one path element a BEGIN line can carry: the fields are split on
	// spaces, and the reader may write the file under its name.
	namePattern = `[^\s/]+`
	// eventPattern keeps a marker's event apart from kernel text on the same line.
	eventPattern = `[a-z][a-z0-9-]*`
)

// summaries are the PASSAGE-DONE words, the boot's overall status.
var summaries = []string{"ok", "degraded", "failed"}

// nameRE and eventRE are compiled on first use: every passage process links this
// package, and only the boot writes blocks and markers.
var (
	nameRE  = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^` + namePattern + `$`) })
	eventRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^` + eventPattern + `$`) })
)

func validName(name string) bool {
	return nameRE().MatchString(name) && name != "." && name != ".."
}

// File writes one file's block. Each line goes out in one Write so that a kernel message
// can only land between lines, never inside one.
func File(w io.Writer, name string, content []byte) error {
	if !validName(name) {
		return fmt.Errorf("emit %q: name must be one path element, without spaces", name)
	}
	sum := sha256.Sum256(content)
	if _, err := fmt.Fprintf(w, "%s%s %d %s%s\n", beginPrefix, name, len(content), hex.EncodeToString(sum[:]), closer); err != nil {
		return fmt.Errorf("emit %s: %w", name, err)
	}
	enc := base64.StdEncoding.EncodeToString(content)
	for len(enc) > 0 {
		n := min(lineWidth, len(enc))
		if _, err := io.WriteString(w, enc[:n]+"\n"); err != nil {
			return fmt.Errorf("emit %s: %w", name, err)
		}
		enc = enc[n:]
	}
	if _, err := fmt.Fprintf(w, "%s%s%s\n", endPrefix, name, closer); err != nil {
		return fmt.Errorf("emit %s: %w", name, err)
	}
	return nil
}

// Dir writes a block for every regular file directly in dir, sorted by name, except
// those whose name starts with a dot (a write's temporary, the generation lock). Files
// that vanish or cannot be read are reported in the error after the others are written.
func Dir(w io.Writer, dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("emit %s: %w", dir, err)
	}
	sort.Slice(ents, func(i, j int) bool { return ents[i].Name() < ents[j].Name() })
	var errs []string
	for _, e := range ents {
		if !e.Type().IsRegular() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		if err := File(w, e.Name(), b); err != nil {
			return err
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("emit %s: %s", dir, strings.Join(errs, "; "))
	}
	return nil
}

// Done writes the final line; summary is ok, degraded or failed (anything else is
// refused: the reader would not take it).
func Done(w io.Writer, summary string) error {
	if !slices.Contains(summaries, summary) {
		return fmt.Errorf("emit done %q: summary must be one of %s", summary, strings.Join(summaries, ", "))
	}
	if _, err := fmt.Fprintf(w, "%s%s%s\n", donePrefix, summary, closer); err != nil {
		return fmt.Errorf("emit done %s: %w", summary, err)
	}
	return nil
}

// Uptime reads the seconds since boot from root/proc/uptime.
func Uptime(root string) (float64, error) {
	p := filepath.Join(root, "proc", "uptime")
	b, err := os.ReadFile(p)
	if err != nil {
		return 0, fmt.Errorf("uptime %s: %w", p, err)
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0, fmt.Errorf("uptime %s: empty", p)
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return 0, fmt.Errorf("uptime %s: %w", p, err)
	}
	// ParseFloat takes "NaN" and "Inf"; a marker must carry a time the reader can parse.
	if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
		return 0, fmt.Errorf("uptime %s: %q is not a time since boot", p, f[0])
	}
	return v, nil
}

// Mark writes a timeline marker `PASSAGE-T <event> <seconds>` with the uptime read under
// root, and returns the uptime. An unreadable uptime writes -1 so the event still shows
// (the reader keeps it as -1: time unknown). An event name the reader would not
// recognise (lower case, digits and dashes) writes nothing.
func Mark(w io.Writer, root, event string) (float64, error) {
	if !eventRE().MatchString(event) {
		return -1, fmt.Errorf("emit mark %q: event must match %s", event, eventPattern)
	}
	up, err := Uptime(root)
	if err != nil {
		up = -1
	}
	fmt.Fprintf(w, "%s%s %.3f\n", markPrefix, event, up)
	return up, err
}
