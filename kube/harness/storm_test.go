//go:build cluster

package harness_test

import (
	"bufio"
	"cmp"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/passage-boot/passage/attest/softtpm"
	kubeletkey "github.com/passage-boot/passage/initramfs/kubelet"
	"github.com/passage-boot/passage/initramfs/netboot"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/kube/control/controltest"
	"github.com/passage-boot/passage/kube/harness"
)

// BenchmarkBootStorm: N nodes booting for the first time at once, each enrolling its TPM
// and attesting its boot, against two passage-control replicas (processes) on the real
// control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager). Each
// node runs the boot's own exchange (netboot, as stages/boot's publish stage: envelope,
// nonce, attestation, 428, activation, attestation) over its own TLS connection to one
// replica (half the nodes to each, as a Service balances connections), with the boot's
// retry policy. The nodes' TPMs are done in software (attest/softtpm: EK certificates
// under a test CA, quotes and certifications signed with keys in memory, credential
// activation in software), which the replicas verify exactly as they verify a TPM's.
//
// It prints a table: nodes verified, wall time, nodes/s, p50/p99 from a node's first
// request to its verdict, API writes and reads per node (the API server's own
// apiserver_request_total, before and after), each phase's mean and p99, and the CPU
// seconds of each process. A timing is reported, never judged; what is judged is that
// every node the load generator saw verified has a verified record in the API.
//
// PASSAGE_STORM_JOIN=1: each node's manifest carries its kubelet key, and once its
// attestation is accepted the node's kubelet joins as its TLS bootstrap does (a request
// for that key with a bootstrap token, the wait for its certificate: joinKubelet), on a
// control plane started with harness.Options{Signing: true}; each round then also
// prints the certificates issued, verdict-to-certificate p50/p99, the approvals and
// passage-control's API writes per node with them.
//
// PASSAGE_STORM_NODES: the sizes, comma-separated (default 500). PASSAGE_STORM_QPS:
// the replicas' --kube-qps (default theirs). PASSAGE_STORM_FOR: the seconds a node keeps
// trying (default 600, as passage.publish_for=10m; 0: the boot's five tries). PASSAGE_STORM_TRIES: the tries per
// request (default the boot's, netboot.DefaultPublish). PASSAGE_STORM_INFLIGHT: at most
// this many nodes booting at once (default: all). PASSAGE_STORM_EK_CACHE: the file the
// RSA-2048 EK keys are kept in between runs (default in the user's cache directory):
// making one takes tens of milliseconds of CPU, and they are test keys.
//
//	PASSAGE_CONTROL_PLANE=... go test -tags cluster -run '^$' -bench BootStorm -benchtime 1x -timeout 60m ./cluster/
func BenchmarkBootStorm(b *testing.B) {
	sizes := []int{500}
	if s := os.Getenv("PASSAGE_STORM_NODES"); s != "" {
		sizes = nil
		for _, f := range strings.Split(s, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 1 {
				b.Fatalf("PASSAGE_STORM_NODES %q: want sizes like 500,2000", s)
			}
			sizes = append(sizes, n)
		}
	}
	for _, n := range sizes {
		b.Run(fmt.Sprintf("nodes=%d", n), func(b *testing.B) { storm(b, n) })
	}
}

func envInt(b *testing.B, name string, def int) int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 {
		b.Fatalf("%s %q: want a number", name, s)
	}
	return n
}

