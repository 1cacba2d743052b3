package fabricmanager_test

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/passage-boot/passage/kube/fabricmanager"
)

// FuzzLedger: whatever the ledger file holds, New refuses it or gives entries in a
// known state with sorted modules; it never panics.
func FuzzLedger(f *testing.F) {
	f.Add([]byte(`{"version":1,"claims":{"uid-a":{"partition":4,"modules":[1,2],"state":"active"}}}`))
	f.Add([]byte(`{"version":1,"claims":{"uid-b":{"partition":5,"modules":[3,4],"state":"deactivating","last_error":"fm: deactivate partition 5: FM_ST_GENERIC_ERROR (-2)"}}}`))
	f.Add([]byte(`{"version":1,"claims":{}}`))
	f.Add([]byte(`{"version":1,"claims":{"":{"partition":4,"modules":[1],"state":"active"}}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, fabricmanager.LedgerFile), b, 0o644); err != nil {
			t.Fatal(err)
		}
		fb, err := fabricmanager.New(dir, fabricmanager.Options{})
		if err != nil {
			return
		}
		for c, e := range fb.Entries() {
			ok := e.State == fabricmanager.StateActivating || e.State == fabricmanager.StateActive || e.State == fabricmanager.StateDeactivating
			if c == "" || !ok || len(e.Modules) == 0 || !slices.IsSorted(e.Modules) {
				t.Fatalf("accepted claim %q: %+v", c, e)
			}
		}
	})
}
