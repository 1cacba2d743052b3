// Command passage-dra is passage's Kubernetes DRA driver: it publishes the ready units of
// a node's verified manifest as one schedulable resource each (a ResourceClaim with one
// request per function, all on one unit), and prepares claimed units for KubeVirt.
//
//	passage-dra slices   [flags] MANIFEST   the DeviceClass, claim templates and slices (YAML)
//	passage-dra kubevirt [flags] MANIFEST   the VMI resourceClaims/hostDevices stanza for units
//	passage-dra nccl-xml [flags] MANIFEST   the NCCL topology file for the units' guest
//	passage-dra plugin   [flags]            run the kubelet plugin (the DaemonSet's command)
//	passage-dra fabric check [flags] MANIFEST  hold Fabric Manager's partitions to the manifest
//	passage-dra fabric modules --nvidia-smi FILE  the profile's modules: stanza from nvidia-smi -q
//
// Every command reads the manifest through passage's one verification path (the key,
// its enrolment for the node, the semantic check); a refused manifest exits 1 with the
// reason, and nothing is printed or published.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"sigs.k8s.io/yaml"

	"github.com/passage-boot/passage/erase"
	"github.com/passage-boot/passage/hypervisor"
	"github.com/passage-boot/passage/initramfs"
	"github.com/passage-boot/passage/initramfs/kubelet"
	"github.com/passage-boot/passage/kube/dra/plugin"
	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/fabricmanager"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/recycle"
	"github.com/passage-boot/passage/topology"
)

func main() { os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr)) }

// simulate is nil but in a binary built with -tags passagesim (the cluster tests'): there
// it gives the turnaround a simulated kernel and NVMe controllers beneath --root.
var simulate func(root string, t *plugin.Turnaround) error

const usage = `usage: passage-dra COMMAND [flags]
  slices   MANIFEST  print the DeviceClass, ResourceClaimTemplates and ResourceSlices (YAML)
  kubevirt MANIFEST  print the VMI resourceClaims/hostDevices stanza for --unit's shape
                     (units that are one NVLink partition: one claim of the partition)
  nccl-xml MANIFEST  print the NCCL topology file for --unit's guest
                     (units that are one NVLink partition: their GPUs' NVLinks too)
  plugin             run the kubelet plugin
  fabric check MANIFEST  hold Fabric Manager's NVLink partitions to the manifest's units
                     and NVLink layout; each mismatch printed, exit 1 on any (FM cannot
                     tell which GPU is which module: --nvidia-smi FILE holds the map to
                     the driver's; FM's FABRIC_MODE is not checked)
  fabric modules --nvidia-smi FILE  print the SKU profile's modules: stanza (GPU address:
                     Module ID) from nvidia-smi -q's output, taken while the GPUs were on nvidia
`

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	cmd, args := args[0], args[1:]
	fs := flag.NewFlagSet("passage-dra "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	// One options value every command's flags parse into, read only after fs.Parse: a
	// copy taken before the parse would keep the flags' defaults (--node-name ignored,
	// slices published for a node that does not exist).
	o := &options{}
	o.register(fs)
	switch cmd {
	case "slices":
		return cmdSlices(fs, args, o, stdout, stderr)
	case "kubevirt", "nccl-xml":
		return cmdUnit(cmd, fs, args, o, stdout, stderr)
	case "plugin":
		return cmdPlugin(ctx, fs, args, o, stderr)
	case "fabric":
		if len(args) > 0 && args[0] == "modules" {
			fs = flag.NewFlagSet("passage-dra fabric modules", flag.ContinueOnError)
			fs.SetOutput(stderr)
			return cmdFabricModules(fs, args[1:], stdout, stderr)
		}
		if len(args) == 0 || args[0] != "check" {
			fmt.Fprintf(stderr, "passage-dra fabric: give check or modules\n%s", usage)
			return 2
		}
		fs = flag.NewFlagSet("passage-dra fabric check", flag.ContinueOnError)
		fs.SetOutput(stderr)
		o.register(fs)
		return cmdFabricCheck(fs, args[1:], o, stdout, stderr)
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return 0
	}
	fmt.Fprintf(stderr, "passage-dra: unknown command %q\n%s", cmd, usage)
	return 2
}

// options are the flags every command has: the manifest's source and the rendering.
type options struct {
	src sourceFlags
	res resources.Options
}

func (o *options) register(fs *flag.FlagSet) {
	o.src.register(fs)
	fs.StringVar(&o.res.NodeName, "node-name", "", "Kubernetes node name (default: the manifest's hostname)")
	fs.BoolVar(&o.res.Degraded, "degraded", false, "offer degraded units too (their devices say status degraded; a claim takes one only from a unit-<shape>-or-degraded template)")
}

