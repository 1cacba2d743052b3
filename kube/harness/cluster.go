// Package harness runs a real Kubernetes control plane on loopback for the driver's
// end-to-end test: etcd, kube-apiserver, kube-scheduler and kube-controller-manager
// (only the resourceclaim, garbage-collector and device-taint-eviction controllers), the pinned binaries
// build.sh builds, with throw-away certificates and tokens made here. There is no
// kubelet: the test plays its part (NodePrepareResources over the plugin's socket).
package harness

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// Cluster is a running control plane.
type Cluster struct {
	Dir       string // certificates, kubeconfigs, data and logs
	Server    string // the API server's URL
	Admin     string // the admin's kubeconfig (system:masters)
	Client    *kubernetes.Clientset
	Started   time.Time // when etcd was started
	procs     []*proc
	opts      Options
	caPEM     []byte
	adminTokn string
	// NodeToken is the bearer token of Options.Node's kubelet ("" without a node).
	NodeToken string
	// CA is the PEM certificate the API server's serving certificate chains to.
	CA []byte
	// BootstrapToken is Options.Signing's bootstrap token ("<id>.<secret>"), a user
	// system:bootstrap:<id> in group system:bootstrappers.
	BootstrapToken string
}

type proc struct {
	name, log string
	cmd       *exec.Cmd
	done      chan struct{}
}

// Options start a control plane other than the default one: a cluster whose API server
// lacks what a component needs.
type Options struct {
	// FeatureGates is --feature-gates of kube-apiserver, kube-scheduler and
	// kube-controller-manager ("DRADeviceTaints=false,DRADeviceTaintRules=false").
	FeatureGates string
	// RuntimeConfig is kube-apiserver's --runtime-config
	// ("resource.k8s.io/v1/devicetaintrules=false").
	RuntimeConfig string
	// Node readies the control plane for a real kubelet (a QEMU guest's): nil for the
	// tests that play the kubelet's part themselves.
	Node *NodeAccess
	// Signing readies it for the kubelet's TLS bootstrap (signing.go): a client CA the
	// API server trusts and kube-controller-manager's csrsigning controller signs with,
	// a bootstrap token (Cluster.BootstrapToken) whose group may create certificate
	// requests, and no approver: csrapproving does not run.
	Signing bool
}

// NodeAccess is what a real node's kubelet needs of the control plane.
type NodeAccess struct {
	// Name is the node's: a token (Cluster.NodeToken) authenticates its kubelet as
	// system:node:<Name> in group system:nodes, which the Node authorizer and
	// NodeRestriction judge.
	Name string
	// ServiceCIDR is --service-cluster-ip-range. The kubernetes Service's ClusterIP,
	// which pods dial (KUBERNETES_SERVICE_HOST), is its first address: a guest with no
	// kube-proxy reaches it when that address is the guestfwd to the API server.
	ServiceCIDR string
	// Addresses are more IP addresses the serving certificate names: where the node
	// dials the API server.
	Addresses []net.IP
}

// Start starts the control plane from the binaries in bin (kube-apiserver,
// kube-scheduler, kube-controller-manager, etcd) with its files in dir. Each wait is
// bounded, and its error carries the component's log tail. On error what was started
// is stopped.
func Start(ctx context.Context, bin, dir string) (*Cluster, error) {
	return StartWith(ctx, bin, dir, Options{})
}