func storm(b *testing.B, n int) {
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Minute)
	defer cancel()
	work := b.TempDir()
	ctlBin := goBuild(b, work, "passage-control")
	join := os.Getenv("PASSAGE_STORM_JOIN") != ""
	var c *harness.Cluster
	if join {
		c = startSigningCluster(b, ctx, work)
	} else {
		c = startCluster(b, ctx, work)
	}
	applyCRDs(b, ctx, c)
	ctlConfig := filepath.Join(work, "passage-control.kubeconfig")
	deployControlRBAC(b, ctx, c, ctlConfig)

	ca, err := softtpm.NewCA()
	if err != nil {
		b.Fatal(err)
	}
	pool := replicaFiles(b, work, ca.PEM())
	var extra []string
	if q := os.Getenv("PASSAGE_STORM_QPS"); q != "" {
		extra = append(extra, "--kube-qps", q)
	}
	replicas := []*replica{startReplica(b, ctx, ctlBin, ctlConfig, work, 1, extra...), startReplica(b, ctx, ctlBin, ctlConfig, work, 2, extra...)}

	raw, err := os.ReadFile(fixtures + "ovmf-secureboot.log")
	if err != nil {
		b.Fatal(err)
	}
	fw, err := softtpm.NewFirmware(raw)
	if err != nil {
		b.Fatal(err)
	}
	setup := time.Now()
	eks, ekNote := stormEKs(b, n)
	nodes := make([]*controltest.SoftNode, n)
	parallel(n, func(i int) error {
		var err error
		nodes[i], err = controltest.NewSoftNode(ctx, ca, eks[i], fw, fmt.Sprintf("storm-%05d", i), 1)
		return err
	}, b)
	b.Logf("%d nodes manufactured and booted in %s (%s)", n, time.Since(setup).Round(time.Millisecond), ekNote)
	// The kubelets' keys (one a boot) and their bootstrap clients: 64 connections to the
	// API server (a client of its own dialer is a transport of its own), each carrying the
	// requests and certificate watches of its share of the nodes.
	keys := make([]*ecdsa.PrivateKey, n)
	var bootstrap []kubernetes.Interface
	newKeys := func(gen uint64) {
		parallel(n, func(i int) error {
			k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
			if err != nil {
				return err
			}
			keys[i] = k
			nodes[i].KubeletKey, err = kubeletkey.Digest(k.Public())
			if err != nil || gen > 1 {
				return err
			}
			return nodes[i].Sign(ctx, nodes[i].Hostname, gen)
		}, b)
	}
	if join {
		newKeys(1)
		for range 64 {
			cfg := c.TokenConfig(c.BootstrapToken)
			cfg.QPS, cfg.Burst = -1, 0
			cfg.Dial = (&net.Dialer{}).DialContext
			bootstrap = append(bootstrap, kubernetes.NewForConfigOrDie(cfg))
		}
	}

	// The boot's policy with passage.publish_for=10m (stages/boot: the time budget, a
	// 503's Retry-After waited with jitter, backoff up to 30 s), as an operator expecting
	// a storm sets it; PASSAGE_STORM_FOR=0 is the boot's default of five tries.
	policy := netboot.DefaultPublish
	if f := envInt(b, "PASSAGE_STORM_FOR", 600); f > 0 {
		policy.For, policy.MaxBackoff = time.Duration(f)*time.Second, 30*time.Second
	}
	if t := envInt(b, "PASSAGE_STORM_TRIES", 0); t > 0 {
		policy.Tries = t
	}
	inflight := envInt(b, "PASSAGE_STORM_INFLIGHT", 0)
	if inflight == 0 {
		inflight = n
	}
	admin, err := rest.HTTPClientFor(restConfig(b, c))
	if err != nil {
		b.Fatal(err)
	}
	pids := c.PIDs()
	for i, r := range replicas {
		pids[fmt.Sprintf("passage-control-%d", i+1)] = r.cmd.Process.Pid
	}
	pids["loadgen (this test)"] = os.Getpid()

	// One storm, whatever b.N: a second of the same nodes would be their second boot, not
	// this benchmark (-benchtime 1x; a storm outlasts the default benchtime anyway). It is
	// the nodes' first boots at once, then their reboots at once, then the floor: what this
	// API server and etcd sustain for the writes a boot makes, measured in the same run.
	b.ResetTimer()
	var tables []string
	var rounds []report
	for _, round := range []string{"first boot", "reboot"} {
		if round == "reboot" {
			if join {
				newKeys(2)
			}
			parallel(n, func(i int) error { return nodes[i].Reboot(ctx, fw, nodes[i].Hostname, 2) }, b)
		}
		joined := make([]time.Duration, n)
		joinErrs := make([]error, n)
		reqs0 := apiRequests(b, ctx, admin, c.Server)
		cpu0 := cpuSeconds(pids)
		times := make([]*controltest.BootTimes, n)
		errs := make([]error, n)
		sem := make(chan struct{}, inflight)
		var wg sync.WaitGroup
		start := time.Now()
		for i, sn := range nodes {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				// Each node its own connection, to one replica: a Service balances
				// connections, not requests.
				// One connection a node at a time (MaxConnsPerHost), closed once the
				// boot is done, before the join. The nodes share this process and its
				// 20,000 descriptors, which this machine does not let it raise. Without
				// the cap it held 17,600 sockets for 10,000 nodes (7 Dec): while a
				// replica's listen queue is full, a try that gives up leaves its dial's
				// SYNs retrying (net/http does not cancel a dial another request may
				// use) and the next try dials again. The boot's own client
				// (http.DefaultClient) has no such cap: this load is one SYN a node
				// lighter than a fleet's.
				hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, MaxConnsPerHost: 1}}
				times[i], errs[i] = sn.Boot(ctx, hc, replicas[i%len(replicas)].url, policy)
				hc.CloseIdleConnections()
				if join && errs[i] == nil {
					start := time.Now()
					_, _, joinErrs[i] = joinKubelet(ctx, bootstrap[i%len(bootstrap)], keys[i], sn.Hostname, 10*time.Minute)
					joined[i] = time.Since(start)
				}
			})
		}
		wg.Wait()
		wall := time.Since(start)
		cpu1 := cpuSeconds(pids)
		reqs1 := apiRequests(b, ctx, admin, c.Server)
		gen := int64(1)
		if round == "reboot" {
			gen = 2
		}
		inAPI := verifiedRecords(b, ctx, c, gen)
		// Every node that saw its attestation accepted has a verified record of this
		// generation; a node whose last try timed out after the replica had verified it
		// has one too, though it gave up.
		var missing []string
		gaveUp := 0
		for i, sn := range nodes {
			switch {
			case errs[i] == nil && !inAPI[sn.Hostname]:
				missing = append(missing, sn.Hostname)
			case errs[i] != nil && inAPI[sn.Hostname]:
				gaveUp++
			}
		}
		r := stormReport(round, n, inflight, policy, wall, times, errs, reqs1.minus(reqs0), cpu0, cpu1, len(inAPI), gaveUp)
		if join {
			r.table += joinReport(round, reqs1.minus(reqs0), r, joined, joinErrs, errs)
		}
		tables = append(tables, r.table)
		rounds = append(rounds, r)
		fmt.Print(r.table)
		b.ReportMetric(r.nodesPerSec, strings.ReplaceAll(round, " ", "-")+"-nodes/s")
		b.ReportMetric(r.writesPerNode, strings.ReplaceAll(round, " ", "-")+"-writes/node")
		if len(missing) > 0 {
			b.Errorf("%s: %d nodes saw their attestation accepted and have no verified record: %v", round, len(missing), missing[:min(len(missing), 10)])
		}
	}
	b.StopTimer()
	fl := measureFloor(b, ctx, c, 32, 15*time.Second)
	var sb strings.Builder
	fmt.Fprintf(&sb, "\nthe floor, in the same run (32 clients, %s each, objects of a record's size, %d bytes):\n", 15*time.Second, fl.size)
	fmt.Fprintf(&sb, "| API server and etcd alone | per second |\n|---|---|\n| creates | %.0f |\n| status read-modify-writes | %.0f |\n", fl.creates, fl.updates)
	fmt.Fprintf(&sb, "\n| storm | API writes/s | the floor's writes/s (creates for first boots, status writes for reboots) | ratio |\n|---|---|---|---|\n")
	for i, r := range rounds {
		floor := fl.creates
		if i == 1 {
			floor = fl.updates
		}
		fmt.Fprintf(&sb, "| %s | %.0f | %.0f | %.2f |\n", r.round, r.writesPerSec, floor, r.writesPerSec/floor)
	}
	tables = append(tables, sb.String())
	fmt.Print(sb.String())
	if out := os.Getenv("PASSAGE_STORM_OUT"); out != "" {
		f, err := os.OpenFile(out, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
		if err == nil {
			fmt.Fprint(f, strings.Join(tables, ""))
			f.Close()
		}
	}
}