// sourceFlags are passage verify's flags for the keys and expectations.
type sourceFlags struct {
	pub, tpmPub, minGen, bootID, nodeUUID string
}

// unitList is --unit: repeatable, each value one unit or a comma-separated list.
type unitList []string

func (u *unitList) String() string { return strings.Join(*u, ",") }

func (u *unitList) Set(v string) error {
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s == "" {
			return fmt.Errorf("empty unit in %q", v)
		}
		*u = append(*u, s)
	}
	return nil
}

func (f *sourceFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.pub, "pub", "", "public key `FILE` of the node's ed25519 key, or a directory of a fleet's enrolled keys")
	fs.StringVar(&f.tpmPub, "tpm-pub", "", "public key `FILE` (or directory) of TPM keys")
	fs.StringVar(&f.minGen, "min-generation", "0", "refuse manifests with a lower generation (replay)")
	fs.StringVar(&f.bootID, "boot-id", "", "refuse manifests of another boot")
	fs.StringVar(&f.nodeUUID, "node-uuid", "", "refuse a manifest of a node with another DMI product UUID")
}

func (f *sourceFlags) source() (resources.Source, error) {
	if (f.pub == "") == (f.tpmPub == "") {
		return resources.Source{}, errors.New("give exactly one of --pub and --tpm-pub")
	}
	min, err := strconv.ParseUint(f.minGen, 10, 64)
	if err != nil {
		return resources.Source{}, fmt.Errorf("--min-generation %q: not a generation number", f.minGen)
	}
	return resources.Source{Keys: f.pub + f.tpmPub, TPM: f.tpmPub != "", MinGeneration: min, BootID: f.bootID, NodeUUID: f.nodeUUID}, nil
}

// verified parses the flags and verifies the one MANIFEST; code is the exit status when
// it is refused (1) or the command is misused (2).
func verified(fs *flag.FlagSet, args []string, src *sourceFlags, stderr io.Writer) (*manifest.Verified, int) {
	if err := fs.Parse(args); err != nil {
		return nil, 2
	}
	if fs.NArg() != 1 {
		fmt.Fprintf(stderr, "%s: give one MANIFEST\n", fs.Name())
		return nil, 2
	}
	s, err := src.source()
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
		return nil, 2
	}
	v, err := resources.Verify(fs.Arg(0), s)
	if err != nil {
		var ve *manifest.VerifyError
		if errors.As(err, &ve) || errors.Is(err, manifest.ErrWrongNode) {
			fmt.Fprintf(stderr, "%s: REFUSED: %s\n", fs.Name(), manifest.Printable(err.Error()))
			return nil, 1
		}
		fmt.Fprintf(stderr, "%s: %s\n", fs.Name(), manifest.Printable(err.Error()))
		return nil, 2
	}
	return v, 0
}

func cmdSlices(fs *flag.FlagSet, args []string, o *options, stdout, stderr io.Writer) int {
	sysRoot := fs.String("sysfs-root", "", "read each function's pcieRoot from this sysfs (the node's /sys); without, the attribute is left out")
	v, code := verified(fs, args, &o.src, stderr)
	if v == nil {
		return code
	}
	opts := o.res
	if *sysRoot != "" {
		opts.PCIeRoot = plugin.PCIeRoot(*sysRoot)
	}
	objs, err := resources.Render(v, opts)
	if err != nil {
		fmt.Fprintf(stderr, "%s: REFUSED: %v\n", fs.Name(), err)
		return 1
	}
	if err := resources.WriteYAML(stdout, objs.List()); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
		return 1
	}
	for _, l := range objs.NVLinkLeftOut {
		fmt.Fprintf(stderr, "%s: no template %s\n", fs.Name(), l)
	}
	return 0
}

