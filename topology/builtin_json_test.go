package topology

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite profiles/*.json from profiles/*.yaml")

// TestBuiltinJSON holds each built-in profile's embedded JSON to its YAML: the JSON is
// exactly what the YAML parses to, marshalled, and Builtin (which reads the JSON) returns
// the profile ParseProfile reads from the YAML. With -update it writes the JSON.
func TestBuiltinJSON(t *testing.T) {
	names := Builtins()
	if len(names) == 0 {
		t.Fatal("no built-in profiles")
	}
	for _, n := range names {
		src, err := os.ReadFile(filepath.Join("profiles", n+".yaml"))
		if err != nil {
			t.Fatal(err)
		}
		fromYAML, err := ParseProfile(n+".yaml", src)
		if err != nil {
			t.Fatal(err)
		}
		want, err := json.MarshalIndent(fromYAML, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, '\n')
		file := filepath.Join("profiles", n+".json")
		if *update {
			if err := os.WriteFile(file, want, 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := os.ReadFile(file)
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s is not what %s.yaml parses to (%v): go test ./topology -run TestBuiltinJSON -update", file, n, err)
			continue
		}
		fromJSON, err := Builtin(n)
		if err != nil {
			t.Fatal(err)
		}
		again, _ := json.MarshalIndent(fromJSON, "", "  ")
		if !bytes.Equal(append(again, '\n'), want) {
			t.Errorf("%s: Builtin reads back another profile than the YAML's", n)
		}
		if len(fromJSON.slots) != len(fromYAML.slots) || len(fromJSON.modules) != len(fromYAML.modules) {
			t.Errorf("%s: %d slots and %d modules from the JSON, %d and %d from the YAML", n,
				len(fromJSON.slots), len(fromJSON.modules), len(fromYAML.slots), len(fromYAML.modules))
		}
	}
}

// TestBuiltinJSONStrict: the embedded JSON is read as strictly as the YAML: an unknown
// field, a malformed ID or a trailing document is an error naming the profile.
func TestBuiltinJSONStrict(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`{"name":"x","rules":[{"name":"r","role":"gpu","match":{"vendor":["0x10de"]}}],"extra":1}`, "unknown field"},
		{`{"name":"x","rules":[{"name":"r","role":"gpu","match":{"vendor":["10zz"]}}]}`, "not a hex number"},
		{`{"name":"x","rules":[{"name":"r","role":"gpu","match":{"vendor":["0x12345"]}}]}`, "wider than 16 bits"},
		{`{"name":"x","rules":[{"name":"r","role":"gpu","match":{"class":4318}}]}`, "hex number as a string"},
		{`{"name":"x","rules":[{"name":"r","role":"gpu","match":{}}]} {}`, "more than one document"},
		{`{"name":"x","rules":[{"name":"r","role":"nosuch","match":{}}]}`, "unknown role"},
	} {
		_, err := parseBuiltinJSON("t.yaml", []byte(tc.in))
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "t.yaml") {
			t.Errorf("%s: %v, want an error naming t.yaml with %q", tc.in, err, tc.want)
		}
	}
}