// joinReport is a round's kubelet joins: the certificates issued to the nodes verified,
// their time from the verdict to the certificate, the approvals the API server saw, and
// passage-control's API writes per node with them.
func joinReport(round string, reqs requests, r report, joined []time.Duration, joinErrs, bootErrs []error) string {
	var ok []time.Duration
	failures := map[string]int{}
	for i, err := range joinErrs {
		switch {
		case bootErrs[i] != nil:
		case err != nil:
			failures[nodeRE.ReplaceAllString(err.Error(), "storm-N")]++
		default:
			ok = append(ok, joined[i])
		}
	}
	approvals := reqs[[3]string{"total", "PUT", "certificatesigningrequests/approval"}]
	per := func(x float64) float64 { return x / float64(max(r.verified, 1)) }
	var sb strings.Builder
	fmt.Fprintf(&sb, "kubelet join, %s: %d certificates issued to %d nodes verified; verdict to certificate p50 %s, p99 %s; approvals %.0f (%.2f/node); passage-control's API writes/node with the approval: %.2f\n",
		round, len(ok), r.verified, quantile(ok, 0.50).Round(time.Millisecond), quantile(ok, 0.99).Round(time.Millisecond), approvals, per(approvals), r.writesPerNode+per(approvals))
	for msg, k := range failures {
		fmt.Fprintf(&sb, "  %d joins failed: %s\n", k, msg)
	}
	return sb.String()
}

