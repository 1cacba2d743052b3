package metrics

import "encoding/base64"

// GroupURL is the Pushgateway URL of one node's group: job "passage", instance the
// node's name, base64url-encoded as the Pushgateway's API allows, so that any name
// (slashes, an empty one) makes a valid path. The boot PUTs the exposition there with
// netboot.Put, bounded as the envelope's publish is.
func GroupURL(gateway, instance string) string {
	enc := base64.RawURLEncoding.EncodeToString([]byte(instance))
	if enc == "" {
		enc = "=" // the API's spelling of an empty value
	}
	return gateway + "/metrics/job/passage/instance@base64/" + enc
}
