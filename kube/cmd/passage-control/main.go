// Command passage-control is passage's control plane at passage.url: it issues nonces,
// enrols TPMs with no human step and verifies each boot's attestation and the manifest
// it carries, keeping every record in the Kubernetes API (package control). Run two or
// more replicas behind one Service, each with the same --exchange-key: any replica
// serves any request.
//
//	passage-control --tls-cert F --tls-key F --ek-ca F --exchange-key F [--approved F]
//	                [--intake F] [--listen ADDR] [--metrics ADDR] [--kubeconfig F]
//	                [--nonce-ttl D] [--kube-qps N] [--max-in-flight N]
//	                [--request-deadline D] [--max-conns N] [--approve-kubelet=false]
//	                [--approve-grace D] [--reconcile-every D]
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"golang.org/x/net/netutil"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/passage-boot/passage/attest"
	"github.com/passage-boot/passage/kube/control"
	"github.com/passage-boot/passage/manifest"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stderr, nil))
}

type flags struct {
	listen, metrics, cert, key, ekCA, approved, intake, kubeconfig, exchangeKey string
	nonceTTL, reconcileEvery, deadline, approveGrace                            time.Duration
	qps                                                                         float64
	maxInFlight, maxConns                                                       int
	approveKubelet                                                              bool
}