// StartWith is Start with o's flags.
func StartWith(ctx context.Context, bin, dir string, o Options) (*Cluster, error) {
	c := &Cluster{Dir: dir, Started: time.Now(), opts: o}
	if err := c.start0(ctx, bin, dir); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

func (c *Cluster) start0(ctx context.Context, bin, dir string) error {
	for _, b := range []string{"etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			return fmt.Errorf("control plane %s: %w (make cluster-bin builds it)", bin, err)
		}
	}
	if err := c.secrets(); err != nil {
		return err
	}
	ports, err := freePorts(5)
	if err != nil {
		return err
	}
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", ports[0])
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", ports[1])
	c.Started = time.Now()
	etcd, err := c.start(bin, "etcd", "--name=e2e", "--data-dir="+filepath.Join(dir, "etcd"),
		"--listen-client-urls="+etcdURL, "--advertise-client-urls="+etcdURL,
		"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=e2e="+peerURL, "--unsafe-no-fsync", "--log-level=warn")
	if err != nil {
		return err
	}
	if err := c.wait(ctx, etcd, 30*time.Second, func() error { return get(http.DefaultClient, etcdURL+"/health", "") }); err != nil {
		return err
	}
	c.Server = fmt.Sprintf("https://127.0.0.1:%d", ports[2])
	f := func(n string) string { return filepath.Join(dir, n) }
	api, err := c.start(bin, "kube-apiserver", c.flags(true, "--etcd-servers="+etcdURL,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--secure-port="+strconv.Itoa(ports[2]),
		// Otherwise it advertises the machine's other address for the kubernetes service.
		"--endpoint-reconciler-type=none",
		"--tls-cert-file="+f("serving.crt"), "--tls-private-key-file="+f("serving.key"),
		"--service-account-key-file="+f("sa.pub"), "--service-account-signing-key-file="+f("sa.key"),
		"--service-account-issuer=https://kubernetes.default.svc", "--service-cluster-ip-range="+c.serviceCIDR(),
		"--token-auth-file="+f("tokens.csv"), "--authorization-mode=Node,RBAC", "--cert-dir="+f("apiserver-certs"),
		// As kubeadm runs it: without, the API server refuses deploy/daemonset.yaml's
		// privileged container ("disallowed by cluster policy").
		"--allow-privileged=true")...)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(c.caPEM)
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	if err := c.wait(ctx, api, 60*time.Second, func() error { return get(hc, c.Server+"/readyz", c.adminTokn) }); err != nil {
		return err
	}
	for _, u := range []struct{ name, token string }{{"admin", c.adminTokn}, {"scheduler", "scheduler-" + c.adminTokn}, {"controller-manager", "cm-" + c.adminTokn}} {
		if err := c.kubeconfig(f(u.name+".kubeconfig"), u.token); err != nil {
			return err
		}
	}
	c.Admin = f("admin.kubeconfig")
	rc, err := clientcmd.BuildConfigFromFlags("", c.Admin)
	if err != nil {
		return err
	}
	rc.QPS, rc.Burst = 100, 200
	if c.Client, err = kubernetes.NewForConfig(rc); err != nil {
		return err
	}
	// -v=2: the scheduler logs each attempt that finds no fit, naming the pod
	// (SchedulingAttempts reads it).
	sched, err := c.start(bin, "kube-scheduler", c.flags(false, "--kubeconfig="+f("scheduler.kubeconfig"), "--leader-elect=false",
		"--bind-address=127.0.0.1", "--secure-port="+strconv.Itoa(ports[3]), "--cert-dir="+f("scheduler-certs"), "-v=2")...)
	if err != nil {
		return err
	}
	// The controller-manager runs its controllers as its own user (no service-account
	// credentials: no token controller runs), whose built-in role does not cover what
	// these do: they get their controllers' built-in roles.
	for _, role := range []string{"system:controller:resource-claim-controller", "system:controller:generic-garbage-collector",
		"system:controller:device-taint-eviction-controller"} {
		b := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "e2e:" + role},
			RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
			Subjects: []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: "system:kube-controller-manager"}}}
		if _, err := c.Client.RbacV1().ClusterRoleBindings().Create(ctx, b, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("controller-manager role %s: %w", role, err)
		}
	}
	// The node controller is left out: with no kubelet it marks the nodes NotReady.
	// device-taint-eviction-controller deletes the pods using a device a NoExecute
	// DeviceTaintRule taints (passage-control's attestation-failed).
	controllers := "resourceclaim-controller,garbage-collector-controller,device-taint-eviction-controller"
	cmArgs := []string{"--kubeconfig=" + f("controller-manager.kubeconfig"), "--leader-elect=false",
		"--bind-address=127.0.0.1", "--secure-port=" + strconv.Itoa(ports[4]), "--cert-dir=" + f("cm-certs")}
	if c.opts.Node != nil {
		// A real kubelet runs what the deploy files make: DaemonSets and Deployments
		// (their ReplicaSets), in namespaces whose default service account and
		// kube-root-ca.crt ConfigMap (every pod's projected token volume names it) the
		// controller-manager makes.
		// node-lifecycle-controller lifts the not-ready taint admission gives a new Node
		// once its kubelet reports Ready.
		controllers += ",daemonset-controller,deployment-controller,replicaset-controller,serviceaccount-controller,root-ca-certificate-publisher-controller,node-lifecycle-controller"
		cmArgs = append(cmArgs, "--root-ca-file="+f("serving.crt"))
		for _, role := range []string{"system:controller:daemon-set-controller", "system:controller:deployment-controller",
			"system:controller:replicaset-controller", "system:controller:service-account-controller", "system:controller:root-ca-cert-publisher", "system:controller:node-controller"} {
			b := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "e2e:" + role},
				RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
				Subjects: []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: "system:kube-controller-manager"}}}
			if _, err := c.Client.RbacV1().ClusterRoleBindings().Create(ctx, b, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("controller-manager role %s: %w", role, err)
			}
		}
	}
	if c.opts.Signing {
		if controllers, cmArgs, err = c.signing(ctx, controllers, cmArgs); err != nil {
			return err
		}
	}
	cm, err := c.start(bin, "kube-controller-manager", c.flags(false, append(cmArgs, "--controllers="+controllers)...)...)
	if err != nil {
		return err
	}
	// Both serve /healthz on their secure port once started (self-signed).
	insecure := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	for i, p := range []*proc{sched, cm} {
		url := fmt.Sprintf("https://127.0.0.1:%d/healthz", ports[3+i])
		if err := c.wait(ctx, p, 60*time.Second, func() error { return get(insecure, url, "") }); err != nil {
			return err
		}
	}
	return nil
}

