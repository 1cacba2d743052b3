package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/client-go/kubernetes/scheme"
)

// TestNotReady: with an API server it cannot reach, /healthz says ok and /readyz does
// not, naming the API server; the exchange's 503 carries a Retry-After.
func TestNotReady(t *testing.T) {
	dir := t.TempDir()
	cert, key := selfSigned(t, dir)
	kc := filepath.Join(dir, "kubeconfig")
	os.WriteFile(kc, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: x}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`), 0o600)
	ctx, cancel := context.WithCancel(context.Background())
	addrs := make(chan [2]string, 1)
	done := make(chan int, 1)
	var stderr bytes.Buffer
	go func() {
		done <- run(ctx, []string{"--tls-cert", cert, "--tls-key", key, "--ek-ca", cert, "--exchange-key", exchangeKey(t, dir), "--kubeconfig", kc,
			"--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--request-deadline", "2s"}, &stderr,
			func(a, m string) { addrs <- [2]string{a, m} })
	}()
	defer func() {
		cancel()
		if code := <-done; code != 0 {
			t.Errorf("exit %d: %s", code, stderr.String())
		}
	}()
	var a [2]string
	select {
	case a = <-addrs:
	case code := <-done:
		t.Fatalf("exited %d: %s", code, stderr.String())
	}
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + a[1] + path)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz with the API unreachable: %d %q, want 200", code, body)
	}
	if code, body := get("/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "api server") {
		t.Errorf("/readyz with the API unreachable: %d %q, want 503 naming the api server", code, body)
	}
	pool := x509.NewCertPool()
	b, _ := os.ReadFile(cert)
	pool.AppendCertsFromPEM(b)
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	// A nonce asks the API nothing; an attestation past every check made without it
	// reads its record, and gets its 503 within a boot's try.
	resp, err := hc.Get("https://" + a[0] + "/")
	if err != nil {
		t.Fatalf("nonce with the API unreachable: %v", err)
	}
	hexNonce, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	nonce, err := hex.DecodeString(strings.TrimSpace(string(hexNonce)))
	if resp.StatusCode != http.StatusOK || err != nil {
		t.Fatalf("nonce with the API unreachable: %s %q", resp.Status, hexNonce)
	}
	m := manifesttest.B300(1)
	payload, _ := manifest.Marshal(m)
	env, _ := json.Marshal(manifest.Envelope{PayloadType: manifest.PayloadType, Payload: base64.StdEncoding.EncodeToString(payload)})
	att, _ := json.Marshal(attest.Attestation{Format: attest.Format, Nonce: nonce, Envelope: env})
	resp, err = hc.Post("https://"+a[0]+"/", control.AttestationType, bytes.NewReader(att))
	if err != nil {
		t.Fatalf("attestation with the API unreachable: no answer within a boot's try: %v", err)
	}
	resp.Body.Close()
	if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); resp.StatusCode != http.StatusServiceUnavailable || err != nil || s < 1 {
		t.Errorf("attestation with the API unreachable: %s, Retry-After %q; want 503 with one", resp.Status, resp.Header.Get("Retry-After"))
	}
	if code, body := get("/metrics"); code != http.StatusOK || !strings.Contains(body, "passage_control_requests_in_flight_limit 16\n") {
		t.Errorf("/metrics: %d, want the default in-flight limit:\n%s", code, body)
	}
}

// TestDeploy: the Deployment bounds each replica's memory and says so to the Go
// runtime, probes readiness at /readyz and liveness at /healthz on the metrics port,
// and its Service carries the exchange alone (the metrics port is not reachable through
// it). Every flag it passes is one passage-control has.
func TestDeploy(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "deploy", "passage-control.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var dep *appsv1.Deployment
	var svc *corev1.Service
	for i, doc := range strings.Split(string(b), "\n---\n") {
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
		if err != nil {
			t.Fatalf("document %d: %v", i+1, err)
		}
		switch o := obj.(type) {
		case *appsv1.Deployment:
			dep = o
		case *corev1.Service:
			svc = o
		}
	}
	if dep == nil || svc == nil || len(dep.Spec.Template.Spec.Containers) != 1 {
		t.Fatalf("want one Deployment of one container and one Service: %v %v", dep, svc)
	}
	c := dep.Spec.Template.Spec.Containers[0]
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].TargetPort.String() != "https" {
		t.Errorf("Service ports %+v: want the exchange's (https) alone", svc.Spec.Ports)
	}
	limit, ok := c.Resources.Limits[corev1.ResourceMemory]
	if !ok {
		t.Fatalf("no memory limit: %+v", c.Resources)
	}
	var gomemlimit string
	for _, e := range c.Env {
		if e.Name == "GOMEMLIMIT" {
			gomemlimit = e.Value
		}
	}
	// GOMEMLIMIT's suffixes are the binary ones a Quantity takes without the "B".
	soft, err := resource.ParseQuantity(strings.TrimSuffix(gomemlimit, "B"))
	if err != nil || soft.Cmp(limit) >= 0 || soft.Value() < limit.Value()*3/4 {
		t.Errorf("GOMEMLIMIT %q (%v): want a little under the limit %s", gomemlimit, err, limit.String())
	}
	for _, p := range []struct {
		what string
		pr   *corev1.Probe
		path string
	}{{"readiness", c.ReadinessProbe, "/readyz"}, {"liveness", c.LivenessProbe, "/healthz"}} {
		if p.pr == nil || p.pr.HTTPGet == nil || p.pr.HTTPGet.Path != p.path || p.pr.HTTPGet.Port.String() != "metrics" {
			t.Errorf("%s probe %+v: want GET %s on the metrics port", p.what, p.pr, p.path)
		}
	}
	if dep.Spec.Template.Annotations["prometheus.io/port"] != "9090" {
		t.Errorf("pod annotations %v: want Prometheus pointed at the metrics port", dep.Spec.Template.Annotations)
	}
	// Every flag the Deployment passes parses: run refuses an unknown one with exit 2
	// naming it before it reads any file.
	for _, a := range c.Args {
		name, _, _ := strings.Cut(a, "=")
		var stderr bytes.Buffer
		run(context.Background(), []string{a, "--no-such-flag"}, &stderr, nil)
		if strings.Contains(stderr.String(), "provided but not defined: -"+strings.TrimLeft(name, "-")+"\n") {
			t.Errorf("the Deployment passes %s, which passage-control does not have", name)
		}
	}
}
