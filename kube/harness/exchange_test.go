//go:build cluster

package harness_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/attest/softtpm"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/control/controltest"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/manifest/manifesttest"
)

// TestClusterExchange: the exchange at passage.url tried as an attacker would, on the
// real API server with two passage-control replicas (the deploy file's RBAC) and
// software TPMs booting through the boot's own exchange (netboot):
//   - strangers looping nonce GETs, envelopes, forged attestations and answers for the
//     booting nodes' hostnames and made-up ones, during the nodes' first boots and
//     reboots: every node enrols and verifies, nothing the strangers sent is an object
//     in the API, and the API writes are the boots' own, counted by the API server (at
//     most 4 a first boot, 2 a reboot);
//   - one TPM's two activation answers, for two hostnames, at the two replicas at once:
//     one record, the other refused; the same answer at both: one record;
//   - a flipped bit in the passage event log or the firmware's (an on-path box on plain
//     http): refused, the verdict and its rule as they were;
//   - a hostname whose rule name would overflow: 400, nothing written;
//   - the API server stopped (SIGSTOP) for 12 s in the middle of 20 first boots: 503s
//     with Retry-After, and every node verified when it returns;
//   - a newline in the request path: never a line of the replica's log.
func TestClusterExchange(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	work, ctlBin, c, ctlConfig := controlCluster(t, ctx)
	ca, err := softtpm.NewCA()
	if err != nil {
		t.Fatal(err)
	}
	pool := replicaFiles(t, work, ca.PEM())
	replicas := []*replica{startReplica(t, ctx, ctlBin, ctlConfig, work, 1), startReplica(t, ctx, ctlBin, ctlConfig, work, 2)}
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	raw, err := os.ReadFile(fixtures + "ovmf-secureboot.log")
	if err != nil {
		t.Fatal(err)
	}
	fw, err := softtpm.NewFirmware(raw)
	if err != nil {
		t.Fatal(err)
	}
	admin, err := rest.HTTPClientFor(restConfig(t, c))
	if err != nil {
		t.Fatal(err)
	}
	dyn := dynamic.NewForConfigOrDie(restConfig(t, c))
	objects := func() (records, eks, rules int) {
		t.Helper()
		l, err := dyn.Resource(control.NodeResource).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		e, err := dyn.Resource(control.EKResource).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		r, err := c.Client.ResourceV1().DeviceTaintRules().List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return len(l.Items), len(e.Items), len(r.Items)
	}
	writes := func(reqs requests) (n float64, by map[string]float64) {
		by = map[string]float64{}
		for k, v := range reqs {
			if k[0] == "total" && writeVerbs[k[1]] && ours(k[2]) {
				n += v
				by[k[1]+" "+k[2]] += v
			}
		}
		return n, by
	}

	// 1. Strangers during first boots and reboots.
	const nodes = 10
	soft := make([]*controltest.SoftNode, nodes)
	for i := range soft {
		ek, err := softtpm.GenerateEK()
		if err != nil {
			t.Fatal(err)
		}
		if soft[i], err = controltest.NewSoftNode(ctx, ca, ek, fw, fmt.Sprintf("b300-%02d", i), 1); err != nil {
			t.Fatal(err)
		}
	}
	var strangerRequests, strangerAccepted atomic.Int64
	stop := make(chan struct{})
	var strangers sync.WaitGroup
	for w := range 4 {
		strangers.Go(func() {
			shc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				u := replicas[(w+i)%2].url
				host := fmt.Sprintf("b300-%02d", i%nodes)
				if i%3 == 0 {
					host = fmt.Sprintf("made-up-%d-%d", w, i)
				}
				nonce := fetch(shc, u)
				forged, _ := json.Marshal(attest.Attestation{Format: attest.Format, Nonce: nonce, EKCert: []byte{0x30, 1, 0},
					EKPublic: []byte{1}, Envelope: unsigned(t, host)})
				answer, _ := json.Marshal(control.AnswerBody{Format: control.AnswerFormat, Record: host, AKName: "00",
					Answer: base64.StdEncoding.EncodeToString(make([]byte, 32)), State: make([]byte, 64)})
				for _, p := range []struct {
					ct   string
					body []byte
				}{{control.EnvelopeType, unsigned(t, host)}, {control.AttestationType, forged}, {control.ActivationType, answer}} {
					code, _, err := controltest.Post(ctx, shc, u, p.ct, p.body)
					strangerRequests.Add(1)
					if err == nil && code/100 == 2 && p.ct != control.EnvelopeType {
						strangerAccepted.Add(1)
					}
				}
			}
		})
	}
	reqs0 := apiRequests(t, ctx, admin, c.Server)
	boot := func(round string) {
		t.Helper()
		errs := make([]error, nodes)
		var wg sync.WaitGroup
		for i, n := range soft {
			wg.Go(func() { _, errs[i] = n.Boot(ctx, hc, replicas[i%2].url, netboot.DefaultPublish) })
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Fatalf("%s, node %d among the strangers: %v", round, i, err)
			}
		}
	}
	boot("first boot")
	reqs1 := apiRequests(t, ctx, admin, c.Server)
	for i, n := range soft {
		if err := n.Reboot(ctx, fw, n.Hostname, 2); err != nil {
			t.Fatalf("node %d: %v", i, err)
		}
	}
	boot("reboot")
	reqs2 := apiRequests(t, ctx, admin, c.Server)
	close(stop)
	strangers.Wait()
	first, firstBy := writes(reqs1.minus(reqs0))
	again, againBy := writes(reqs2.minus(reqs1))
	t.Logf("%d stranger requests during %d first boots and reboots; API writes: first boots %.0f (%v), reboots %.0f (%v)",
		strangerRequests.Load(), nodes, first, firstBy, again, againBy)
	if strangerRequests.Load() < 3*nodes {
		t.Fatalf("only %d stranger requests: the flood did not run", strangerRequests.Load())
	}
	if strangerAccepted.Load() != 0 {
		t.Fatalf("%d stranger attestations or answers accepted", strangerAccepted.Load())
	}
	if first > 4*nodes || again > 2*nodes {
		t.Fatalf("API writes: %.0f for %d first boots (want at most %d), %.0f for their reboots (want at most %d)", first, nodes, 4*nodes, again, 2*nodes)
	}
	if records, eks, rules := objects(); records != nodes || eks != nodes || rules != 0 {
		t.Fatalf("after the flood: %d records, %d EK claims, %d rules; want %d, %d, 0", records, eks, rules, nodes, nodes)
	}
	for _, n := range soft {
		u, err := dyn.Resource(control.NodeResource).Get(ctx, n.Hostname, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if st, _ := u.Object["status"].(map[string]any); st["verdict"] != control.VerdictVerified || fmt.Sprint(st["generation"]) != "2" {
			t.Fatalf("record %s: %v", n.Hostname, st)
		}
	}

	// 2. One TPM, two hostnames, two answers at once: one record. Then one answer at
	// both replicas at once: both succeed, one record.
	for round := range 5 {
		ek, err := softtpm.GenerateEK()
		if err != nil {
			t.Fatal(err)
		}
		a, b := fmt.Sprintf("twin-%d-a", round), fmt.Sprintf("twin-%d-b", round)
		twin, err := controltest.NewSoftNode(ctx, ca, ek, fw, a, 1)
		if err != nil {
			t.Fatal(err)
		}
		chA := challenge(t, ctx, hc, replicas[0].url, twin)
		if err := twin.Sign(ctx, b, 2); err != nil {
			t.Fatal(err)
		}
		chB := challenge(t, ctx, hc, replicas[1].url, twin)
		answers := [][]byte{answerFor(t, twin, chA), answerFor(t, twin, chB)}
		codes := race(ctx, hc, []string{replicas[0].url, replicas[1].url}, answers)
		made := 0
		for _, name := range []string{a, b} {
			if _, err := dyn.Resource(control.NodeResource).Get(ctx, name, metav1.GetOptions{}); err == nil {
				made++
			}
		}
		ok := 0
		for _, code := range codes {
			if code == http.StatusNoContent {
				ok++
			}
		}
		if made != 1 || ok != 1 {
			t.Fatalf("round %d: one TPM's answers for %s and %s at once: %v, %d records; want one 204 and one record", round, a, b, codes, made)
		}
		// The same answer at both replicas at once.
		ek2, _ := softtpm.GenerateEK()
		same, err := controltest.NewSoftNode(ctx, ca, ek2, fw, fmt.Sprintf("same-%d", round), 1)
		if err != nil {
			t.Fatal(err)
		}
		ans := answerFor(t, same, challenge(t, ctx, hc, replicas[0].url, same))
		if codes := race(ctx, hc, []string{replicas[0].url, replicas[1].url}, [][]byte{ans, ans}); codes[0] != http.StatusNoContent || codes[1] != http.StatusNoContent {
			t.Fatalf("round %d: one answer at both replicas: %v, want 204 twice", round, codes)
		}
	}
	records, eks, _ := objects()
	if records != nodes+10 || eks != nodes+10 {
		t.Fatalf("after the twins: %d records, %d EK claims; want %d of each", records, eks, nodes+10)
	}

	// 3. A flipped bit in either event log: refused, nothing changed; the genuine
	// attestation after it is verified.
	n := soft[0]
	if err := n.Reboot(ctx, fw, n.Hostname, 3); err != nil {
		t.Fatal(err)
	}
	ap, err := attest.ReadApproved(fixtures + "ovmf-secureboot.approved.json")
	if err != nil {
		t.Fatal(err)
	}
	before, err := dyn.Resource(control.NodeResource).Get(ctx, n.Hostname, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, which := range []string{"passage", "firmware"} {
		a, err := n.Attestation(fetch(hc, replicas[0].url))
		if err != nil {
			t.Fatal(err)
		}
		// The node's own logs stay as they are: the box changes its copy in flight.
		a.PassageLog, a.FirmwareLog = bytes.Clone(a.PassageLog), bytes.Clone(a.FirmwareLog)
		if which == "passage" {
			a.PassageLog[len(a.PassageLog)/2] ^= 1
		} else {
			// A bit of the approved image's digest as the log records it: the log no
			// longer replays into the quoted PCR 4.
			i := bytes.Index(a.FirmwareLog, ap.Authenticode[0])
			if i < 0 {
				t.Fatal("the approved image's digest is not in the firmware log")
			}
			a.FirmwareLog[i] ^= 1
		}
		body, _ := a.Marshal()
		code, reason, err := controltest.Post(ctx, hc, replicas[1].url, control.AttestationType, body)
		if err != nil || code != http.StatusForbidden || !strings.Contains(reason, "nothing changed") {
			t.Fatalf("a flipped bit in the %s log: %v %d %s", which, err, code, reason)
		}
		after, err := dyn.Resource(control.NodeResource).Get(ctx, n.Hostname, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if after.GetResourceVersion() != before.GetResourceVersion() {
			t.Fatalf("a flipped bit in the %s log wrote the record: %v", which, after.Object["status"])
		}
		if _, _, rules := objects(); rules != 0 {
			t.Fatalf("a flipped bit in the %s log made a rule", which)
		}
		t.Logf("flipped bit in the %s log: %d %s", which, code, strings.TrimSpace(reason))
	}
	if _, err := n.Boot(ctx, hc, replicas[0].url, netboot.DefaultPublish); err != nil {
		t.Fatalf("the genuine attestation after the flipped bits: %v", err)
	}

	// 4. A hostname too long for its rule's name: 400, nothing written.
	long := strings.Repeat("a", 63) + "." + strings.Repeat("b", 63) + "." + strings.Repeat("c", 63) + "." + strings.Repeat("d", 55)
	ek, _ := softtpm.GenerateEK()
	ln, err := controltest.NewSoftNode(ctx, ca, ek, fw, long, 1)
	if err != nil {
		t.Fatal(err)
	}
	a, err := ln.Attestation(fetch(hc, replicas[0].url))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := a.Marshal()
	if code, reason, err := controltest.Post(ctx, hc, replicas[0].url, control.AttestationType, body); err != nil || code != http.StatusBadRequest || !strings.Contains(reason, "at most 245") {
		t.Fatalf("a hostname of %d characters: %v %d %s", len(long), err, code, reason)
	}
	if r, e, _ := objects(); r != records || e != eks {
		t.Fatalf("the long hostname wrote: %d records, %d EK claims", r, e)
	}

	// 5. The API server stopped (SIGSTOP) in the middle of a storm of first boots: the
	// replicas answer 503 with Retry-After within a boot's try, the boots wait as told
	// (passage.publish_for's policy), and when it returns every node is verified.
	storm := make([]*controltest.SoftNode, 20)
	for i := range storm {
		ek, err := softtpm.GenerateEK()
		if err != nil {
			t.Fatal(err)
		}
		if storm[i], err = controltest.NewSoftNode(ctx, ca, ek, fw, fmt.Sprintf("storm-%02d", i), 1); err != nil {
			t.Fatal(err)
		}
	}
	policy := netboot.DefaultPublish
	policy.For, policy.MaxBackoff = 2*time.Minute, 30*time.Second
	stormErrs := make([]error, len(storm))
	stormTimes := make([]*controltest.BootTimes, len(storm))
	var wg sync.WaitGroup
	for i, n := range storm {
		wg.Go(func() {
			shc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
			stormTimes[i], stormErrs[i] = n.Boot(ctx, shc, replicas[i%2].url, policy)
		})
	}
	apiPID := c.PIDs()["kube-apiserver"]
	time.Sleep(200 * time.Millisecond)
	if err := syscall.Kill(apiPID, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	time.Sleep(12 * time.Second)
	syscall.Kill(apiPID, syscall.SIGCONT)
	wg.Wait()
	shed := 0
	for i, err := range stormErrs {
		if err != nil {
			t.Fatalf("storm node %d across the API server's stop: %v", i, err)
		}
		shed += stormTimes[i].Shed
	}
	if shed == 0 {
		t.Fatalf("no 503 answered while the API server was stopped for 12 s")
	}
	for _, n := range storm {
		u, err := dyn.Resource(control.NodeResource).Get(ctx, n.Hostname, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if st, _ := u.Object["status"].(map[string]any); st["verdict"] != control.VerdictVerified {
			t.Fatalf("record %s after the API server returned: %v", n.Hostname, st)
		}
	}
	t.Logf("API server stopped 12 s (from %s) under %d first boots: %d answers 503 with Retry-After, every node verified when it returned",
		stopped.Format("15:04:05"), len(storm), shed)

	// 6. A newline in the request path reaches no log line raw.
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, replicas[0].url+"%0aFORGED-LINE", bytes.NewReader(nil))
	req.Header.Set("Content-Type", "text/plain")
	if resp, err := hc.Do(req); err == nil {
		resp.Body.Close()
	}
	time.Sleep(200 * time.Millisecond)
	logged, err := os.ReadFile(replicas[0].log)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(logged), "\n") {
		if strings.HasPrefix(line, "FORGED-LINE") {
			t.Fatalf("the request path forged a log line: %q", line)
		}
	}
	if !strings.Contains(string(logged), `FORGED-LINE`) {
		t.Fatalf("the refused request is not in the log at all")
	}
}

// fetch is a nonce from url (nil if none came: a stranger goes on regardless).
func fetch(hc *http.Client, url string) []byte {
	resp, err := hc.Get(url)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	b.ReadFrom(resp.Body)
	n, _ := hex.DecodeString(strings.TrimSpace(b.String()))
	return n
}

// unsigned is a well-formed manifest envelope naming host, signed by no one.
func unsigned(t testing.TB, host string) []byte {
	m := manifesttest.B300(1)
	m.Node.Hostname = host
	payload, err := manifest.Marshal(m)
	if err != nil {
		t.Error(err)
		return nil
	}
	env, _ := json.Marshal(manifest.Envelope{PayloadType: manifest.PayloadType, Payload: base64.StdEncoding.EncodeToString(payload)})
	return env
}

// challenge POSTs n's attestation over a fresh nonce to url and returns the 428's body.
func challenge(t *testing.T, ctx context.Context, hc *http.Client, url string, n *controltest.SoftNode) *control.ChallengeBody {
	t.Helper()
	a, err := n.Attestation(getNonceFrom(t, hc, url))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := a.Marshal()
	code, reason, err := controltest.Post(ctx, hc, url, control.AttestationType, body)
	if err != nil || code != http.StatusPreconditionRequired {
		t.Fatalf("%s's attestation: %v %d %s, want 428", n.Hostname, err, code, reason)
	}
	var ch control.ChallengeBody
	if err := json.Unmarshal([]byte(reason), &ch); err != nil {
		t.Fatal(err)
	}
	return &ch
}

// answerFor is n's activation answer to ch.
func answerFor(t *testing.T, n *controltest.SoftNode, ch *control.ChallengeBody) []byte {
	t.Helper()
	secret, ak, err := n.Answer(ch.Challenge)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(control.AnswerBody{Format: control.AnswerFormat, Record: ch.Record, AKName: hex.EncodeToString(ak),
		Answer: base64.StdEncoding.EncodeToString(secret), State: ch.State})
	return b
}

// race POSTs bodies[i] to urls[i] at the same instant and returns the statuses.
func race(ctx context.Context, hc *http.Client, urls []string, bodies [][]byte) []int {
	codes := make([]int, len(urls))
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range urls {
		wg.Go(func() {
			<-start
			codes[i], _, _ = controltest.Post(ctx, hc, urls[i], control.ActivationType, bodies[i])
		})
	}
	close(start)
	wg.Wait()
	return codes
}