func cmdUnit(cmd string, fs *flag.FlagSet, args []string, o *options, stdout, stderr io.Writer) int {
	var units unitList
	fs.Var(&units, "unit", "the units (gpu3): repeat the flag or separate them with commas")
	claim := fs.String("claim", "unit", "kubevirt: the claim's name in the VMI (with several units: NAME-0, NAME-1...)")
	numa := fs.Bool("numa", false, "nccl-xml: the guest has the host's NUMA nodes (passage render --numa)")
	v, code := verified(fs, args, &o.src, stderr)
	if v == nil {
		return code
	}
	if len(units) == 0 {
		fmt.Fprintf(stderr, "%s: give --unit\n", fs.Name())
		return 2
	}
	degraded := o.res.Degraded
	var picked []*manifest.Unit
	for _, id := range units {
		var u *manifest.Unit
		for i := range v.Manifest.Units {
			if v.Manifest.Units[i].ID == id {
				u = &v.Manifest.Units[i]
			}
		}
		if u == nil {
			fmt.Fprintf(stderr, "%s: --unit %q: not a unit of the manifest\n", fs.Name(), manifest.Printable(id))
			return 2
		}
		if slices.Contains(picked, u) {
			fmt.Fprintf(stderr, "%s: --unit %s: given twice\n", fs.Name(), manifest.Printable(id))
			return 2
		}
		if u.Status != manifest.StatusReady && !(degraded && u.Status == manifest.StatusDegraded) {
			fmt.Fprintf(stderr, "%s: REFUSED: unit %s is %s\n", fs.Name(), manifest.Printable(u.ID), manifest.Printable(u.Status))
			return 1
		}
		picked = append(picked, u)
	}
	ids := make([]string, len(picked))
	ready := true
	for i, u := range picked {
		ids[i] = u.ID
		ready = ready && u.Status == manifest.StatusReady
	}
	// Units that are one NVLink partition of the manifest's layout are claimed as one
	// (the shape's NVLink template), and their NCCL file says their GPUs share NVLink.
	// The NVLink templates take ready units only: with a degraded unit they are claimed
	// one by one, and get no NVLink.
	part, isPart, err := hypervisor.NVLinkGuest(v.Manifest, ids)
	if err != nil {
		fmt.Fprintf(stderr, "%s: REFUSED: manifest: %v\n", fs.Name(), err)
		return 1
	}
	isPart = isPart && ready && sameShape(picked)
	var out []byte
	switch cmd {
	case "kubevirt":
		if isPart {
			s := resources.KubeVirtNVLink(shapeOf(picked[0]), len(part.Modules), *claim)
			out, err = yaml.Marshal(map[string]any{"spec": s})
			break
		}
		var spec resources.VMIClaims
		for i, u := range picked {
			shape := shapeOf(u)
			name := *claim
			if len(picked) > 1 {
				name = fmt.Sprintf("%s-%d", *claim, i)
			}
			// With --degraded the tenant asks for a ready or a degraded unit: the claim
			// comes from the shape's -or-degraded template.
			s := resources.KubeVirt(shape, name, degraded)
			spec.ResourceClaims = append(spec.ResourceClaims, s.ResourceClaims...)
			spec.Domain.Devices.HostDevices = append(spec.Domain.Devices.HostDevices, s.Domain.Devices.HostDevices...)
		}
		out, err = yaml.Marshal(map[string]any{"spec": spec})
	case "nccl-xml":
		nvlinks := 0
		if isPart {
			nvlinks = hypervisor.NVLinks(v.Manifest)
		}
		out, err = ncclXML(v.Manifest, ids, *numa, degraded, nvlinks)
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
		return 1
	}
	stdout.Write(out)
	return 0
}

func shapeOf(u *manifest.Unit) resources.Shape {
	s := make(resources.Shape, len(u.Functions))
	for i, f := range u.Functions {
		s[i] = f.Role
	}
	return s
}

func sameShape(units []*manifest.Unit) bool {
	for _, u := range units {
		if shapeOf(u).String() != shapeOf(units[0]).String() {
			return false
		}
	}
	return true
}

// ncclXML is passage render --format nccl-xml of the units, from the verified manifest
// alone; nvlinks above 0 says their GPUs are one NVLink partition with that many
// NVLinks each.
func ncclXML(m *manifest.Manifest, units []string, numa, degraded bool, nvlinks int) ([]byte, error) {
	ids := make([]topology.UnitID, len(units))
	for i, u := range units {
		if err := ids[i].UnmarshalText([]byte(u)); err != nil {
			return nil, err
		}
	}
	sources, err := hypervisor.Sources(m)
	if err != nil {
		return nil, err
	}
	cpus, err := hypervisor.HostCPUs(m)
	if err != nil {
		return nil, err
	}
	r, err := hypervisor.Render(hypervisor.Input{Sources: sources, Units: ids, NUMA: numa, AllowDegraded: degraded, HostCPUs: cpus, NVLinks: nvlinks},
		"nccl-xml", topology.DomainOptions{})
	if err != nil {
		return nil, err
	}
	return r.Out, nil
}