// floor is what the API server and etcd sustain with no passage in the way.
type floor struct {
	size             int
	creates, updates float64
}

// measureFloor creates PassageNodes the size of an enrolled record from clients
// goroutines for d, then read-modify-writes their status for d, and says how many of
// each the API server did a second.
func measureFloor(b *testing.B, ctx context.Context, c *harness.Cluster, clients int, d time.Duration) floor {
	rc := restConfig(b, c)
	rc.QPS, rc.Burst = -1, 0 // no client-side limit: the server's rate is what is measured
	dyn := dynamic.NewForConfigOrDie(rc)
	// An enrolled record's spec: an EK certificate of about 1.2 KB, its RSA-2048 public
	// area, the AK's and the signing key's ECC areas.
	spec := map[string]any{"node": "floor", "ekCert": make([]byte, 1200), "ekPublic": make([]byte, 280),
		"akPublic": make([]byte, 90), "signingKeyPublic": make([]byte, 90), "enrolled": time.Now().UTC().Format(time.RFC3339)}
	status := map[string]any{"verdict": "verified", "reason": "generation 1 attested", "generation": int64(1), "digest": "sha256:" + strings.Repeat("0", 64)}
	obj := func(name string) *unstructured.Unstructured {
		u := &unstructured.Unstructured{Object: map[string]any{"apiVersion": control.NodeResource.GroupVersion().String(), "kind": "PassageNode",
			"metadata": map[string]any{"name": name}, "spec": spec}}
		return u
	}
	raw, _ := obj("floor-00000").MarshalJSON()
	var made sync.Map
	var creates, updates atomic.Int64
	run := func(f func(w, i int)) {
		stop := time.Now().Add(d)
		var wg sync.WaitGroup
		for w := range clients {
			wg.Go(func() {
				for i := 0; time.Now().Before(stop); i++ {
					f(w, i)
				}
			})
		}
		wg.Wait()
	}
	run(func(w, i int) {
		name := fmt.Sprintf("floor-%02d-%06d", w, i)
		if _, err := dyn.Resource(control.NodeResource).Create(ctx, obj(name), metav1.CreateOptions{}); err == nil {
			creates.Add(1)
			made.Store(w*1_000_000+i, name)
		}
	})
	var names []string
	made.Range(func(_, v any) bool { names = append(names, v.(string)); return true })
	if len(names) == 0 {
		b.Fatal("floor: no creates")
	}
	run(func(w, i int) {
		name := names[(w*7919+i)%len(names)]
		u, err := dyn.Resource(control.NodeResource).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return
		}
		u.Object["status"] = status
		if _, err := dyn.Resource(control.NodeResource).UpdateStatus(ctx, u, metav1.UpdateOptions{}); err == nil {
			updates.Add(1)
		}
	})
	return floor{size: len(raw), creates: float64(creates.Load()) / d.Seconds(), updates: float64(updates.Load()) / d.Seconds()}
}

