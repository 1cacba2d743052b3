package control

import (
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestVerdictRows: a table of records (the API server's answer to Verdicts, its cells
// as JSON decodes them) gives each record's verdict, generation and reason, found by
// column name in whatever order; a record without status has empty ones. A table
// without the columns, or with a cell of the wrong type, is an error naming it, and
// nothing is taken from it.
func TestVerdictRows(t *testing.T) {
	cols := func(names ...string) []metav1.TableColumnDefinition {
		var out []metav1.TableColumnDefinition
		for _, n := range names {
			out = append(out, metav1.TableColumnDefinition{Name: n})
		}
		return out
	}
	row := func(cells ...any) metav1.TableRow { return metav1.TableRow{Cells: cells} }
	good := &metav1.Table{ColumnDefinitions: cols("Name", "Node", "Generation", "Verdict", "Reason", "Age"),
		Rows: []metav1.TableRow{
			row("b300-a", "b300-a", float64(3), VerdictVerified, nil, "5m"),
			row("b300-b", "b300-b", float64(2), VerdictFailed, "generation 2: PCR 4: no", "5m"),
			row("b300-c", "b300-c", nil, nil, nil, "1m"),
		}}
	out := map[string]*Node{}
	if err := verdictRows(good, out); err != nil {
		t.Fatal(err)
	}
	if n := out["b300-a"]; n == nil || n.Status.Verdict != VerdictVerified || n.Status.Generation != 3 || n.Status.Reason != "" {
		t.Errorf("b300-a: %+v", n)
	}
	if n := out["b300-b"]; n == nil || n.Status.Verdict != VerdictFailed || n.Status.Generation != 2 || RuleFor(n, 2).Check != "PCR 4" {
		t.Errorf("b300-b: %+v", n)
	}
	if n := out["b300-c"]; n == nil || n.Status != (Node{}).Status {
		t.Errorf("b300-c: %+v", n)
	}
	// The columns in another order.
	moved := &metav1.Table{ColumnDefinitions: cols("Reason", "Verdict", "Generation", "Name"),
		Rows: []metav1.TableRow{row("why", VerdictFailed, float64(7), "b300-d")}}
	if err := verdictRows(moved, out); err != nil || out["b300-d"].Status.Generation != 7 || out["b300-d"].Status.Reason != "why" {
		t.Errorf("moved columns: %v %+v", err, out["b300-d"])
	}
	for _, c := range []struct {
		tab  *metav1.Table
		want string
	}{
		{&metav1.Table{ColumnDefinitions: cols("Name", "Node", "Age"), Rows: good.Rows}, "no column Generation"},
		{&metav1.Table{ColumnDefinitions: good.ColumnDefinitions, Rows: []metav1.TableRow{row("b300-e", "b300-e", "three", VerdictVerified, nil, "1m")}}, "record b300-e: table row"},
		{&metav1.Table{ColumnDefinitions: good.ColumnDefinitions, Rows: []metav1.TableRow{row("b300-e", "b300-e", 2.5, VerdictVerified, nil, "1m")}}, "record b300-e: table row"},
		{&metav1.Table{ColumnDefinitions: good.ColumnDefinitions, Rows: []metav1.TableRow{row("b300-e", "b300-e", nil, true, nil, "1m")}}, "record b300-e: table row"},
		{&metav1.Table{ColumnDefinitions: good.ColumnDefinitions, Rows: []metav1.TableRow{row(nil)}}, "table row 0: no name"},
		{&metav1.Table{ColumnDefinitions: good.ColumnDefinitions, Rows: []metav1.TableRow{row()}}, "table row 0: no name"},
	} {
		got := map[string]*Node{}
		err := verdictRows(c.tab, got)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: error %v, want one naming %q", c.tab.Rows, err, c.want)
		}
		if _, ok := got["b300-e"]; ok {
			t.Errorf("%v: a bad row was taken", c.tab.Rows)
		}
	}
}