func cmdPlugin(ctx context.Context, fs *flag.FlagSet, args []string, o *options, stderr io.Writer) int {
	cfg, p, code := pluginConfig(fs, args, o, stderr)
	if code != 0 {
		return code
	}
	var rc *rest.Config
	var err error
	if p.kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", p.kubeconfig)
	} else {
		rc, err = rest.InClusterConfig()
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
		return 2
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
		return 2
	}
	// What the plugin carries on through (an export to --hook-dir that failed, with
	// the count of failures so far) goes to the log beside the reloads' errors.
	var logMu sync.Mutex
	cfg.Logf = func(format string, args ...any) {
		logMu.Lock()
		defer logMu.Unlock()
		fmt.Fprintf(stderr, "%s: %s\n", fs.Name(), manifest.Printable(fmt.Sprintf(format, args...)))
	}
	if cfg.Turnaround != nil {
		cfg.Turnaround.Kube = client
		cfg.Turnaround.NodeName = o.res.NodeName
		if simulate != nil {
			if err := simulate(cfg.Root, cfg.Turnaround); err != nil {
				fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
				return 1
			}
			cfg.Logf("SIMULATED hardware under %s (a passagesim build): the turnaround erases and resets nothing real", cfg.Root)
		}
	}
	if cfg.Fabric != nil {
		defer cfg.Fabric.Close()
	}
	d, err := plugin.New(cfg)
	if err != nil {
		fmt.Fprintf(stderr, "%s: REFUSED: %s\n", fs.Name(), manifest.Printable(err.Error()))
		return 1
	}
	if cfg.Turnaround != nil && cfg.Turnaround.NodeName == "" {
		cfg.Turnaround.NodeName = d.Objects().Node
	}
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := os.MkdirAll(p.dataDir, 0o750); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
		return 1
	}
	// The turnaround, and a partition FM will not deactivate, quarantine a unit with a
	// taint in the slices: before anything is published, the API server must be seen
	// keeping one. A node whose manifest knows no Module ID does not talk to FM, so the
	// DaemonSet's --fm- flags alone ask nothing of the API server.
	if cfg.Turnaround != nil || d.UsesFabric() {
		if err := plugin.CheckDeviceTaints(ctx, client, d.Objects().Node, d.Objects().Pool); err != nil {
			fmt.Fprintf(stderr, "%s: REFUSED: %s\n", fs.Name(), manifest.Printable(err.Error()))
			return 1
		}
	}
	if err := d.Start(ctx, kubeletplugin.KubeClient(client), kubeletplugin.RegistrarDirectoryPath(p.registry),
		kubeletplugin.PluginDataDirectoryPath(p.dataDir)); err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
		return 1
	}
	defer d.Stop()
	fmt.Fprintf(stderr, "%s: node %s: publishing %d devices of manifest generation %d\n", fs.Name(), d.Objects().Node, len(d.Objects().Devices), d.Objects().Generation)
	// The turnaround stops with ctx, before the plugin: a recycle cut short is taken up
	// again from units.json by the next start.
	turnCtx, stopTurn := context.WithCancel(ctx)
	var turning sync.WaitGroup
	turning.Go(func() { d.RunTurnaround(turnCtx) })
	if kc := p.kubelet.renewer(d, o.res.NodeName, cfg.Logf); kc != nil {
		turning.Go(func() { kc.Run(turnCtx) })
	}
	defer turning.Wait()
	defer stopTurn()
	return serve(ctx, d, p.reload, fs.Name(), stderr, func(err error) int {
		if errors.Is(err, plugin.ErrTaintsDropped) {
			// Stopped first: its publisher would put the slices back.
			d.Stop()
			fmt.Fprintf(stderr, "%s: REFUSED: %s\n", fs.Name(), manifest.Printable(err.Error()))
			wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			if werr := plugin.Withdraw(wctx, client, d.Objects().Node); werr != nil {
				fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), werr)
			}
			cancel()
			return 1
		}
		if !errors.Is(err, kubeletplugin.ErrRecoverable) {
			fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
			return 1
		}
		return 0
	})
}