// run serves until ctx ends. ready, when not nil, gets the listening addresses (tests).
func run(ctx context.Context, args []string, stderr io.Writer, ready func(api, metrics string)) int {
	fs := flag.NewFlagSet("passage-control", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var f flags
	fs.StringVar(&f.listen, "listen", ":8443", "serve passage.url (https) on `ADDR`")
	fs.StringVar(&f.metrics, "metrics", ":9090", "serve /metrics (http) on `ADDR`; empty: none")
	fs.StringVar(&f.cert, "tls-cert", "", "the serving certificate `FILE` (PEM), the operator's")
	fs.StringVar(&f.key, "tls-key", "", "its private key `FILE` (PEM)")
	fs.StringVar(&f.ekCA, "ek-ca", "", "the EK CA certificates `FILE` (PEM): a TPM's EK certificate must chain to one")
	fs.StringVar(&f.approved, "approved", "", "the approved image `FILE` (passage-approved/1); empty: only the TPM's word is checked (no firmware log)")
	fs.StringVar(&f.intake, "intake", "", "the intake list `FILE` (sha256:<hex> of an EK's public key or serial:<hex>, one a line, optionally followed by the one record name it may enrol as): only TPMs on it enrol")
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "`FILE` to reach the API server (default: in-cluster)")
	fs.DurationVar(&f.nonceTTL, "nonce-ttl", attest.DefaultNonceTTL, "how long an issued nonce is accepted")
	fs.Float64Var(&f.qps, "kube-qps", 200, "API requests a second this replica may make")
	fs.StringVar(&f.exchangeKey, "exchange-key", "", "the `FILE` of the key every replica shares (at least 32 random bytes, a Secret): nonces are its MACs and an enrolment's state travels sealed under it, so neither is stored")
	fs.DurationVar(&f.reconcileEvery, "reconcile-every", 15*time.Second, "how often every pool passage-dra publishes is judged again against its record from the replica's watched caches, which costs the API nothing (a pool is judged on each change to its slices, record or rule: a pool whose published generation is not verified gets the unverified taint within about a second); while the caches are not watching, each such pass lists the slices, records and rules")
	fs.IntVar(&f.maxInFlight, "max-in-flight", control.DefaultMaxInFlight, "requests doing API work at once (each may hold an 8 MiB attestation): one more is answered 503 with Retry-After at once")
	fs.DurationVar(&f.deadline, "request-deadline", control.DefaultDeadline, "a request's answer, 503 with Retry-After if its work is not done, comes within this, and so does each API call; under a boot's 10 s try")
	fs.IntVar(&f.maxConns, "max-conns", 1024, "connections open at once on --listen (each holds its TLS and read buffers, some 40 KiB): past it a connection waits in the kernel's backlog")
	fs.BoolVar(&f.approveKubelet, "approve-kubelet", true, "approve the kubelet's client certificate requests (signer "+control.KubeletSigner+") of boots this control plane verified, for the key each boot attested; false leaves them to another approver")
	fs.DurationVar(&f.approveGrace, "approve-grace", control.DefaultApproveGrace, "how long a replica that did not verify a boot leaves its kubelet's request to the one that did, before judging it itself")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	logger := log.New(stderr, "passage-control: ", log.LstdFlags|log.Lmicroseconds)
	fail := func(code int, format string, a ...any) int {
		logger.Printf(format, a...)
		return code
	}
	if f.cert == "" || f.key == "" || f.ekCA == "" || f.exchangeKey == "" || fs.NArg() > 0 {
		return fail(2, "usage: --tls-cert, --tls-key, --ek-ca and --exchange-key are needed, and no arguments")
	}
	// A nonce shorter than a second outlives no boot's quote.
	if f.nonceTTL < time.Second {
		return fail(2, "--nonce-ttl %s: want at least 1s", f.nonceTTL)
	}
	// client-go reads a QPS of 0 as its default of 5, and a negative one as no limit.
	if f.qps <= 0 {
		return fail(2, "--kube-qps %g: want more than 0", f.qps)
	}
	if f.reconcileEvery < time.Second {
		return fail(2, "--reconcile-every %s: want at least 1s", f.reconcileEvery)
	}
	if f.maxInFlight < 1 {
		return fail(2, "--max-in-flight %d: want at least 1", f.maxInFlight)
	}
	if f.maxConns < f.maxInFlight {
		return fail(2, "--max-conns %d: want at least --max-in-flight (%d)", f.maxConns, f.maxInFlight)
	}
	if f.deadline < 100*time.Millisecond {
		return fail(2, "--request-deadline %s: want at least 100ms", f.deadline)
	}
	if f.approveGrace <= 0 {
		return fail(2, "--approve-grace %s: want more than 0", f.approveGrace)
	}
	cert, err := tls.LoadX509KeyPair(f.cert, f.key)
	if err != nil {
		return fail(2, "--tls-cert/--tls-key: %v", err)
	}
	caPEM, err := manifest.ReadRegular(f.ekCA, 1<<20)
	if err != nil {
		return fail(2, "--ek-ca: %v", err)
	}
	pool, err := attest.CAPool(caPEM)
	if err != nil {
		return fail(2, "--ek-ca %s: %v", f.ekCA, err)
	}
	keys, err := control.ReadKeys(f.exchangeKey)
	if err != nil {
		return fail(2, "--exchange-key: %v", err)
	}
	srv := &control.Server{EKCA: pool, Keys: keys, NonceTTL: f.nonceTTL, Metrics: control.NewMetrics(), Log: logger}
	if f.approved != "" {
		if srv.Approved, err = attest.ReadApproved(f.approved); err != nil {
			return fail(2, "--approved: %v", err)
		}
	}
	if f.intake != "" {
		b, err := manifest.ReadRegular(f.intake, 64<<20)
		if err != nil {
			return fail(2, "--intake: %v", err)
		}
		if srv.Intake, err = control.ParseIntake(b); err != nil {
			return fail(2, "--intake %s: %v", f.intake, err)
		}
	}
	var rc *rest.Config
	if f.kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", f.kubeconfig)
	} else {
		rc, err = rest.InClusterConfig()
	}
	if err != nil {
		return fail(2, "kubernetes client: %v", err)
	}
	rc.QPS, rc.Burst = float32(f.qps), int(2*f.qps)
	// A hung API server fails a call at the deadline, not at the TCP keepalive's.
	rc.Timeout = f.deadline
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return fail(2, "kubernetes client: %v", err)
	}
	kc, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return fail(2, "kubernetes client: %v", err)
	}
	// An API server that answers and does not serve DeviceTaintRules is refused here:
	// no verdict would reach the scheduler. One that does not answer yet is not: the
	// replica serves what needs no API and says not ready until it does.
	sctx, scancel := context.WithTimeout(ctx, f.deadline)
	err = control.CheckServed(kc.Discovery())
	if err == nil {
		err = control.CheckGates(sctx, kc.Discovery().RESTClient())
	}
	scancel()
	if err != nil {
		if control.Unreachable(err) {
			logger.Printf("start: %v (serving anyway; /readyz says not ready until the API server answers)", err)
		} else {
			return fail(1, "%v", err)
		}
	}
	srv.Store = &control.Store{Client: dyn, Table: kc.Discovery().RESTClient()}
	srv.Taints = &control.Taints{Client: kc}
	// The watches are long-lived: their clients have no deadline (rc.Timeout would cut
	// them every few seconds); each call made on what they show is bounded by its
	// context.
	wc := rest.CopyConfig(rc)
	wc.Timeout = 0
	wkc, err := kubernetes.NewForConfig(wc)
	if err != nil {
		return fail(2, "kubernetes client: %v", err)
	}
	if f.approveKubelet {
		srv.Approver = &control.Approver{Client: wkc, Store: srv.Store, Metrics: srv.Metrics, Log: logger, Grace: f.approveGrace}
	}
	// Every replica judges the pools on each change to their slices, records and rules
	// (each write idempotent, a verification landing meanwhile undone by none), and all
	// of them again every --reconcile-every.
	reconciler := &control.Reconciler{Server: srv, Client: wkc, Table: wkc.Discovery().RESTClient(), Every: f.reconcileEvery}

	ln, err := net.Listen("tcp", f.listen)
	if err != nil {
		return fail(1, "--listen: %v", err)
	}
	var mln net.Listener
	if f.metrics != "" {
		if mln, err = net.Listen("tcp", f.metrics); err != nil {
			ln.Close()
			return fail(1, "--metrics: %v", err)
		}
	}
	limit := control.NewLimit(srv, f.maxInFlight, f.deadline, srv.Metrics)
	limit.Log = logger
	// A nonce and a bare envelope ask the API nothing (and an envelope's body is
	// discarded unread): they are not held to the bound on API work.
	limit.Exempt = control.Cheap
	health := &control.Health{Limit: limit, Probe: func(ctx context.Context) error {
		return kc.Discovery().RESTClient().Get().AbsPath("/readyz").Do(ctx).Error()
	}}
	go health.Run(ctx)
	// A boot's try is 10 s: a request read or answered much later than its deadline
	// serves no one.
	hs := &http.Server{
		Handler: limit, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: f.deadline + 5*time.Second, WriteTimeout: f.deadline + 5*time.Second,
		IdleTimeout: time.Minute, MaxHeaderBytes: 16 << 10,
		TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12},
		ErrorLog:  logger,
	}
	errs := make(chan error, 2)
	go func() { errs <- hs.ServeTLS(netutil.LimitListener(ln, f.maxConns), "", "") }()
	var ms *http.Server
	if mln != nil {
		mux := http.NewServeMux()
		mux.Handle("/metrics", srv.Metrics.Handler())
		mux.HandleFunc("/healthz", health.Healthz)
		mux.HandleFunc("/readyz", health.Readyz)
		ms = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second,
			WriteTimeout: 10 * time.Second, IdleTimeout: time.Minute, MaxHeaderBytes: 8 << 10, ErrorLog: logger}
		go func() { errs <- ms.Serve(mln) }()
	}
	maddr := ""
	if mln != nil {
		maddr = mln.Addr().String()
	}
	logger.Printf("serving passage.url on https://%s, metrics on %s", ln.Addr(), maddr)
	if ready != nil {
		ready(ln.Addr().String(), maddr)
	}
	if srv.Approver != nil {
		go srv.Approver.Run(ctx)
	}
	go reconciler.Run(ctx)
	for {
		select {
		case <-ctx.Done():
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			hs.Shutdown(sctx)
			if ms != nil {
				ms.Shutdown(sctx)
			}
			cancel()
			return 0
		case err := <-errs:
			if errors.Is(err, http.ErrServerClosed) {
				return 0
			}
			return fail(1, "serve: %v", err)
		}
	}
}
