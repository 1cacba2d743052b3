package attest

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"time"

	"github.com/passage-boot/passage/manifest"
)

// RecordWait bounds how long RecordSeen waits for a node record's lock.
const RecordWait = time.Minute

// RecordSeen records seen, what an accepted attestation showed (Result.Seen), in the
// node record at path. Verifications of one node may run at once, each having read the
// record before it verified: so the record is read again under an exclusive flock of
// path + ".lock" (polled within RecordWait: no thread sleeps in the kernel, and callers
// in one process, each with its own open, exclude each other as processes do), seen is
// held to what it now says (checkSeen: a generation older than the one recorded, or a
// reset count lower, is refused as the sequential verification would have refused it)
// and only then written, atomically. The record never goes back.
func RecordSeen(path string, seen Seen) error {
	lock, err := flockWithin(path+".lock", time.Now().Add(RecordWait))
	if err != nil {
		return fmt.Errorf("node record %s: lock: %w", path, err)
	}
	defer lock.Close()
	var rec NodeRecord
	if err := ReadJSON(path, NodeFormat, &rec); err != nil {
		return fmt.Errorf("node record: %w", err)
	}
	if rec.Seen == seen {
		return nil
	}
	if _, err := checkSeen(rec.Seen, seen.ResetCount, seen.Generation); err != nil {
		return err
	}
	rec.Seen = seen
	b, err := json.MarshalIndent(&rec, "", "  ")
	if err != nil {
		return err
	}
	return manifest.WriteAtomic(filepath.Dir(path), filepath.Base(path), append(b, '\n'))
}