// serve runs the started plugin's periodic work until ctx ends (0) or failed, given
// one of the plugin's errors, returns an exit code other than 0: Fabric Manager is
// read every plugin.FabricEvery (an FM restarted with --restart is handed its active
// partitions within its 60 s, whatever --reload says), the manifest every reload.
func serve(ctx context.Context, d *plugin.Driver, reload time.Duration, name string, stderr io.Writer, failed func(error) int) int {
	tick := time.NewTicker(reload)
	defer tick.Stop()
	fm := time.NewTicker(plugin.FabricEvery)
	defer fm.Stop()
	for {
		select {
		case <-ctx.Done():
			return 0
		case <-fm.C:
			// What FM's list says of the NVLink partitions is published at once when it
			// changed, not at the next reload.
			off := d.NVLinkOff()
			if d.ResumeFabric(); d.NVLinkOff() != off {
				if err := d.Reload(ctx); err != nil {
					fmt.Fprintf(stderr, "%s: reload: %v\n", name, err)
				}
			}
		case <-tick.C:
			// A manifest that no longer verifies keeps the last published slices; prepare
			// verifies again and refuses on its own. FM first, so that the reload
			// publishes what FM's list says of the NVLink partitions.
			d.ResumeFabric()
			if err := d.Reload(ctx); err != nil {
				fmt.Fprintf(stderr, "%s: reload: %v\n", name, err)
			}
		case err := <-d.Errors():
			if code := failed(err); code != 0 {
				return code
			}
		}
	}
}

// pluginFlags are the plugin's own flags besides its Config.
type pluginFlags struct {
	kubeconfig, registry, dataDir string
	reload                        time.Duration
	turn                          turnFlags
	kubelet                       kubeletFlags
}

// kubeletFlags say how the plugin renews the kubelet's client certificate by
// re-attestation (plugin.KubeletCert).
type kubeletFlags struct {
	lifetime            time.Duration
	certDir, kubeconfig string
	wait                time.Duration
}

func (f *kubeletFlags) register(fs *flag.FlagSet) {
	fs.DurationVar(&f.lifetime, "kubelet-cert-lifetime", 24*time.Hour, "renew the kubelet's client certificate by re-attesting (a new key in a new signed generation, verified by the control plane) for this lifetime (spec.expirationSeconds; kube-controller-manager's --cluster-signing-duration caps it; at least 10m), at 70-90 % of the current one's; 0: no renewal (needs the turnaround's control plane and TPM)")
	fs.StringVar(&f.certDir, "kubelet-cert-dir", kubelet.CertDir, "the kubelet's --cert-dir, mounted at the same path as on the host (the pair's symbolic link names its absolute path)")
	fs.StringVar(&f.kubeconfig, "kubelet-kubeconfig", filepath.Join(kubelet.CertDir, "kubelet.conf"), "the kubelet's --kubeconfig: the renewal's request is the node's, authenticated with its current certificate")
	fs.DurationVar(&f.wait, "kubelet-cert-wait", 5*time.Minute, "bound on the wait for a renewal's request to be approved and issued")
}

func (f *kubeletFlags) check() error {
	if f.lifetime != 0 && f.lifetime < plugin.MinKubeletCertLifetime {
		return fmt.Errorf("--kubelet-cert-lifetime %v: 0 or at least %v (the API server's minimum)", f.lifetime, plugin.MinKubeletCertLifetime)
	}
	if f.wait <= 0 {
		return fmt.Errorf("--kubelet-cert-wait %v: not a period", f.wait)
	}
	return nil
}

// renewer is the kubelet certificate's renewal on d's node, or nil (said on logf) when
// it is off or cannot run.
func (f *kubeletFlags) renewer(d *plugin.Driver, node string, logf func(string, ...any)) *plugin.KubeletCert {
	if f.lifetime == 0 {
		return nil
	}
	if !d.HasTurnaround() {
		logf("kubelet certificate: not renewed: no turnaround (control plane and TPM) to re-attest with")
		return nil
	}
	rc, err := clientcmd.BuildConfigFromFlags("", f.kubeconfig)
	var client kubernetes.Interface
	if err == nil {
		client, err = kubernetes.NewForConfig(rc)
	}
	if err != nil {
		logf("kubelet certificate: not renewed: --kubelet-kubeconfig: %v", err)
		return nil
	}
	if node == "" {
		node = d.Objects().Node
	}
	return &plugin.KubeletCert{Client: client, NodeName: node, CertDir: f.certDir, Lifetime: f.lifetime, Wait: f.wait,
		Attest: d.AttestKubeletKey, Logf: logf}
}

// turnFlags say how the plugin recycles the units it withholds (plugin.Turnaround).
type turnFlags struct {
	on               bool
	url, ca, profile string
	keys             recycle.Keys
	tries            int
	backoff, timeout time.Duration
	poll             time.Duration
}

