package manifest_test

import (
	"testing"

	. "github.com/passage-boot/passage/manifest"
)

func TestPrintable(t *testing.T) {
	for in, want := range map[string]string{
		"b300-r07-n3":          "b300-r07-n3",
		"nodé ünit":            "nodé ünit",
		"a\nb\r\tc":            `a\nb\r\tc`,
		"\x1b[2J\x07\x7f":      `\x1b[2J\x07\x7f`,
		"\u0085\u009b":         `\u0085\u009b`,
		"x\u202ey\u2066\u2028": `x\u202ey\u2066\u2028`,
		"bad \xff\xfe utf-8":   `bad \xff\xfe utf-8`,
		"\ufffd kept":          "\ufffd kept",
		`a\nb`:                 `a\\nb`,
		"":                     "",
	} {
		if got := Printable(in); got != want {
			t.Errorf("Printable(%q) = %q, want %q", in, got, want)
		}
	}
}
