package perfcheck

import (
	"math"
	"strings"
	"testing"
)

// editNCCL returns a deep copy of side (runs and rows) with edit applied to every run of
// one collective; edit gets the round's index.
func editNCCL(side *Side, coll string, edit func(round int, r *NCCLRun)) *Side {
	out := scaleNCCL(side, "", 0, 1)
	for i, r := range out.NCCL[coll] {
		edit(i, r)
	}
	return out
}

// setBusBW sets the out-of-place busbw of the rows of one size.
func setBusBW(r *NCCLRun, size int64, v float64) {
	for i := range r.Rows {
		if r.Rows[i].Size == size {
			r.Rows[i].OutOfPlace.BusBW = v
		}
	}
}

// dropSize removes the rows of one size.
func dropSize(r *NCCLRun, size int64) {
	var rows []NCCLRow
	for _, row := range r.Rows {
		if row.Size != size {
			rows = append(rows, row)
		}
	}
	r.Rows = rows
}

// addSize appends a copy of the last row with another size and busbw.
func addSize(r *NCCLRun, size int64, busbw float64) {
	row := r.Rows[len(r.Rows)-1]
	row.Size, row.Line, row.OutOfPlace.BusBW = size, row.Line+1, busbw
	r.Rows = append(r.Rows, row)
}

// The verdict is held to each collective's largest message, so a guest must not pass by
// having nothing usable there: NaN, Inf or no row at the largest size on either side
// (in any round) fails, naming the collective and the size, instead of the comparison
// quietly moving to the next smaller size.
func TestCompareLargestMessageMustBeMeasured(t *testing.T) {
	host, guest := loadB300(t)
	const top = int64(8 << 30)
	const coll = "all_reduce"
	tests := []struct {
		name        string
		host, guest *Side
		want        []string // each must be in one fail finding on coll
	}{
		{"guest nan at the largest size in every round", host,
			editNCCL(guest, coll, func(_ int, r *NCCLRun) { setBusBW(r, top, math.NaN()) }),
			[]string{"8 GiB", "guest", "nan"}},
		{"guest inf at the largest size in one round", host,
			editNCCL(guest, coll, func(i int, r *NCCLRun) {
				if i == 1 {
					setBusBW(r, top, math.Inf(1))
				}
			}),
			[]string{"8 GiB", "guest/round2/all_reduce_perf.log", "+Inf"}},
		{"guest nan at the largest size in one round", host,
			editNCCL(guest, coll, func(i int, r *NCCLRun) {
				if i == 2 {
					setBusBW(r, top, math.NaN())
				}
			}),
			[]string{"8 GiB", "guest/round3/all_reduce_perf.log", "line "}},
		{"guest missing the host's largest size", host,
			editNCCL(guest, coll, func(_ int, r *NCCLRun) { dropSize(r, top) }),
			[]string{"8 GiB", "guest", "missing"}},
		{"one guest round without the largest size", host,
			editNCCL(guest, coll, func(i int, r *NCCLRun) {
				if i == 0 {
					dropSize(r, top)
				}
			}),
			[]string{"8 GiB", "guest/round1/all_reduce_perf.log", "no row"}},
		{"guest measured a larger size the host did not", host,
			editNCCL(guest, coll, func(_ int, r *NCCLRun) { addSize(r, 2*top, 900) }),
			[]string{"16 GiB", "host", "missing"}},
		{"host nan at the largest size", editNCCL(host, coll, func(_ int, r *NCCLRun) { setBusBW(r, top, math.NaN()) }),
			guest,
			[]string{"8 GiB", "host", "nan"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rep := CompareSides(tc.host, tc.guest, defaultOpts())
			if rep.Pass {
				t.Errorf("passed; findings %+v", rep.Findings)
			}
			var msgs []string
			for _, f := range findingsOf(rep, Fail) {
				if f.Subject == coll {
					msgs = append(msgs, f.Message)
				}
			}
			found := false
			for _, m := range msgs {
				ok := true
				for _, w := range tc.want {
					ok = ok && strings.Contains(m, w)
				}
				found = found || ok
			}
			if !found {
				t.Errorf("no %s fail finding with all of %q: %q", coll, tc.want, msgs)
			}
			// The summary's "largest message" must not quietly be a smaller one.
			c := collective(t, rep, coll)
			if c.Largest != nil && c.Largest.Size < top {
				t.Errorf("largest reported as %s", sizeString(c.Largest.Size))
			}
		})
	}
	// The untouched sides still pass: the failures above come from the edits.
	if rep := CompareSides(host, guest, defaultOpts()); !rep.Pass {
		t.Fatalf("unedited sides fail: %+v", findingsOf(rep, Fail))
	}
}
