// Package perfcheck compares nccl-tests and nvbandwidth results measured on a B300 host
// with the same measurements taken in a guest on that host (B300.md, step 4), and says
// whether the guest lost anything.
//
// # Directory layout
//
// Each side (host, guest) is one directory holding the raw stdout of the tools, as
// captured (a launcher prefix such as Open MPI's "[1,0]<stdout>:" is fine). Files are
// found recursively, in name order; hidden files and directories are skipped. Both of
// these layouts work, and may be mixed:
//
//	host/                                host/
//	  all_reduce_perf.1.txt                round1/all_reduce_perf.log
//	  all_reduce_perf.2.txt                round1/alltoall_perf.log
//	  all_reduce_perf.3.txt                round1/nvbandwidth.log
//	  alltoall_perf.1.txt                  round2/all_reduce_perf.log
//	  ...                                  ...
//	  nvbandwidth.1.txt
//
// A file is nvbandwidth output when it has the "nvbandwidth Version:" banner or a
// "Running <testcase>." line, and nccl-tests output when it has an nccl-tests banner or
// column header ("# nThread", "#  size  count ...", "# Avg bus bandwidth"). Failing both,
// a file named for nvbandwidth or for a collective is taken as that tool's (a run that
// died before printing anything still counts, and fails the verdict). Anything else is
// an error: a stray file in a result directory is a mistake worth hearing about.
//
// The collective comes from the file's own "# Collective test starting: X_perf" line
// (nccl-tests >= 2.14) or an echoed command line naming X_perf, else from the file name
// ("allreduce", "all-reduce" and "all_reduce" all count; "reduce_scatter" is not
// "reduce"). When the content and the name disagree, the file is refused. Every file of
// one collective is one round; nvbandwidth testcases repeated across files, or within a
// file holding several invocations, are rounds too.
//
// # What is compared
//
// Per collective and message size: the median busbw over the rounds (out-of-place by
// default, in-place on request), and delta = (guest - host) / host in percent. Rows with
// nan busbw are left out of the medians. The summary gives the worst delta at each
// collective's largest message, the worst over messages >= 8 MiB, and the small-message
// points (< 8 MiB) that lose more than a threshold: an "outlier" when neither
// neighbouring size repeats the loss, "repeated" when one does. Small messages never
// fail the verdict; they are reported. For nvbandwidth, each testcase's SUM is
// compared (the per-GPU mean when the guest sees a different number of GPUs), and the
// host_to_device / device_to_host memcpy testcases are judged.
//
// The largest message of a collective is the largest size either side measured. It is
// judged there or not at all: every round of both sides must have a row for it with a
// finite busbw. A nan or inf busbw, or a missing row, at that size fails the verdict,
// naming the file; the comparison never falls back to a smaller size, which would let a
// guest that broke at the largest message pass.
//
// The verdict fails on: a loss beyond a threshold; a largest message that cannot be
// judged; a collective or judged nvbandwidth testcase measured on one side only; an
// aborted run; nccl-tests reporting wrong elements or out-of-bounds values (the data
// was corrupt: no bandwidth counts then).
// A file cut short (no footer) is used for the rows it has, with a warning; if it stops
// before the largest message, that fails as above.
package perfcheck
