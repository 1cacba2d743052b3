package control_test

import (
	"encoding/base64"
	"encoding/json"
	"testing"

	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// unsignedEnvelope is a well-formed manifest envelope naming host, signed by no one: a
// record not enrolled takes it, as it takes anyone's.
func unsignedEnvelope(t *testing.T, host string) []byte {
	t.Helper()
	m := manifesttest.B300(1)
	m.Node.Hostname = host
	payload, err := manifest.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	env, err := json.Marshal(manifest.Envelope{PayloadType: manifest.PayloadType, Payload: base64.StdEncoding.EncodeToString(payload)})
	if err != nil {
		t.Fatal(err)
	}
	return env
}