// parallel runs f(0..n-1) on every core; the first error fails b.
func parallel(n int, f func(i int) error, b *testing.B) {
	b.Helper()
	next := make(chan int)
	errs := make(chan error, runtime.GOMAXPROCS(0))
	var wg sync.WaitGroup
	for range runtime.GOMAXPROCS(0) {
		wg.Go(func() {
			for i := range next {
				if err := f(i); err != nil {
					select {
					case errs <- err:
					default:
					}
				}
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	select {
	case err := <-errs:
		b.Fatal(err)
	default:
	}
}

// stormEKs are n RSA-2048 EK keys: those the cache file holds, the rest made on every
// core and added to it. It says what it cost.
func stormEKs(b *testing.B, n int) ([]*rsa.PrivateKey, string) {
	path := os.Getenv("PASSAGE_STORM_EK_CACHE")
	if path == "" {
		dir, err := os.UserCacheDir()
		if err != nil {
			dir = os.TempDir()
		}
		path = filepath.Join(dir, "passage", "storm-ek-rsa2048.pem")
	}
	start := time.Now()
	var keys []*rsa.PrivateKey
	if raw, err := os.ReadFile(path); err == nil {
		for rest := raw; len(keys) < n; {
			var blk *pem.Block
			if blk, rest = pem.Decode(rest); blk == nil {
				break
			}
			k, err := x509.ParsePKCS1PrivateKey(blk.Bytes)
			if err != nil {
				b.Fatalf("EK cache %s: %v (delete it)", path, err)
			}
			keys = append(keys, k)
		}
	}
	cached, read := len(keys), time.Since(start)
	if cached == n {
		return keys, fmt.Sprintf("%d EKs read from %s in %s", n, path, read.Round(time.Millisecond))
	}
	made := make([]*rsa.PrivateKey, n-cached)
	gen := time.Now()
	parallel(len(made), func(i int) error {
		var err error
		made[i], err = softtpm.GenerateEK()
		return err
	}, b)
	genTime := time.Since(gen)
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err == nil {
		if f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600); err == nil {
			w := bufio.NewWriter(f)
			for _, k := range made {
				pem.Encode(w, &pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(k)})
			}
			w.Flush()
			f.Close()
		}
	}
	return append(keys, made...), fmt.Sprintf("%d EKs read from %s in %s, %d made in %s on %d cores and added to it",
		cached, path, read.Round(time.Millisecond), len(made), genTime.Round(time.Millisecond), runtime.GOMAXPROCS(0))
}

// requests are what the API server's /metrics says of the requests it served, summed:
// {"total", verb, resource} is apiserver_request_total, {"seconds", verb, resource} the
// sum of apiserver_request_duration_seconds (the time each took, queueing included),
// {"ok", verb, resource} the requests of apiserver_request_total that succeeded (a 2xx
// code), {"apf-wait" or "apf-waited", priority level, ""} the sum and count of API Priority and
// Fairness's queue waits, {"apf-rejected", priority level, ""} its rejections.
type requests map[[3]string]float64

// sampled maps the /metrics series read to requests' first key.
var sampled = map[string]string{
	"apiserver_request_total":                                   "total",
	"apiserver_request_duration_seconds_sum":                    "seconds",
	"apiserver_request_duration_seconds_bucket":                 "bucket",
	"apiserver_flowcontrol_request_wait_duration_seconds_sum":   "apf-wait",
	"apiserver_flowcontrol_request_wait_duration_seconds_count": "apf-waited",
	"apiserver_flowcontrol_rejected_requests_total":             "apf-rejected",
}

var (
	labelRE = regexp.MustCompile(`(\w+)="([^"]*)"`)
	nonceRE = regexp.MustCompile(`[0-9a-f]{64}`)
	nodeRE  = regexp.MustCompile(`storm-[0-9]+`)
	timeRE  = regexp.MustCompile(`at [0-9TZ:-]+`)
)

// apiRequests reads the API server's /metrics as the admin.
func apiRequests(b testing.TB, ctx context.Context, hc *http.Client, server string) requests {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, server+"/metrics", nil)
	resp, err := hc.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	out := requests{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		name, rest, ok := strings.Cut(sc.Text(), "{")
		metric := sampled[name]
		if !ok || metric == "" {
			continue
		}
		labels, val, ok := strings.Cut(rest, "} ")
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(val), 64)
		if err != nil {
			continue
		}
		l := map[string]string{}
		for _, m := range labelRE.FindAllStringSubmatch(labels, -1) {
			l[m[1]] = m[2]
		}
		if metric == "bucket" {
			res := l["resource"]
			if ours(res) {
				out[[3]string{metric, l["le"], ""}] += v
			}
			continue
		}
		if strings.HasPrefix(metric, "apf-") {
			out[[3]string{metric, l["priority_level"], ""}] += v
			continue
		}
		res := l["resource"]
		if l["subresource"] != "" {
			res += "/" + l["subresource"]
		}
		out[[3]string{metric, l["verb"], res}] += v
		if metric == "total" && strings.HasPrefix(l["code"], "2") {
			out[[3]string{"ok", l["verb"], res}] += v
		}
	}
	if err := sc.Err(); err != nil && !errors.Is(err, io.EOF) {
		b.Fatal(err)
	}
	return out
}

