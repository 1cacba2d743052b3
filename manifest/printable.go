package manifest

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Printable is s safe to print on one line of a terminal or a line-oriented report: a
// payload's strings are the signer's, and a hostname with a line feed would forge a line
// of the fleet report, an escape sequence would drive the operator's terminal. Control
// characters (C0 with line feed and tab, DEL, C1), Unicode bidirectional controls and
// bytes that are not UTF-8 become Go escapes (\n, \x1b, \u202e, \xff); a backslash is
// doubled so an escape cannot be forged either. Anything else is kept.
func Printable(s string) string {
	clean := true
	for i, r := range s {
		if r == '\\' || unsafeRune(r) || (r == utf8.RuneError && !validAt(s, i)) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n <= 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\\':
			b.WriteString(`\\`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x80 && unsafeRune(r):
			fmt.Fprintf(&b, `\x%02x`, r)
		case unsafeRune(r):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

func unsafeRune(r rune) bool {
	return unicode.IsControl(r) || unicode.Is(unicode.Bidi_Control, r) || r == '\u2028' || r == '\u2029'
}

// validAt says whether the U+FFFD decoded at i is really in s (not a bad byte).
func validAt(s string, i int) bool {
	_, n := utf8.DecodeRuneInString(s[i:])
	return n == 3
}