func (c *Cluster) serviceCIDR() string {
	if c.opts.Node != nil && c.opts.Node.ServiceCIDR != "" {
		return c.opts.Node.ServiceCIDR
	}
	return "10.96.0.0/16"
}

// flags are a component's args with the Options' flags: --feature-gates for every
// component, --runtime-config for the API server.
func (c *Cluster) flags(apiserver bool, args ...string) []string {
	if c.opts.FeatureGates != "" {
		args = append(args, "--feature-gates="+c.opts.FeatureGates)
	}
	if apiserver && c.opts.RuntimeConfig != "" {
		args = append(args, "--runtime-config="+c.opts.RuntimeConfig)
	}
	if apiserver && c.opts.Signing {
		args = append(args, signingAPIServerFlags(c.Dir)...)
	}
	return args
}

func get(hc *http.Client, url, token string) error {
	req, err := http.NewRequest("GET", url, nil)
	if err != nil {
		return err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	return nil
}

// wait polls ready until it succeeds, the process exits, or d passes; the error names
// the component and ends with its log tail.
func (c *Cluster) wait(ctx context.Context, p *proc, d time.Duration, ready func() error) error {
	deadline := time.Now().Add(d)
	for {
		err := ready()
		if err == nil {
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("%s exited (%v) before it was ready: %s", p.name, p.cmd.ProcessState, Tail(p.log, 2048))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after %v (%v): %s", p.name, d, err, Tail(p.log, 2048))
		}
	}
}

// Tail is the last n bytes of a log file.
func Tail(path string, n int64) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if int64(len(b)) > n {
		b = b[int64(len(b))-n:]
	}
	return path + ":\n" + string(b)
}

func (c *Cluster) start(bin, name string, args ...string) (*proc, error) {
	p := &proc{name: name, log: filepath.Join(c.Dir, name+".log"), done: make(chan struct{})}
	out, err := os.Create(p.log)
	if err != nil {
		return nil, err
	}
	p.cmd = exec.Command(filepath.Join(bin, name), args...)
	p.cmd.Stdout, p.cmd.Stderr = out, out
	if err := p.cmd.Start(); err != nil {
		out.Close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	go func() { p.cmd.Wait(); out.Close(); close(p.done) }()
	c.procs = append(c.procs, p)
	return p, nil
}

// Stop stops the components by their pids, the last started first: SIGTERM, then
// SIGKILL after 10 s.
func (c *Cluster) Stop() {
	for i := len(c.procs) - 1; i >= 0; i-- {
		p := c.procs[i]
		p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			p.cmd.Process.Kill()
			<-p.done
		}
	}
	c.procs = nil
}

