package kmod

import "testing"

func TestPlainRelease(t *testing.T) {
	for s, want := range map[string]bool{
		"6.1.0-57-amd64": true, "6.11.0+": true, "5.15.0-1040-nvidia": true,
		"": false, ".": false, "..": false, "../../tmp": false, "6.1/../../x": false, "/lib": false, "a b": false, "6.1\n": false,
	} {
		if got := PlainRelease(s); got != want {
			t.Errorf("PlainRelease(%q) = %v, want %v", s, got, want)
		}
	}
}
