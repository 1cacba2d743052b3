package manifest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// maxJSONDepth bounds the nesting checkUniqueKeys walks. A manifest nests about six
// levels deep; the bound keeps a hostile "[[[[..." from growing the walk's stacks.
const maxJSONDepth = 64

// checkUniqueKeys walks the first JSON value of data and refuses any object that gives a
// key twice, at any depth. Parsers disagree on duplicates (first wins, last wins,
// error), so a document with one can mean two things to two verifiers. Keys that differ
// only in case count as the same key: encoding/json matches struct fields
// case-insensitively, so "Payload" after "payload" would replace it here while a
// case-sensitive parser keeps "payload". The error names the key and where it is
// ("$.signatures[0]"). Syntax errors are reported too; what follows the first value is
// left to the caller.
func checkUniqueKeys(data []byte) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber() // numbers are not converted (a 1e400 is not this check's business)
	w := keyWalker{dec: dec}
	return w.value()
}

// CheckUniqueKeys is checkUniqueKeys for other documents read from outside bytes (the
// enrolment challenge a control plane sends the boot, initramfs/netboot).
func CheckUniqueKeys(data []byte) error { return checkUniqueKeys(data) }

type keyWalker struct {
	dec  *json.Decoder
	path []string // "$" is implied; each element is ".key" or "[i]"
}

func (w *keyWalker) where() string { return "$" + strings.Join(w.path, "") }

func (w *keyWalker) token() (json.Token, error) {
	tok, err := w.dec.Token()
	if errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("unexpected end of JSON input at %s", w.where())
	}
	return tok, err
}

func (w *keyWalker) value() error {
	tok, err := w.token()
	if err != nil {
		return err
	}
	d, ok := tok.(json.Delim)
	if !ok {
		return nil // a scalar
	}
	if len(w.path) >= maxJSONDepth {
		return fmt.Errorf("nested deeper than %d levels at %s", maxJSONDepth, w.where())
	}
	switch d {
	case '{':
		seen := map[string]string{} // folded key -> key as first given
		for w.dec.More() {
			tok, err := w.token()
			if err != nil {
				return err
			}
			key, ok := tok.(string)
			if !ok {
				return fmt.Errorf("object key %v is not a string at %s", tok, w.where())
			}
			folded := foldKey(key)
			if first, dup := seen[folded]; dup {
				if first == key {
					return fmt.Errorf("duplicate key %q in %s", key, w.where())
				}
				return fmt.Errorf("duplicate key %q in %s (also given as %q; keys differing only in case are the same key to encoding/json)", key, w.where(), first)
			}
			seen[folded] = key
			w.path = append(w.path, "."+key)
			err = w.value()
			w.path = w.path[:len(w.path)-1]
			if err != nil {
				return err
			}
		}
	case '[':
		for i := 0; w.dec.More(); i++ {
			w.path = append(w.path, "["+strconv.Itoa(i)+"]")
			err := w.value()
			w.path = w.path[:len(w.path)-1]
			if err != nil {
				return err
			}
		}
	}
	_, err = w.token() // the closing '}' or ']'
	return err
}

// foldKey is the case folding encoding/json uses to match an object key to a struct
// field: ASCII upper case, and for other runes the upper case of the lower case.
func foldKey(k string) string {
	var b strings.Builder
	for _, r := range k {
		switch {
		case r < utf8.RuneSelf:
			if 'a' <= r && r <= 'z' {
				r -= 'a' - 'A'
			}
		default:
			r = unicode.ToUpper(unicode.ToLower(r))
		}
		b.WriteRune(r)
	}
	return b.String()
}
