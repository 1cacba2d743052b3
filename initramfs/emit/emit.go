// Package emit is the guest side of the console protocol between `passage boot` and the
// QEMU harness: the files of /run/passage leave the guest as base64 blocks on the serial
// console, then one PASSAGE-DONE line; timeline markers say when each step happened.
// Read parses the same blocks back, tolerating kernel messages interleaved on the console.
//
//	===PASSAGE-FILE-BEGIN <name> <size> <sha256-hex>===
//	<standard base64, wrapped at 76 columns>
//	===PASSAGE-FILE-END <name>===
//	===PASSAGE-DONE ok|degraded|failed===
//	PASSAGE-T <event> <seconds since boot, 3 decimals>
package emit

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

const (
	beginPrefix = "===PASSAGE-FILE-BEGIN "
	endPrefix   = "===PASSAGE-FILE-END "
	donePrefix  = "===PASSAGE-DONE "
	marker      = "==="
	lineWidth   = 76
)

// File writes one file's block. Each line goes out in one Write so that a kernel message
// can only land between lines, never inside one.
func File(w io.Writer, name string, content []byte) error {
	if name == "" || strings.ContainsAny(name, " \t\n/") {
		return fmt.Errorf("emit %q: name must be one path element without spaces", name)
	}
	sum := sha256.Sum256(content)
	if _, err := fmt.Fprintf(w, "%s%s %d %s%s\n", beginPrefix, name, len(content), hex.EncodeToString(sum[:]), marker); err != nil {
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
	if _, err := fmt.Fprintf(w, "%s%s%s\n", endPrefix, name, marker); err != nil {
		return fmt.Errorf("emit %s: %w", name, err)
	}
	return nil
}

// Dir writes a block for every regular file directly in dir, sorted by name. Files that
// vanish or cannot be read are reported in the error after the others are written.
func Dir(w io.Writer, dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("emit %s: %w", dir, err)
	}
	sort.Slice(ents, func(i, j int) bool { return ents[i].Name() < ents[j].Name() })
	var errs []string
	for _, e := range ents {
		if !e.Type().IsRegular() {
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

// Done writes the final line; summary is ok, degraded or failed.
func Done(w io.Writer, summary string) error {
	_, err := fmt.Fprintf(w, "%s%s%s\n", donePrefix, summary, marker)
	return err
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
	return v, nil
}

// Mark writes a timeline marker `PASSAGE-T <event> <seconds>` with the uptime read under
// root, and returns the uptime. An unreadable uptime writes -1 so the event still shows.
func Mark(w io.Writer, root, event string) (float64, error) {
	up, err := Uptime(root)
	if err != nil {
		up = -1
	}
	fmt.Fprintf(w, "PASSAGE-T %s %.3f\n", event, up)
	return up, err
}

// Output is what Read recovers from a console capture.
type Output struct {
	Files    map[string][]byte
	Done     string             // the PASSAGE-DONE summary; empty if the line never came
	Timeline map[string]float64 // PASSAGE-T event -> seconds since boot
}

func isBase64Line(s string) bool {
	if s == "" || len(s) > lineWidth {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '+' || c == '/' || c == '=') {
			return false
		}
	}
	return true
}

// Read parses a console capture. Lines that are not part of the protocol are ignored;
// inside a block only base64-alphabet lines count. A block whose size or sha256 does not
// match is an error naming the file.
func Read(r io.Reader) (*Output, error) {
	out := &Output{Files: map[string][]byte{}, Timeline: map[string]float64{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 16*1024*1024)
	var (
		cur     string
		size    int
		sum     string
		payload bytes.Buffer
		inBlock bool
	)
	for sc.Scan() {
		line := strings.TrimRight(sc.Text(), "\r")
		switch {
		case strings.HasPrefix(line, beginPrefix) && strings.HasSuffix(line, marker):
			f := strings.Fields(strings.TrimSuffix(strings.TrimPrefix(line, beginPrefix), marker))
			if len(f) != 3 {
				return nil, fmt.Errorf("emit: malformed begin line %q", line)
			}
			if strings.Contains(f[0], "/") {
				return nil, fmt.Errorf("emit %q: file name with a path", f[0])
			}
			n, err := strconv.Atoi(f[1])
			if err != nil || n < 0 {
				return nil, fmt.Errorf("emit %s: bad size %q", f[0], f[1])
			}
			cur, size, sum, inBlock = f[0], n, f[2], true
			payload.Reset()
		case inBlock && strings.HasPrefix(line, endPrefix):
			name := strings.TrimSuffix(strings.TrimPrefix(line, endPrefix), marker)
			if name != cur {
				return nil, fmt.Errorf("emit %s: end line names %q", cur, name)
			}
			b, err := base64.StdEncoding.DecodeString(payload.String())
			if err != nil {
				return nil, fmt.Errorf("emit %s: %w", cur, err)
			}
			if len(b) != size {
				return nil, fmt.Errorf("emit %s: %d bytes, begin line says %d", cur, len(b), size)
			}
			got := sha256.Sum256(b)
			if hex.EncodeToString(got[:]) != sum {
				return nil, fmt.Errorf("emit %s: sha256 mismatch", cur)
			}
			out.Files[cur] = b
			inBlock = false
		case inBlock:
			if isBase64Line(line) {
				payload.WriteString(line)
			}
		case strings.HasPrefix(line, donePrefix) && strings.HasSuffix(line, marker):
			out.Done = strings.TrimSuffix(strings.TrimPrefix(line, donePrefix), marker)
		case strings.HasPrefix(line, "PASSAGE-T "):
			f := strings.Fields(line)
			if len(f) == 3 {
				if v, err := strconv.ParseFloat(f[2], 64); err == nil {
					out.Timeline[f[1]] = v
				}
			}
		}
	}
	if err := sc.Err(); err != nil {
		return out, fmt.Errorf("emit: read console: %w", err)
	}
	if inBlock {
		return out, fmt.Errorf("emit %s: no end line", cur)
	}
	return out, nil
}
