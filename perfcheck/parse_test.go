package perfcheck

import (
	"bytes"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// realworldDir is where the real-world perf captures live: the repository's testdata,
// so a clone runs these tests with nothing beside it.
func realworldDir(t testing.TB) string {
	t.Helper()
	p := filepath.Join("..", "testdata", "realworld", "perf")
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("real-world perf captures: %v", err)
	}
	return p
}

func parseNCCLFile(t *testing.T, path string) *NCCLRun {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	run, err := ParseNCCL(filepath.Base(path), bytes.NewReader(data))
	if err != nil {
		t.Fatalf("ParseNCCL(%s): %v", path, err)
	}
	return run
}

func parseNVBFile(t *testing.T, path string) *NVBRun {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	run, err := ParseNVBandwidth(filepath.Base(path), bytes.NewReader(data))
	if err != nil {
		t.Fatalf("ParseNVBandwidth(%s): %v", path, err)
	}
	return run
}

func TestParseNCCLRealWorld(t *testing.T) {
	dir := realworldDir(t)
	tests := []struct {
		file             string
		rows             int
		firstSize        int64
		lastSize         int64
		lastOOP, lastIP  float64 // busbw of the last row, as printed
		avg              float64 // footer; 0 when the file has none
		truncated        bool
		collective       string // from the content; "" when only the name says
		redop, root      string // of the first row
		wrongIsNA        bool
		collectiveByName string
	}{
		{"a3mega_h100_2node_allreduce.txt", 31, 8, 8589934592, 338.82, 337.35, 70.742, false, "all_reduce", "sum", "-1", false, "all_reduce"},
		{"aws_batch_allreduce_mpi_tagged_noheader.txt", 32, 8, 17179869184, 483.05, 483.35, 156.742, false, "", "sum", "-1", false, "all_reduce"},
		{"playground_a100x8_sendrecv_truncated.txt", 4, 134217728, 1073741824, 195.10, 195.56, 0, true, "sendrecv", "sum", "-1", false, "sendrecv"},
		{"superbench_a100_allreduce_old_c0.txt", 34, 0, 8589934592, 235.26, 235.03, 68.4048, false, "", "sum", "", true, "all_reduce"},
		{"superbench_a100_alltoall_old_c0.txt", 34, 0, 8589934592, 224.31, 226.16, 58.6481, false, "", "", "", true, "alltoall"},
	}
	for _, tc := range tests {
		t.Run(tc.file, func(t *testing.T) {
			run := parseNCCLFile(t, filepath.Join(dir, tc.file))
			if len(run.Rows) != tc.rows {
				t.Fatalf("rows = %d, want %d", len(run.Rows), tc.rows)
			}
			first, last := run.Rows[0], run.Rows[len(run.Rows)-1]
			if first.Size != tc.firstSize || last.Size != tc.lastSize {
				t.Errorf("sizes %d..%d, want %d..%d", first.Size, last.Size, tc.firstSize, tc.lastSize)
			}
			if last.OutOfPlace.BusBW != tc.lastOOP || last.InPlace.BusBW != tc.lastIP {
				t.Errorf("last busbw %v/%v, want %v/%v", last.OutOfPlace.BusBW, last.InPlace.BusBW, tc.lastOOP, tc.lastIP)
			}
			if tc.avg == 0 {
				if run.AvgBusBW != nil {
					t.Errorf("AvgBusBW = %v, want none", *run.AvgBusBW)
				}
			} else if run.AvgBusBW == nil || *run.AvgBusBW != tc.avg {
				t.Errorf("AvgBusBW = %v, want %v", run.AvgBusBW, tc.avg)
			}
			if run.Truncated != tc.truncated {
				t.Errorf("Truncated = %v, want %v", run.Truncated, tc.truncated)
			}
			if run.Aborted != "" {
				t.Errorf("Aborted = %q", run.Aborted)
			}
			if run.Collective != tc.collective {
				t.Errorf("Collective = %q, want %q", run.Collective, tc.collective)
			}
			if got := collectiveFromName(tc.file); got != tc.collectiveByName {
				t.Errorf("collectiveFromName = %q, want %q", got, tc.collectiveByName)
			}
			if first.Redop != tc.redop || first.Root != tc.root {
				t.Errorf("first row redop/root = %q/%q, want %q/%q", first.Redop, first.Root, tc.redop, tc.root)
			}
			// -c 0 prints N/A in the #wrong column; old nccl-tests' "error" column too.
			na := math.IsNaN(first.OutOfPlace.Wrong) && math.IsNaN(first.OutOfPlace.ErrorCol)
			if tc.wrongIsNA && !na {
				t.Errorf("wrong/error = %v/%v, want N/A", first.OutOfPlace.Wrong, first.OutOfPlace.ErrorCol)
			}
			for i := 1; i < len(run.Rows); i++ {
				if run.Rows[i].Line <= run.Rows[i-1].Line {
					t.Fatalf("row lines not increasing at %d", i)
				}
			}
		})
	}
}