func (f *turnFlags) register(fs *flag.FlagSet) {
	fs.BoolVar(&f.on, "turnaround", true, "recycle each released unit (erase, reset, a new signed generation, attested to the control plane) and offer it again once the control plane verified it; off: a released unit waits for passage recycle and a newer generation")
	fs.StringVar(&f.url, "passage-url", "", "the control plane's `URL` (default: passage.url= of /proc/cmdline under --root; none: no turnaround)")
	fs.StringVar(&f.ca, "passage-ca", "", "PEM `FILE` of the CA that issued the control plane's certificate (default: the system's roots)")
	fs.StringVar(&f.profile, "profile", "", "role profile the recycle decides with (default: passage.profile= of /proc/cmdline, a path in it beneath --root, else b300); its erase policy, or passage.erase=, is the recycle's")
	fs.StringVar(&f.keys.SigningKey, "signing-key", "/etc/passage/key", "the ed25519 private key `FILE` the recycled generations are signed with beside the TPM key, under --root")
	fs.StringVar(&f.keys.Dir, "run-dir", initramfs.RunDir, "the directory of the manifest the recycle replaces, under --root (the one --manifest is in)")
	fs.StringVar(&f.keys.GenerationFile, "generation-file", "", "file generation counter, when the TPM has none")
	fs.StringVar(&f.keys.TPM, "tpm", "auto", "on or auto: the TPM that signs, counts and attests the recycled generations (the turnaround needs one)")
	fs.IntVar(&f.tries, "recycle-tries", 3, "recycles of a unit before it is quarantined")
	fs.DurationVar(&f.backoff, "recycle-backoff", 30*time.Second, "wait before a unit's second recycle, doubling for each further one (at most 10 minutes)")
	fs.DurationVar(&f.timeout, "recycle-timeout", 30*time.Minute, "bound on one recycle")
	fs.DurationVar(&f.poll, "recycle-poll", 5*time.Second, "how often a released unit still held open, and the Node's "+plugin.ClearAnnotation+" annotation, are looked at")
}

// turnaround is the plugin's Turnaround from the flags and the node's cmdline; nil when
// it is off or there is no control plane to attest to.
func (f *turnFlags) turnaround(root string) (*plugin.Turnaround, error) {
	if !f.on {
		return nil, nil
	}
	var cl initramfs.Config
	if b, err := os.ReadFile(filepath.Join(root, "proc/cmdline")); err == nil {
		cl = initramfs.ParseCmdline(string(b))
	}
	url := f.url
	if url == "" {
		url = cl.URL
	}
	if url == "" {
		return nil, nil
	}
	if f.tries <= 0 || f.backoff <= 0 || f.timeout <= 0 || f.poll <= 0 {
		return nil, fmt.Errorf("--recycle-tries %d, --recycle-backoff %v, --recycle-timeout %v, --recycle-poll %v: each must be positive", f.tries, f.backoff, f.timeout, f.poll)
	}
	if f.keys.TPM == "off" {
		return nil, errors.New("--tpm off: the turnaround attests every recycled generation with the TPM (give --turnaround=false)")
	}
	profile := f.profile
	if profile == "" && cl.Profile != "" {
		profile = cl.Profile
		// passage.profile= names a file of the host's (the boot read it from its
		// initramfs; the host's root must hold it at the same path): beneath --root.
		if topology.ProfileIsFile(profile) {
			profile = filepath.Join(root, profile)
		}
	}
	if profile == "" {
		profile = "b300"
	}
	prof, err := topology.LoadProfile(profile)
	if err != nil {
		return nil, fmt.Errorf("--profile: %w", err)
	}
	pol := cl.Erase
	if pol == "" {
		pol = prof.Erase
	}
	p, err := erase.ParsePolicy(pol)
	if pol != "" && err != nil {
		return nil, fmt.Errorf("erase policy %q: %w", pol, err)
	}
	t := &plugin.Turnaround{URL: url, Keys: f.keys, Profile: profile, Policy: p, Tries: f.tries, Backoff: f.backoff, Timeout: f.timeout, Poll: f.poll}
	if f.ca != "" {
		// A missing CA (the DaemonSet's optional ConfigMap not made) is refused, not
		// replaced with the system's roots: the flag says which CA the operator trusts.
		pem, err := manifest.ReadRegular(f.ca, manifest.MaxKeyFileSize)
		if err != nil {
			return nil, fmt.Errorf("--passage-ca: %w: the turnaround attests to %s and trusts only this CA (the DaemonSet's ConfigMap passage-control-ca, ca.crt); give it, or --turnaround=false", err, url)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--passage-ca %s: no PEM certificate", f.ca)
		}
		t.Client = &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}, TLSHandshakeTimeout: 10 * time.Second}}
	}
	return t, nil
}