// p99Latency is the 99th percentile of the API server's time for passage's resources'
// requests, from its histogram's buckets (the bucket's upper bound).
func p99Latency(r requests) time.Duration {
	type bucket struct{ le, n float64 }
	var bs []bucket
	for k, v := range r {
		if k[0] != "bucket" {
			continue
		}
		le, err := strconv.ParseFloat(k[1], 64)
		if err != nil {
			le = math.Inf(1)
		}
		bs = append(bs, bucket{le, v})
	}
	slices.SortFunc(bs, func(a, b bucket) int { return cmp.Compare(a.le, b.le) })
	if len(bs) == 0 {
		return 0
	}
	total := bs[len(bs)-1].n
	for _, b := range bs {
		if b.n >= 0.99*total {
			return time.Duration(b.le * float64(time.Second))
		}
	}
	return 0
}

func (r requests) minus(before requests) requests {
	out := requests{}
	for k, v := range r {
		if d := v - before[k]; d > 0 {
			out[k] = d
		}
	}
	return out
}

var writeVerbs = map[string]bool{"POST": true, "PUT": true, "PATCH": true, "DELETE": true, "APPLY": true}

// ours: the resources passage-control reads and writes.
func ours(resource string) bool {
	r, _, _ := strings.Cut(resource, "/")
	return r == "passagenodes" || r == "passageeks" || r == "devicetaintrules"
}