func TestParseNCCLFixtures(t *testing.T) {
	t.Run("truncated mid-row", func(t *testing.T) {
		run := parseNCCLFile(t, "testdata/nccl/truncated_all_reduce.txt")
		if !run.Truncated || run.Aborted != "" || run.AvgBusBW != nil {
			t.Fatalf("Truncated=%v Aborted=%q Avg=%v", run.Truncated, run.Aborted, run.AvgBusBW)
		}
		// the cut 8 MiB row is dropped, the 10 whole rows before it are kept
		if n := len(run.Rows); n != 10 || run.Rows[n-1].Size != 2<<20 {
			t.Fatalf("rows = %d, last %d", n, run.Rows[n-1].Size)
		}
	})
	t.Run("aborted", func(t *testing.T) {
		run := parseNCCLFile(t, "testdata/nccl/aborted_all_gather.txt")
		if !strings.Contains(run.Aborted, "Test NCCL failure") || run.AbortedLine != 25 {
			t.Fatalf("Aborted = %q at %d", run.Aborted, run.AbortedLine)
		}
		if !run.Truncated || len(run.Rows) != 5 || run.Collective != "all_gather" {
			t.Fatalf("Truncated=%v rows=%d collective=%q", run.Truncated, len(run.Rows), run.Collective)
		}
	})
	t.Run("wrong elements and out of bounds", func(t *testing.T) {
		run := parseNCCLFile(t, "testdata/nccl/wrong_reduce_scatter.txt")
		if run.OutOfBounds == nil || *run.OutOfBounds != 2 {
			t.Fatalf("OutOfBounds = %v", run.OutOfBounds)
		}
		if w := run.Rows[1].InPlace.Wrong; w != 1e4 {
			t.Errorf("in-place #wrong at 4 MiB = %v, want 1e+04 read as 10000", w)
		}
		if w := run.Rows[3].OutOfPlace.Wrong; w != 12 {
			t.Errorf("out-of-place #wrong at 64 MiB = %v", w)
		}
		if w := run.Rows[0].OutOfPlace.Wrong; w != 0 {
			t.Errorf("#wrong at 1 MiB = %v", w)
		}
	})
	t.Run("nan and inf", func(t *testing.T) {
		run := parseNCCLFile(t, "testdata/nccl/nan_sendrecv.txt")
		if len(run.Rows) != 9 {
			t.Fatalf("rows = %d", len(run.Rows))
		}
		r0 := run.Rows[0]
		if r0.OutOfPlace.Valid() || r0.InPlace.Valid() || !math.IsNaN(r0.OutOfPlace.BusBW) || !math.IsInf(r0.InPlace.BusBW, 1) {
			t.Errorf("row 0 busbw %v/%v should be nan/inf and invalid", r0.OutOfPlace.BusBW, r0.InPlace.BusBW)
		}
		if !run.Rows[1].OutOfPlace.Valid() {
			t.Error("0.00 busbw is a valid value")
		}
		if run.AvgBusBW == nil || !math.IsNaN(*run.AvgBusBW) {
			t.Errorf("Avg = %v, want nan", run.AvgBusBW)
		}
		if run.Truncated {
			t.Error("a run with its footer is not truncated")
		}
	})
	t.Run("per-iteration columns, timestamps, srun labels", func(t *testing.T) {
		run := parseNCCLFile(t, "testdata/nccl/periter_srun_broadcast.txt")
		if run.Collective != "broadcast" || run.Version != "2.17.9" || len(run.Rows) != 3 || run.Truncated {
			t.Fatalf("collective=%q version=%q rows=%d truncated=%v", run.Collective, run.Version, len(run.Rows), run.Truncated)
		}
		r := run.Rows[2]
		if r.OutOfPlace.BusBW != 633.58 || r.InPlace.BusBW != 633.79 || r.InPlace.TimeUS != 211.77 || r.Root != "0" {
			t.Errorf("last row %+v", r)
		}
	})
	t.Run("malformed row names file and line", func(t *testing.T) {
		data, _ := os.ReadFile("testdata/nccl/malformed_alltoall.txt")
		_, err := ParseNCCL("host/alltoall.txt", bytes.NewReader(data))
		if err == nil || !strings.Contains(err.Error(), "host/alltoall.txt:7:") || !strings.Contains(err.Error(), "busbw") {
			t.Fatalf("err = %v", err)
		}
	})
}

