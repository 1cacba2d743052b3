package manifest_test

import (
	"strings"
	"testing"

	. "github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

const fuzzKeyID = "SHA256:tAXFyTXI8xtDaujAEcwJslAYc9/6FKcUkd2Lw0xDhPo"

// FuzzParseEnrolment: whatever the bytes of an enrolment file, ParseEnrolment returns an
// error or an enrolment of this format, for this key, naming a node; and Check of a
// manifest never panics, accepting only the enrolled node.
func FuzzParseEnrolment(f *testing.F) {
	for _, s := range []string{
		`{"format":"passage-enrolment/1","key_id":"` + fuzzKeyID + `","node":{"dmi_uuid":"4c4c4544-0042-3810-8057-b3c04f4b4d32","dmi_serial":"S3R1AL-0042"}}`,
		`{"format":"passage-enrolment/1","key_id":"` + fuzzKeyID + `","node":{"dmi_uuid":"","dmi_serial":"x","hostname":"h"}}`,
		`{"format":"passage-enrolment/1","key_id":"` + fuzzKeyID + `","node":{"dmi_uuid":"a","dmi_uuid":"b"}}`,
		`{}`, `[]`, `null`,
	} {
		f.Add([]byte(s))
	}
	m := manifesttest.B300(1)
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := ParseEnrolment(b, fuzzKeyID)
		if err != nil {
			return
		}
		if e.Format != EnrolmentFormat || e.KeyID != fuzzKeyID || (e.Node.DMIUUID == "" && e.Node.DMISerial == "") {
			t.Fatalf("accepted %q as %+v", b, e)
		}
		if err := e.Check(m); err == nil {
			n := m.Node
			if (e.Node.DMIUUID != "" && !strings.EqualFold(e.Node.DMIUUID, n.DMIUUID)) || (e.Node.DMISerial != "" && e.Node.DMISerial != n.DMISerial) ||
				(e.Node.Hostname != "" && e.Node.Hostname != n.Hostname) {
				t.Fatalf("enrolment %+v accepted node %+v", e.Node, n)
			}
		}
	})
}