// pluginConfig parses the plugin's flags into its Config (the options read after the
// parse); code is 2 when the command is misused.
func pluginConfig(fs *flag.FlagSet, args []string, o *options, stderr io.Writer) (plugin.Config, pluginFlags, int) {
	var cfg plugin.Config
	var p pluginFlags
	fs.StringVar(&cfg.Manifest, "manifest", "", "the node's manifest envelope (manifest.dsse.json), verified again at every prepare and reload")
	fs.StringVar(&cfg.Root, "root", "/", "where the node's sys/ and dev/vfio are (read only)")
	fs.StringVar(&cfg.CDIDir, "cdi-dir", "/var/run/cdi", "where the CDI specs go")
	fs.StringVar(&cfg.HookDir, "hook-dir", "", "write the verified manifest here for passage-hook (KubeVirt's sidecar); a failed export is logged and counted, never a refused claim")
	fs.StringVar(&cfg.MetricsFile, "metrics-file", "", "keep the plugin's counters (passage_dra_hook_export_failures_total) in this `FILE` for node_exporter's textfile collector (a .prom file in its directory)")
	fs.StringVar(&p.kubeconfig, "kubeconfig", "", "kubeconfig file (default: the pod's in-cluster config)")
	fs.StringVar(&p.registry, "registry-dir", kubeletplugin.KubeletRegistryDir, "the kubelet's plugin registration directory")
	fs.StringVar(&p.dataDir, "plugin-dir", filepath.Join(kubeletplugin.KubeletPluginsDir, resources.DriverName), "the plugin's socket and metadata directory")
	fs.DurationVar(&p.reload, "reload", 30*time.Second, "verify the manifest again this often (a recycled unit returns with a newer generation)")
	p.turn.register(fs)
	p.kubelet.register(fs)
	var fm fabricFlags
	fm.register(fs)
	if err := fs.Parse(args); err != nil {
		return cfg, p, 2
	}
	s, err := o.src.source()
	if err == nil && (cfg.Manifest == "" || fs.NArg() != 0) {
		err = errors.New("give --manifest and no arguments")
	}
	if err == nil && p.reload <= 0 {
		err = fmt.Errorf("--reload %v: not a period", p.reload)
	}
	if err == nil {
		err = p.kubelet.check()
	}
	if err == nil {
		cfg.Turnaround, err = p.turn.turnaround(cfg.Root)
	}
	if err == nil && fm.on() {
		var fo fabricmanager.Options
		if fo, err = fm.options(); err == nil {
			cfg.Fabric, err = fabricmanager.New(p.dataDir, fo)
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
		return cfg, p, 2
	}
	cfg.Source, cfg.Options, cfg.StateDir = s, o.res, p.dataDir
	return cfg, p, 0
}

// fabricFlags say where NVIDIA Fabric Manager is (package fabric). The plugin drives it
// when any is given; fabric check reads FM's defaults when none is.
type fabricFlags struct {
	lib, socket, address string
}

func (f *fabricFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.lib, "fm-lib", "", "Fabric Manager's client library `FILE` (default "+fabricmanager.DefaultLibrary+" from the loader's path); the plugin activates each claim's NVLink partition when an --fm- flag is given")
	fs.StringVar(&f.socket, "fm-socket", "", "FM's unix socket `PATH` (its FM_CMD_UNIX_SOCKET_PATH, "+fabricmanager.DefaultSocket+" as the NVIDIA DRA driver sets it)")
	fs.StringVar(&f.address, "fm-address", "", "FM's `IPV4:PORT` (default "+fabricmanager.DefaultAddress+", FM's own)")
}

func (f *fabricFlags) on() bool { return f.lib != "" || f.socket != "" || f.address != "" }

func (f *fabricFlags) options() (fabricmanager.Options, error) {
	if f.socket != "" && f.address != "" {
		return fabricmanager.Options{}, errors.New("give one of --fm-socket and --fm-address")
	}
	return fabricmanager.Options{Library: f.lib, Socket: f.socket, Address: f.address}, nil
}