func TestParseNCCLErrors(t *testing.T) {
	header := "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n"
	tests := []struct {
		name, in, want string
	}{
		{"empty", "", "no result rows"},
		{"only comments", "# nThread 1 nGpus 8\n#\n", "no result rows"},
		{"short row mid-file", header + "  8  2  float  sum  -1  1.0  0.00\n  16  4  float sum -1 1 0 0 0 1 0 0 0\n", "f:2:"},
		{"size not a count", header + "  -8  2  float  sum  -1  1 0 0 0 1 0 0 0\n", "f:2: size"},
		{"numeric type", header + "  8  2  3.5  sum  -1  1 0 0 0 1 0 0 0\n", "f:2: type"},
		{"no root", header + "  8  2  float  sum  x  1 0 0 0 1 0 0 0\n", "f:2: no root"},
		{"header without busbw", "#  size  count  type  time\n", "f:1: column header"},
		{"footer garbage", header + "  8  2  float  sum  -1  1 0 0 0 1 0 0 0\n# Avg bus bandwidth    : fast\n", "f:3: avg bus bandwidth"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseNCCL("f", strings.NewReader(tc.in))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestParseNVBandwidthRealWorld(t *testing.T) {
	dir := realworldDir(t)
	h800 := parseNVBFile(t, filepath.Join(dir, "nvbandwidth_h800x8_v0.2_all.txt"))
	if h800.Version != "v0.2" || h800.Truncated || h800.Aborted != "" {
		t.Fatalf("version=%q truncated=%v aborted=%q", h800.Version, h800.Truncated, h800.Aborted)
	}
	byName := map[string]NVBTestcase{}
	for _, tc := range h800.Testcases {
		byName[tc.Name] = tc
	}
	h2d := byName["host_to_device_memcpy_ce"]
	if h2d.Sum == nil || *h2d.Sum != 442.52 || len(h2d.Matrix) != 1 || len(h2d.Columns) != 8 || h2d.Matrix[0][7] != 55.34 {
		t.Errorf("host_to_device_memcpy_ce = %+v", h2d)
	}
	if h2d.Description != "memcpy CE CPU(row) -> GPU(column) bandwidth (GB/s)" {
		t.Errorf("description %q", h2d.Description)
	}
	d2d := byName["device_to_device_memcpy_read_ce"]
	if len(d2d.Matrix) != 8 || len(d2d.Cells()) != 56 || !math.IsNaN(d2d.Matrix[3][3]) {
		t.Errorf("device_to_device_memcpy_read_ce: %d rows, %d cells", len(d2d.Matrix), len(d2d.Cells()))
	}
	for _, tc := range h800.Testcases {
		if tc.Sum == nil {
			t.Errorf("%s: no SUM", tc.Name)
		}
	}

	t4 := parseNVBFile(t, filepath.Join(dir, "nvbandwidth_t4x4_v0.8_ce_sm.txt"))
	if t4.Version != "v0.8" || len(t4.Testcases) != 10 {
		t.Fatalf("t4: version %q, %d testcases", t4.Version, len(t4.Testcases))
	}
	last := t4.Testcases[9]
	if last.Name != "device_to_device_memcpy_read_sm" || last.Sum == nil || *last.Sum != 121.14 || last.Matrix[3][2] != 10.18 {
		t.Errorf("t4 last testcase %+v", last)
	}
}

func TestParseNVBandwidthFixtures(t *testing.T) {
	t.Run("truncated", func(t *testing.T) {
		run := parseNVBFile(t, "testdata/nvbandwidth/truncated.txt")
		if !run.Truncated || run.Aborted != "" || len(run.Testcases) != 2 {
			t.Fatalf("truncated=%v aborted=%q testcases=%d", run.Truncated, run.Aborted, len(run.Testcases))
		}
		d2h := run.Testcases[1]
		if d2h.Name != "device_to_host_memcpy_ce" || d2h.Sum != nil || len(d2h.Matrix) != 0 {
			t.Errorf("cut testcase %+v", d2h)
		}
		if _, ok := d2h.Value(); ok {
			t.Error("a testcase without SUM or cells has no value")
		}
	})
	t.Run("aborted", func(t *testing.T) {
		run := parseNVBFile(t, "testdata/nvbandwidth/aborted.txt")
		if !strings.HasPrefix(run.Aborted, "[CUDA_ERROR_ILLEGAL_ADDRESS]") || !run.Truncated {
			t.Fatalf("aborted=%q truncated=%v", run.Aborted, run.Truncated)
		}
	})
	t.Run("waived", func(t *testing.T) {
		run := parseNVBFile(t, "testdata/nvbandwidth/waived.txt")
		if len(run.Testcases) != 3 || run.Truncated {
			t.Fatalf("testcases=%d truncated=%v", len(run.Testcases), run.Truncated)
		}
		if w := run.Testcases[1]; !strings.HasPrefix(w.Status, "WAIVED") || w.Name != "device_to_device_memcpy_read_ce" {
			t.Errorf("waived testcase %+v", w)
		}
		if d := run.Testcases[2]; d.Sum == nil || *d.Sum != 56.11 {
			t.Errorf("testcase after the waived one: %+v", d)
		}
	})
	t.Run("malformed", func(t *testing.T) {
		data, _ := os.ReadFile("testdata/nvbandwidth/malformed.txt")
		_, err := ParseNVBandwidth("guest/nvbandwidth.txt", bytes.NewReader(data))
		if err == nil || !strings.Contains(err.Error(), "guest/nvbandwidth.txt:7:") {
			t.Fatalf("err = %v", err)
		}
	})
}

func TestParseNVBandwidthErrors(t *testing.T) {
	tests := []struct{ name, in, want string }{
		{"not nvbandwidth", "hello\n", "no nvbandwidth version line"},
		{"sum outside testcase", "nvbandwidth Version: v0.8\nSUM host_to_device_memcpy_ce 1.0\n", "f:2: SUM for host_to_device_memcpy_ce outside"},
		{"sum not a number", "Running a_ce.\nd\n 0\n 0 1.00\nSUM a_ce x\n", "f:5: SUM"},
		{"value not a number", "Running a_ce.\nd\n 0 1\n 0 1.00 zz\nSUM a_ce 1\n", "f:4: a_ce value"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseNVBandwidth("f", strings.NewReader(tc.in))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
}

func TestDetect(t *testing.T) {
	dir := realworldDir(t)
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		data, _ := os.ReadFile(filepath.Join(dir, e.Name()))
		want := KindNCCL
		if strings.HasPrefix(e.Name(), "nvbandwidth") {
			want = KindNVBandwidth
		}
		// the name must not be what decides for these: they all have a banner or header
		if got := Detect("x.txt", data); got != want {
			t.Errorf("%s: Detect = %v, want %v", e.Name(), got, want)
		}
	}
	if got := Detect("alltoall_perf.3.log", []byte("Segmentation fault\n")); got != KindNCCL {
		t.Errorf("named nccl file without banner: %v", got)
	}
	if got := Detect("notes.md", []byte("todo\n")); got != KindUnknown {
		t.Errorf("notes.md: %v", got)
	}
}
