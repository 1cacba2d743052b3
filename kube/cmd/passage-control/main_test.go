package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/passage-boot/passage/kube/control"
)

func selfSigned(t *testing.T, dir string) (cert, key string) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test"}, IsCA: true, BasicConstraintsValid: true,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, k.Public(), k)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(k)
	cert, key = filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	os.WriteFile(cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600)
	os.WriteFile(key, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600)
	return cert, key
}

// exchangeKey writes a shared key of 32 random bytes into dir.
func exchangeKey(t *testing.T, dir string) string {
	t.Helper()
	k := make([]byte, 32)
	rand.Read(k)
	p := filepath.Join(dir, "exchange.key")
	if err := os.WriteFile(p, k, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestUsage: what it needs is refused by name, exit 2, before anything listens.
func TestUsage(t *testing.T) {
	dir := t.TempDir()
	cert, key := selfSigned(t, dir)
	empty := filepath.Join(dir, "empty.pem")
	os.WriteFile(empty, []byte("no certificate here\n"), 0o600)
	badIntake := filepath.Join(dir, "intake.txt")
	os.WriteFile(badIntake, []byte("md5:00\n"), 0o600)
	xk, short := exchangeKey(t, dir), filepath.Join(dir, "short.key")
	os.WriteFile(short, []byte("0123456789"), 0o600)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "--tls-cert, --tls-key, --ek-ca and --exchange-key are needed"},
		{[]string{"--tls-cert", cert, "--tls-key", key, "--ek-ca", cert}, "--exchange-key are needed"},
		{[]string{"--tls-cert", cert, "--tls-key", key, "--ek-ca", cert, "--exchange-key", short}, "--exchange-key: exchange key: 10 bytes, want at least 32"},
		{[]string{"--tls-cert", cert, "--tls-key", key, "--ek-ca", empty, "--exchange-key", xk}, "--ek-ca " + empty + ": no PEM CERTIFICATE"},
		{[]string{"--tls-cert", cert, "--tls-key", cert, "--ek-ca", cert, "--exchange-key", xk}, "--tls-cert/--tls-key"},
		{[]string{"--tls-cert", cert, "--tls-key", key, "--ek-ca", cert, "--exchange-key", xk, "--intake", badIntake}, "intake list line 1"},
		{[]string{"--tls-cert", cert, "--tls-key", key, "--ek-ca", cert, "--exchange-key", xk, "--nonce-ttl", "0s"}, "--nonce-ttl 0s: want at least 1s"},
		{[]string{"--tls-cert", cert, "--tls-key", key, "--ek-ca", cert, "--exchange-key", xk, "--nonce-ttl", "1ns"}, "--nonce-ttl 1ns: want at least 1s"},
		{[]string{"--tls-cert", cert, "--tls-key", key, "--ek-ca", cert, "--exchange-key", xk, "--kube-qps", "-1"}, "--kube-qps -1: want more than 0"},
	} {
		var stderr bytes.Buffer
		if code := run(context.Background(), tc.args, &stderr, nil); code != 2 || !strings.Contains(stderr.String(), tc.want) {
			t.Errorf("%v: exit %d, %q; want 2 naming %q", tc.args, code, stderr.String(), tc.want)
		}
	}
}

// TestServes: with an API server it cannot reach, it still serves https and /healthz, a
// nonce GET is answered (a nonce asks the API nothing), and it stops when told.
func TestServes(t *testing.T) {
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
			"--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"}, &stderr, func(a, m string) { addrs <- [2]string{a, m} })
	}()
	var a [2]string
	select {
	case a = <-addrs:
	case code := <-done:
		t.Fatalf("exited %d: %s", code, stderr.String())
	}
	resp, err := http.Get("http://" + a[1] + "/healthz")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("healthz: %v %v", err, resp)
	}
	resp.Body.Close()
	pool := x509.NewCertPool()
	b, _ := os.ReadFile(cert)
	pool.AppendCertsFromPEM(b)
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	resp, err = hc.Get("https://" + a[0] + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if n, err := hex.DecodeString(strings.TrimSpace(string(body))); resp.StatusCode != http.StatusOK || err != nil || len(n) != control.NonceSize {
		t.Fatalf("nonce with the API unreachable: %s %q", resp.Status, body)
	}
	cancel()
	select {
	case code := <-done:
		if code != 0 {
			t.Fatalf("exit %d: %s", code, stderr.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("did not stop")
	}
}