// cmdFabricCheck holds FM's partition list to the verified manifest (fabricmanager.Check):
// each mismatch is printed, and any is exit 1; so is FM out of reach.
func cmdFabricCheck(fs *flag.FlagSet, args []string, o *options, stdout, stderr io.Writer) int {
	var fm fabricFlags
	fm.register(fs)
	smi := fs.String("nvidia-smi", "", "also hold each unit's Module ID to the NVIDIA driver's: nvidia-smi -q's output `FILE`, captured on this node before its GPUs went to vfio-pci")
	v, code := verified(fs, args, &o.src, stderr)
	if v == nil {
		return code
	}
	var gpus []topology.NVSMIGPU
	if *smi != "" {
		var err error
		if gpus, err = readNVSMI(*smi); err != nil {
			fmt.Fprintf(stderr, "%s: --nvidia-smi %s: %v\n", fs.Name(), *smi, err)
			return 2
		}
	}
	fo, err := fm.options()
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
		return 2
	}
	c, err := fabricmanager.Open(fo)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
		return 1
	}
	defer c.Close()
	ps, err := c.Partitions()
	if err != nil {
		if r, ok := fabricmanager.Code(err); ok && r == fabricmanager.FM_ST_NOT_CONFIGURED {
			err = fmt.Errorf("%w: FM restarted and waits for its active partitions (passage-dra plugin hands them over)", err)
		}
		fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
		return 1
	}
	m := v.Manifest
	mismatches := fabricmanager.Check(fabricmanager.LayoutOf(m), ps)
	if *smi != "" {
		mismatches = append(mismatches, fabricmanager.CheckMap(m, gpus)...)
	}
	for _, l := range mismatches {
		fmt.Fprintln(stdout, manifest.Printable(l))
	}
	if len(mismatches) > 0 {
		fmt.Fprintf(stderr, "%s: %d mismatches between FM's %d partitions and manifest generation %d of node %s\n",
			fs.Name(), len(mismatches), len(ps), m.Generation, manifest.Printable(m.Node.Hostname))
		return 1
	}
	// What agreeing proves, said where the operator reads it: FM names members by
	// physicalId with the PCI fields zeroed on H100 and later (NVLINK.md §0.2), so any
	// permutation of the module map agrees; and a list is read in every FABRIC_MODE.
	fmt.Fprintf(stdout, "FM's %d partitions and manifest generation %d of node %s agree: the %d units' Module IDs are distinct and each in FM's list, FM's module sets are the declared layout, no NVLink down\n",
		len(ps), m.Generation, manifest.Printable(m.Node.Hostname), len(m.Units))
	if *smi != "" {
		fmt.Fprintf(stdout, "each unit's GPU is the module the NVIDIA driver reported for it (%s)\n", manifest.Printable(*smi))
		fmt.Fprintln(stdout, "not checked: that FM runs FABRIC_MODE=1 (nothing is activated: the first claim's activation is)")
	} else {
		fmt.Fprintln(stdout, "not checked: which GPU is which module (FM reports Module IDs only; the map is the profile's modules:, from passage-dra fabric modules; --nvidia-smi holds it to the driver's), nor that FM runs FABRIC_MODE=1 (nothing is activated: the first claim's activation is)")
	}
	return 0
}

// cmdFabricModules prints the SKU profile's modules: stanza from nvidia-smi -q's text
// (topology.ParseNVSMI): the NVIDIA driver's own Module ID of each GPU, the one source
// that knows it, read on the first node of a SKU while its GPUs are still on nvidia.
// A GPU the driver gives no Module ID is named on stderr and left out (exit 1).
func cmdFabricModules(fs *flag.FlagSet, args []string, stdout, stderr io.Writer) int {
	file := fs.String("nvidia-smi", "", "nvidia-smi -q's output `FILE` (- for stdin)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *file == "" || fs.NArg() != 0 {
		fmt.Fprintf(stderr, "%s: give --nvidia-smi FILE and no arguments\n", fs.Name())
		return 2
	}
	gpus, err := readNVSMI(*file)
	if err == nil {
		var stanza []byte
		var unknown []pci.Address
		if stanza, unknown, err = topology.ModulesStanza(gpus, "nvidia-smi -q, "+*file); err == nil {
			stdout.Write(stanza)
			for _, a := range unknown {
				fmt.Fprintf(stderr, "%s: GPU %s: the driver gives no Module ID (N/A or none): left out of the stanza\n", fs.Name(), a)
			}
			if len(unknown) > 0 {
				return 1
			}
			return 0
		}
	}
	fmt.Fprintf(stderr, "%s: %s: %v\n", fs.Name(), *file, err)
	return 1
}

// readNVSMI reads and parses nvidia-smi -q's text from file ("-": stdin), at most
// topology.MaxNVSMI bytes.
func readNVSMI(file string) ([]topology.NVSMIGPU, error) {
	var b []byte
	var err error
	if file == "-" {
		b, err = io.ReadAll(io.LimitReader(os.Stdin, topology.MaxNVSMI+1))
	} else {
		b, err = manifest.ReadRegular(file, topology.MaxNVSMI)
	}
	if err != nil {
		return nil, err
	}
	return topology.ParseNVSMI(b)
}
