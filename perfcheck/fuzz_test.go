package perfcheck

import (
	"bytes"
	"math"
	"os"
	"path/filepath"
	"testing"
)

// addFileSeeds adds the fixture files of a directory; the committed corpus under
// testdata/fuzz holds small hand-made edge cases on top of these.
func addFileSeeds(f *testing.F, pattern string) {
	files, _ := filepath.Glob(pattern)
	for _, p := range files {
		if data, err := os.ReadFile(p); err == nil {
			f.Add(data)
		}
	}
}

func FuzzParseNCCL(f *testing.F) {
	addFileSeeds(f, "testdata/nccl/*.txt")
	addFileSeeds(f, "testdata/b300/host/all_reduce_perf.1.txt")
	addFileSeeds(f, "testdata/b300/guest/round1/alltoall_perf.log")
	f.Fuzz(func(t *testing.T, data []byte) {
		run, err := ParseNCCL("fuzz", bytes.NewReader(data))
		if err != nil {
			if run != nil {
				t.Fatal("error with a result")
			}
			return
		}
		if len(run.Rows) == 0 && run.Aborted == "" {
			t.Fatal("no rows and not aborted, yet no error")
		}
		last := 0
		for _, r := range run.Rows {
			if r.Size < 0 || r.Count < 0 || r.Line <= last {
				t.Fatalf("bad row %+v after line %d", r, last)
			}
			last = r.Line
			if r.OutOfPlace.Valid() && (math.IsNaN(r.OutOfPlace.BusBW) || r.OutOfPlace.BusBW < 0) {
				t.Fatalf("Valid lies: %+v", r.OutOfPlace)
			}
		}
		// whatever parses must compare and report without panicking
		side := &Side{Dir: "x", NCCL: map[string][]*NCCLRun{"all_reduce": {run}}}
		rep := CompareSides(side, side, Options{Thresholds: DefaultThresholds})
		if err := WriteHTML(&bytes.Buffer{}, rep); err != nil {
			t.Fatal(err)
		}
		if err := WriteText(&bytes.Buffer{}, rep); err != nil {
			t.Fatal(err)
		}
	})
}

func FuzzParseNVBandwidth(f *testing.F) {
	addFileSeeds(f, "testdata/nvbandwidth/*.txt")
	addFileSeeds(f, "testdata/b300/host/nvbandwidth.1.txt")
	f.Fuzz(func(t *testing.T, data []byte) {
		run, err := ParseNVBandwidth("fuzz", bytes.NewReader(data))
		if err != nil {
			if run != nil {
				t.Fatal("error with a result")
			}
			return
		}
		for _, tc := range run.Testcases {
			for _, row := range tc.Matrix {
				if len(row) != len(tc.Columns) {
					t.Fatalf("%s: row of %d values under %d columns", tc.Name, len(row), len(tc.Columns))
				}
			}
		}
		side := &Side{Dir: "x", NCCL: map[string][]*NCCLRun{}, NVBandwidth: []*NVBRun{run}}
		rep := CompareSides(side, side, Options{Thresholds: DefaultThresholds})
		if err := WriteText(&bytes.Buffer{}, rep); err != nil {
			t.Fatal(err)
		}
	})
}

// A busbw near the largest float64 once made the plot's axis loop run forever.
func TestHTMLHugeValues(t *testing.T) {
	mk := func(busbw float64) *Side {
		r := &NCCLRun{File: "x", Collective: "all_reduce", Rows: []NCCLRow{
			{Line: 1, Size: 8, OutOfPlace: NCCLResult{BusBW: 1e-300}, InPlace: nanResult()},
			{Line: 2, Size: 1 << 62, OutOfPlace: NCCLResult{BusBW: busbw}, InPlace: nanResult()},
		}}
		return &Side{Dir: "x", NCCL: map[string][]*NCCLRun{"all_reduce": {r}}}
	}
	rep := CompareSides(mk(1.7e308), mk(1e300), Options{Thresholds: DefaultThresholds})
	var buf bytes.Buffer
	if err := WriteHTML(&buf, rep); err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(buf.Bytes(), []byte("<svg")) {
		t.Error("no plot")
	}
}