// SchedulingAttempts counts the kube-scheduler's attempts to place the pod
// namespace/name that found no node: the line its handleSchedulingFailure logs at -v=2
// for each (k8s.io/kubernetes v1.37 pkg/scheduler/schedule_one.go). A test that must see
// a pod still Pending after a change waits for one more attempt than before it, not for
// a guessed time.
func (c *Cluster) SchedulingAttempts(namespace, name string) (int, error) {
	b, err := os.ReadFile(filepath.Join(c.Dir, "kube-scheduler.log"))
	if err != nil {
		return 0, err
	}
	return bytes.Count(b, []byte(`"Unable to schedule pod; no fit; waiting" pod="`+namespace+"/"+name+`"`)), nil
}

// PIDs are the running components' process ids by name (etcd, kube-apiserver,
// kube-scheduler, kube-controller-manager): a benchmark reads their CPU time in /proc.
func (c *Cluster) PIDs() map[string]int {
	out := map[string]int{}
	for _, p := range c.procs {
		out[p.name] = p.cmd.Process.Pid
	}
	return out
}

// Logs names the components' log files.
func (c *Cluster) Logs() []string {
	var out []string
	for _, p := range c.procs {
		out = append(out, p.log)
	}
	return out
}

// secrets makes the throw-away serving certificate (self-signed, for 127.0.0.1), the
// service-account key pair and the static tokens: admin in system:masters, and the
// scheduler's and controller-manager's users, which get their built-in roles.
func (c *Cluster) secrets() error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "passage-e2e"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true,
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
	}
	if c.opts.Node != nil {
		tmpl.IPAddresses = append(tmpl.IPAddresses, c.opts.Node.Addresses...)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return err
	}
	c.caPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	c.CA = c.caPEM
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	sa, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	sab, err := x509.MarshalECPrivateKey(sa)
	if err != nil {
		return err
	}
	sapub, err := x509.MarshalPKIXPublicKey(sa.Public())
	if err != nil {
		return err
	}
	tok := make([]byte, 16)
	rand.Read(tok)
	c.adminTokn = fmt.Sprintf("%x", tok)
	tokens := fmt.Sprintf("%s,admin,admin,system:masters\nscheduler-%s,system:kube-scheduler,kube-scheduler\ncm-%s,system:kube-controller-manager,kube-controller-manager\n",
		c.adminTokn, c.adminTokn, c.adminTokn)
	if c.opts.Node != nil {
		c.NodeToken = "node-" + c.adminTokn
		tokens += fmt.Sprintf("%s,system:node:%s,node-%s,system:nodes\n", c.NodeToken, c.opts.Node.Name, c.opts.Node.Name)
	}
	if c.opts.Signing {
		if err := clientCA(c.Dir); err != nil {
			return err
		}
	}
	for name, b := range map[string][]byte{
		"serving.crt": c.caPEM,
		"serving.key": pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}),
		"sa.key":      pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: sab}),
		"sa.pub":      pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: sapub}),
		"tokens.csv":  []byte(tokens),
	} {
		if err := os.WriteFile(filepath.Join(c.Dir, name), b, 0o600); err != nil {
			return err
		}
	}
	return nil
}

// ServiceAccountKubeconfig writes a kubeconfig at path that authenticates as the service
// account namespace/name with a token the API server issues for it (TokenRequest, an
// hour), so that what a client may do is what RBAC grants that account: a DaemonSet's
// pod, without a kubelet to mount its token.
func (c *Cluster) ServiceAccountKubeconfig(ctx context.Context, namespace, name, path string) error {
	exp := int64(3600)
	tr, err := c.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name,
		&authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("token for service account %s/%s: %w", namespace, name, err)
	}
	return c.kubeconfig(path, tr.Status.Token)
}

func (c *Cluster) kubeconfig(path, token string) error {
	ca := filepath.Join(c.Dir, "serving.crt")
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: e2e, cluster: {server: %q, certificate-authority: %q}}]
users: [{name: u, user: {token: %q}}]
contexts: [{name: e2e, context: {cluster: e2e, user: u}}]
current-context: e2e
`, c.Server, ca, token)
	return os.WriteFile(path, []byte(cfg), 0o600)
}

// freePorts are n loopback ports free now (the kernel's choice).
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var out []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		out = append(out, l.Addr().(*net.TCPAddr).Port)
	}
	return out, nil
}
