package main

import (
	"math"
	"testing"
)

// TestStageDurations: module loading is the whole modules stage plus the loads the host
// stage reports; the host stage's early link-up stays in passage's own time.
func TestStageDurations(t *testing.T) {
	log := []byte(`{"type":"stage","name":"modules","status":"ok","duration_ms":150}
{"type":"stage","name":"scan","status":"ok","duration_ms":90}
{"type":"stage","name":"host","status":"ok","duration_ms":400,"findings":["module igb: not in the image"],"changes":["module e1000e loaded (145.5ms)","module mlx5_core loaded (1.2s)","link eth0 up (200ms; negotiating while the manifest is written)"]}
{"type":"unit","id":"gpu0","status":"ok"}
{"type":"stage","name":"manifest","status":"ok","duration_ms":250}
`)
	st, mods, err := stageDurations(log)
	if err != nil {
		t.Fatal(err)
	}
	if want := 0.150 + 0.1455 + 1.2; math.Abs(mods-want) > 1e-9 {
		t.Errorf("module loading %v s, want %v", mods, want)
	}
	if st["host"] != 0.4 || st["scan"] != 0.09 || len(st) != 4 {
		t.Errorf("stages %v", st)
	}
	if _, _, err := stageDurations([]byte(`{"type":"stage","name":"host","changes":["module x loaded (soon)"]}`)); err == nil {
		t.Error("a malformed module duration was accepted")
	}
	if _, _, err := stageDurations([]byte("not json\n")); err == nil {
		t.Error("a malformed line was accepted")
	}
}