// cpuSeconds reads each process's user+system CPU time from /proc/<pid>/stat (fields 14
// and 15, in clock ticks of 100 Hz: USER_HZ on Linux).
func cpuSeconds(pids map[string]int) map[string]float64 {
	out := map[string]float64{}
	for name, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		i := strings.LastIndexByte(string(b), ')')
		f := strings.Fields(string(b[i+1:])) // f[0] is field 3 (state)
		if len(f) < 13 {
			continue
		}
		u, _ := strconv.ParseFloat(f[11], 64)
		s, _ := strconv.ParseFloat(f[12], 64)
		out[name] = (u + s) / 100
	}
	return out
}

// verifiedRecords are the PassageNodes whose verdict is verified at generation gen or
// later.
func verifiedRecords(b *testing.B, ctx context.Context, c *harness.Cluster, gen int64) map[string]bool {
	dyn := dynamic.NewForConfigOrDie(restConfig(b, c))
	n := map[string]bool{}
	opts := metav1.ListOptions{Limit: 500}
	for range 1000 {
		l, err := dyn.Resource(control.NodeResource).List(ctx, opts)
		if err != nil {
			b.Fatal(err)
		}
		for _, u := range l.Items {
			st, _ := u.Object["status"].(map[string]any)
			if g, _ := st["generation"].(int64); st["verdict"] == control.VerdictVerified && g >= gen {
				n[u.GetName()] = true
			}
		}
		if opts.Continue = l.GetContinue(); opts.Continue == "" {
			break
		}
	}
	return n
}

type report struct {
	round                                    string
	table                                    string
	verified                                 int
	nodesPerSec, writesPerNode, writesPerSec float64
	p50, p99                                 time.Duration
}

func quantile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(math.Ceil(q*float64(len(s))))-1)]
}

func mean(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	var t time.Duration
	for _, x := range d {
		t += x
	}
	return t / time.Duration(len(d))
}

func stormReport(round string, n, inflight int, p netboot.PublishPolicy, wall time.Duration, times []*controltest.BootTimes, errs []error,
	reqs requests, cpu0, cpu1 map[string]float64, inAPI, gaveUp int) report {
	r := report{round: round}
	shed := 0
	var total []time.Duration
	phases := make([][]time.Duration, controltest.Phases)
	failures := map[string]int{}
	requestsMade := 0
	for i, t := range times {
		if t != nil {
			requestsMade += t.Requests
			shed += t.Shed
		}
		if errs[i] != nil {
			// The reason without the node's name, so equal reasons count together.
			msg := errs[i].Error()
			if _, after, ok := strings.Cut(msg, ": "); ok && strings.HasPrefix(msg, "node ") {
				msg = after
			}
			msg = nodeRE.ReplaceAllString(nonceRE.ReplaceAllString(msg, "<nonce>"), "storm-N")
			msg = timeRE.ReplaceAllString(msg, "<time>")
			failures[msg]++
			continue
		}
		r.verified++
		total = append(total, t.End.Sub(t.Start))
		for ph := range controltest.Phases {
			phases[ph] = append(phases[ph], t.Phase[ph])
		}
	}
	r.p50, r.p99 = quantile(total, 0.50), quantile(total, 0.99)
	r.nodesPerSec = float64(r.verified) / wall.Seconds()
	var w, rd, wAll float64
	for k, v := range reqs {
		if k[0] != "total" {
			continue
		}
		switch {
		case writeVerbs[k[1]] && ours(k[2]):
			w += v
		case ours(k[2]):
			rd += v
		}
		if writeVerbs[k[1]] {
			wAll += v
		}
	}
	per := func(x float64) float64 { return x / float64(max(r.verified, 1)) }
	r.writesPerNode = per(w)
	r.writesPerSec = w / wall.Seconds()

	var sb strings.Builder
	fmt.Fprintf(&sb, "\nboot storm, %s: %d nodes (at most %d at once), 2 passage-control replicas, %d cores; policy %d tries (or for %s), %s each\n",
		round, n, inflight, runtime.NumCPU(), p.Tries, p.For, p.PerTry)
	fmt.Fprintf(&sb, "| nodes | verified | failed | wall | nodes/s | p50 first request→verified | p99 | requests/node | API writes/node | API reads/node |\n")
	fmt.Fprintf(&sb, "|---|---|---|---|---|---|---|---|---|---|\n")
	fmt.Fprintf(&sb, "| %d | %d | %d | %s | %.1f | %s | %s | %.2f | %.2f | %.2f |\n", n, r.verified, n-r.verified,
		wall.Round(10*time.Millisecond), r.nodesPerSec, r.p50.Round(time.Millisecond), r.p99.Round(time.Millisecond),
		float64(requestsMade)/float64(n), r.writesPerNode, per(rd))
	fmt.Fprintf(&sb, "records verified in the API: %d (%d of nodes that gave up); all API writes (every resource, every client): %.2f/node; 503s answered: %d; API server p99 request latency (passage's resources): %s\n",
		inAPI, gaveUp, per(wAll), shed, p99Latency(reqs).Round(time.Millisecond))
	fmt.Fprintf(&sb, "\n| phase (verified nodes) | mean | p99 |\n|---|---|---|\n")
	for ph := range controltest.Phases {
		fmt.Fprintf(&sb, "| %s | %s | %s |\n", ph, mean(phases[ph]).Round(time.Millisecond), quantile(phases[ph], 0.99).Round(time.Millisecond))
	}
	fmt.Fprintf(&sb, "\n| API requests (passage's resources) | count | per node | mean time in the API server |\n|---|---|---|---|\n")
	var keys [][3]string
	for k := range reqs {
		if k[0] == "total" && ours(k[2]) {
			keys = append(keys, k)
		}
	}
	slices.SortFunc(keys, func(a, b [3]string) int { return strings.Compare(a[2]+" "+a[1], b[2]+" "+b[1]) })
	for _, k := range keys {
		secs := reqs[[3]string{"seconds", k[1], k[2]}]
		fmt.Fprintf(&sb, "| %s %s | %.0f | %.2f | %s |\n", k[1], k[2], reqs[k], per(reqs[k]),
			time.Duration(secs/reqs[k]*float64(time.Second)).Round(time.Millisecond))
	}
	fmt.Fprintf(&sb, "\n| API Priority and Fairness level | requests queued | mean wait | rejected |\n|---|---|---|---|\n")
	var levels []string
	for k := range reqs {
		if k[0] == "apf-waited" || k[0] == "apf-rejected" {
			levels = append(levels, k[1])
		}
	}
	slices.Sort(levels)
	for _, l := range slices.Compact(levels) {
		n := reqs[[3]string{"apf-waited", l, ""}]
		fmt.Fprintf(&sb, "| %s | %.0f | %s | %.0f |\n", l, n,
			time.Duration(reqs[[3]string{"apf-wait", l, ""}]/max(n, 1)*float64(time.Second)).Round(time.Millisecond), reqs[[3]string{"apf-rejected", l, ""}])
	}
	fmt.Fprintf(&sb, "\n| process | CPU s | share of wall × cores |\n|---|---|---|\n")
	var names []string
	for name := range cpu1 {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		d := cpu1[name] - cpu0[name]
		fmt.Fprintf(&sb, "| %s | %.1f | %.0f%% |\n", name, d, 100*d/(wall.Seconds()*float64(runtime.NumCPU())))
	}
	if len(failures) > 0 {
		msgs := make([]string, 0, len(failures))
		for msg := range failures {
			msgs = append(msgs, msg)
		}
		slices.SortFunc(msgs, func(a, b string) int { return failures[b] - failures[a] })
		fmt.Fprintf(&sb, "\nfailures (%d reasons; the 10 most frequent):\n", len(msgs))
		for _, msg := range msgs[:min(10, len(msgs))] {
			fmt.Fprintf(&sb, "- %d× %s\n", failures[msg], msg)
		}
	}
	r.table = sb.String()
	return r
}
