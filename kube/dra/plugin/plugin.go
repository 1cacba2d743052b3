// Package plugin is the node side of the DRA driver: a kubelet plugin
// (k8s.io/dynamic-resource-allocation/kubeletplugin) that publishes the verified
// manifest's units as ResourceSlices, and prepares a claim only while its functions are
// still the manifest's and still on vfio-pci: it then writes the CDI spec that gives the
// pod the functions' /dev/vfio/<group> nodes, and the helper writes the KEP-5304 device
// metadata KubeVirt's virt-launcher reads the PCI address from. A unit whose claim is
// released is withheld until it is recycled: with Config.Turnaround the plugin recycles
// it itself (turnaround.go) and offers it again only on a generation the control plane
// verified; without, a newer signed generation (after passage recycle) offers it again.
// Either way it is never offered between two tenants unrecycled.
package plugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log"
	"maps"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	metav1alpha1 "k8s.io/dynamic-resource-allocation/api/metadata/v1alpha1"
	metav1beta1 "k8s.io/dynamic-resource-allocation/api/metadata/v1beta1"
	"k8s.io/dynamic-resource-allocation/deviceattribute"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"tags.cncf.io/container-device-interface/pkg/cdi"
	cdispec "tags.cncf.io/container-device-interface/specs-go"

	"github.com/passage-boot/passage/kube/dra/resources"
	"github.com/passage-boot/passage/kube/fabricmanager"
	"github.com/passage-boot/passage/manifest"
	"github.com/passage-boot/passage/pci"
	"github.com/passage-boot/passage/vfiobind"
)

// CDIKind is the CDI vendor/class of the devices the plugin writes: a unit function's
// VFIO group node.
const CDIKind = resources.DriverName + "/unit"

// Annotations the plugin keeps in a claim's CDI spec: what unprepare needs after a
// restart (the units to withhold, at which generation).
const (
	annotationUnits      = resources.DriverName + "/units"
	annotationGeneration = resources.DriverName + "/generation"
	annotationDevices    = resources.DriverName + "/devices"
)

// MetadataVersions are the KEP-5304 metadata versions written for every request, newest
// first: v1beta1 is the helper's latest; v1alpha1 is what KubeVirt v1.9's virt-launcher
// reads (metadata.resource.k8s.io/v1alpha1).
var MetadataVersions = []schema.GroupVersion{metav1beta1.SchemeGroupVersion, metav1alpha1.SchemeGroupVersion}

// Config is what the plugin serves.
type Config struct {
	Manifest string           // the node's manifest envelope (manifest.dsse.json)
	Source   resources.Source // the keys and expectations; NodeUUID is read from Root when empty
	Options  resources.Options
	// Root is where the node's kernel files are: sys/bus/pci, sys/class/dmi, dev/vfio
	// below it ("/" on a node; a synthetic tree in tests). Never written.
	Root string
	// CDIDir is where CDI specs go (/var/run/cdi): the claim's and the helper's
	// metadata ones.
	CDIDir string
	// StateDir keeps the released units and their turnaround (units.json) across
	// restarts of the plugin: a unit released before a restart stays withheld. "": in
	// memory only.
	StateDir string
	// HookDir, when set, receives the verified manifest for the KubeVirt hook
	// (exportHook) at every successful verification.
	HookDir string
	// MetricsFile, when set, is kept holding the plugin's counters for node_exporter's
	// textfile collector (a *.prom file in its directory).
	MetricsFile string
	// Logf reports what the plugin carries on through (an export to HookDir that
	// failed, units.json not pruned, each turnaround's steps); nil: the standard logger.
	Logf func(format string, args ...any)
	// Turnaround, when set, makes the plugin recycle the units it withholds (RunTurnaround).
	Turnaround *Turnaround
	// Fabric, when set, is NVIDIA Fabric Manager in shared NVSwitch mode: a claim is
	// prepared only once FM activated the partition whose members are exactly its
	// units' GPUs (their Module IDs in the manifest), and its units are withheld for the
	// turnaround only once FM deactivated it; one FM would not deactivate leaves them
	// quarantined (StepFabric). NVLink partitions are published only while FM's list
	// agrees with the manifest (nvlinkOffFor). On a node whose manifest knows no Module
	// ID (and whose ledger is empty) FM is never opened. nil: no FM, claims are prepared
	// without a partition and no NVLink partition is published.
	Fabric *fabricmanager.Fabric
}

// MaxFile bounds every file the plugin reads back (units.json, the claims' CDI
// specs), and so every file it writes: one it could not read again would wedge the
// node (a restart refused, a claim never released).
const MaxFile = 1 << 20

// Driver is the plugin's state: the verified manifest's objects and the withheld units.
type Driver struct {
	cfg  Config
	mu   sync.Mutex
	v    *manifest.Verified
	objs *resources.Objects // published: the ready units no claim holds and none withheld
	// devs are the devices a claim may be prepared with, by name: the published ones and
	// those of units prepared claims hold (prepare is idempotent: the kubelet may ask
	// again for a claim it prepared).
	devs   map[string]resourceapi.Device
	units  *units // the released units and their turnaround
	helper *kubeletplugin.Helper
	cdi    *cdi.Cache
	errs   chan error
	// exportFailures counts the hook-dir exports that failed (HookExportFailures).
	exportFailures atomic.Uint64
	turn           turnState
	// fabricSaid is what ResumeFabric logged last.
	fabricSaid string
	// fmParts is FM's partition list as ResumeFabric last read it (nil: not read, or
	// FM out of reach: fmErr says why); nvlinkOff is why the rendered objects carry no
	// NVLink partition (resources.Options.NoNVLink, from nvlinkOffFor), "" when they
	// do. nvlinkSaid is the reason ResumeFabric last logged.
	fmParts    []fabricmanager.Partition
	fmErr      error
	nvlinkOff  string
	nvlinkSaid string
}

// New verifies the manifest and renders its objects; nothing is published yet.
func New(cfg Config) (*Driver, error) {
	if cfg.Root == "" {
		cfg.Root = "/"
	}
	if cfg.Source.NodeUUID == "" {
		n, err := manifest.ReadNode(cfg.Root)
		if err != nil {
			return nil, err
		}
		if n.DMIUUID == "" {
			return nil, fmt.Errorf("%s: no DMI product UUID: the plugin cannot tell this node's manifest from another's", filepath.Join(cfg.Root, "sys/class/dmi/id/product_uuid"))
		}
		cfg.Source.NodeUUID = n.DMIUUID
	}
	if cfg.Options.PCIeRoot == nil {
		cfg.Options.PCIeRoot = PCIeRoot(filepath.Join(cfg.Root, "sys"))
	}
	c, err := cdi.NewCache(cdi.WithSpecDirs(cfg.CDIDir), cdi.WithAutoRefresh(false))
	if err != nil {
		return nil, fmt.Errorf("cdi %s: %w", cfg.CDIDir, err)
	}
	d := &Driver{cfg: cfg, cdi: c, errs: make(chan error, 16)}
	if err := d.readUnits(); err != nil {
		return nil, err
	}
	if err := d.initTurnaround(); err != nil {
		return nil, err
	}
	if err := d.load(); err != nil {
		return nil, err
	}
	d.ResumeFabric()
	return d, nil
}

// PCIeRoot reads a function's PCIe root complex from the sysfs at sys (the node's /sys)
// as deviceattribute does: the first element of its device path (pci0000:15).
func PCIeRoot(sys string) func(bdf string) (string, error) {
	return func(bdf string) (string, error) {
		a, err := deviceattribute.GetPCIeRootAttributeByPCIBusID(bdf, deviceattribute.WithFSFromRoot(sys))
		if err != nil {
			return "", err
		}
		return *a.Value.StringValue, nil
	}
}

// load verifies the manifest again and renders it without the withheld units and
// without the units prepared claims hold. Without a turnaround, a unit withheld under a
// generation older than the manifest's is offered again (the node was recycled and
// signed it ready); with one, only the turnaround lets a unit go, once the control plane
// verified its recycle.
func (d *Driver) load() error {
	v, err := resources.Verify(d.cfg.Manifest, d.cfg.Source)
	if err != nil {
		return err
	}
	// The hook verifies what it is given on its own (and refuses a VM without it): an
	// export that cannot be written (a full disk, a directory planted in a file's
	// place) is the hook's loss, reported and counted, and must not refuse every claim
	// on the node.
	if err := d.exportHook(v); err != nil {
		n := d.exportFailures.Add(1)
		d.logf("hook dir %s: export of manifest generation %d failed (%d failures so far): %v", d.cfg.HookDir, v.Manifest.Generation, n, err)
		d.writeMetrics()
	}
	if d.cfg.Turnaround != nil {
		return d.render(v)
	}
	held := d.units.clone()
	released := false
	for u, s := range held.Units {
		if v.Manifest.Generation > s.Generation {
			if s.State == StateQuarantined && s.Step == StepFabric && d.fabricHolds(v.Manifest, u) {
				continue // its NVLink partition may still be active: not offered
			}
			delete(held.Units, u)
			released = true
		}
	}
	if released {
		// Pruning is not a record anything depends on: an entry left in the file is
		// older than the manifest, so a restart lets it go again. A failed write is
		// reported, not a refused verification.
		if err := d.writeUnits(held); err != nil {
			d.logf("%v: not pruned of the units manifest generation %d offered again", err, v.Manifest.Generation)
		}
	}
	d.units = held
	return d.render(v)
}

// render sets the objects of v: its units without the released ones (d.units) are what
// a claim may be prepared with, and without those prepared claims hold (their CDI specs)
// what is published; a quarantined unit is published with its taint (never prepared). A prepared unit is not offered: whoever holds it has not let it go,
// and a unit whose unprepare has not completed (its withheld record not yet written)
// must not reach the next tenant, even from a restarted plugin.
func (d *Driver) render(v *manifest.Verified) error {
	specs, err := d.specs()
	if err != nil {
		return err
	}
	opts := d.cfg.Options
	opts.Withhold = d.units.held()
	opts.NoNVLink = d.nvlinkOffFor(v)
	all, err := resources.Render(v, opts)
	if err != nil {
		return err
	}
	for _, s := range specs {
		for _, u := range s.units {
			opts.Withhold[u] = true
		}
	}
	// Published only what prepare may accept (unmatched); prepare refuses them itself.
	for u := range d.unmatched(v.Manifest) {
		opts.Withhold[u] = true
	}
	opts.Taints = d.quarantineTaints()
	objs, err := resources.Render(v, opts)
	if err != nil {
		return err
	}
	d.devs = map[string]resourceapi.Device{}
	for _, dev := range all.Devices {
		d.devs[dev.Name] = dev
	}
	d.v, d.objs, d.nvlinkOff = v, objs, opts.NoNVLink
	d.writeMetrics()
	return nil
}

func (d *Driver) logf(format string, args ...any) {
	if d.cfg.Logf != nil {
		d.cfg.Logf(format, args...)
		return
	}
	log.Printf(format, args...)
}

// HookExportFailures is how many exports to Config.HookDir have failed since the
// plugin started.
func (d *Driver) HookExportFailures() uint64 { return d.exportFailures.Load() }

// Objects are what the plugin publishes now.
func (d *Driver) Objects() *resources.Objects {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.objs
}

// Errors are the helper's background errors (publishing slices, the gRPC servers).
func (d *Driver) Errors() <-chan error { return d.errs }

// Start starts the kubelet plugin (registration and DRA gRPC services, the slice
// publisher) with the helper's options (KubeClient, NodeName, directories) and
// publishes the slices.
func (d *Driver) Start(ctx context.Context, opts ...kubeletplugin.Option) error {
	opts = append([]kubeletplugin.Option{
		kubeletplugin.DriverName(resources.DriverName),
		kubeletplugin.NodeName(d.Objects().Node),
		kubeletplugin.EnableDeviceMetadata(true, MetadataVersions),
		kubeletplugin.CDIDirectory(d.cfg.CDIDir),
		// No health reporting: the manifest's verdict is the unit's health.
		kubeletplugin.HealthService(false),
	}, opts...)
	h, err := kubeletplugin.Start(ctx, d, opts...)
	if err != nil {
		return err
	}
	d.helper = h
	return d.publish(ctx)
}

// Stop stops the plugin.
func (d *Driver) Stop() {
	if d.helper != nil {
		d.helper.Stop()
	}
}

func (d *Driver) publish(ctx context.Context) error {
	if d.helper == nil {
		return nil // not started: nothing published yet, Start publishes what is rendered then
	}
	objs := d.Objects()
	return d.helper.PublishResources(ctx, resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		objs.Pool: {Slices: toSlices(objs)},
	}})
}

func toSlices(o *resources.Objects) []resourceslice.Slice {
	var out []resourceslice.Slice
	for _, s := range o.Slices {
		out = append(out, resourceslice.Slice{Devices: s.Spec.Devices})
	}
	return out
}

// Reload verifies the manifest file again (a newer generation after recycle) and
// republishes.
func (d *Driver) Reload(ctx context.Context) error {
	d.mu.Lock()
	err := d.load()
	d.mu.Unlock()
	if err != nil {
		return err
	}
	return d.publish(ctx)
}

// PrepareResourceClaims implements kubeletplugin.DRAPlugin: each claim's devices of this
// driver are checked against the manifest verified now and the kernel's files, then
// exposed through a CDI spec; a claim that fails a check is refused with the reason.
func (d *Driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	d.mu.Lock()
	out := map[types.UID]kubeletplugin.PrepareResult{}
	// The manifest is read and verified again: prepare holds a claim to what is signed
	// now, not to what was signed when the slices were published.
	if err := d.load(); err != nil {
		d.mu.Unlock()
		for _, c := range claims {
			out[c.UID] = kubeletplugin.PrepareResult{Err: fmt.Errorf("claim %s/%s: %w", c.Namespace, c.Name, err)}
		}
		return out, nil
	}
	prepared := false
	for _, c := range claims {
		devs, err := d.prepare(c)
		if err != nil {
			err = fmt.Errorf("claim %s/%s: %w", c.Namespace, c.Name, err)
		} else {
			prepared = true
		}
		out[c.UID] = kubeletplugin.PrepareResult{Devices: devs, Err: err}
	}
	// The prepared units leave the slices once their specs are written. A failure here
	// leaves them published a while longer, which offers nothing: prepare refuses a
	// device another claim's spec holds, and the next reload publishes again.
	var err error
	if prepared {
		err = d.render(d.v)
	}
	d.mu.Unlock()
	if prepared && err == nil {
		err = d.publish(ctx)
	}
	if err != nil {
		d.logf("slices after prepare: %v", err)
	}
	return out, nil
}

func (d *Driver) prepare(c *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	if c.Status.Allocation == nil {
		return nil, errors.New("not allocated")
	}
	byName := d.devs
	// The last line of defence against one function in two claims (kubeletplugin's
	// DRAPlugin contract): the devices other claims' CDI specs hold.
	inUse, err := d.inUse(c.UID)
	if err != nil {
		return nil, err
	}
	spec := &cdispec.Spec{
		Version: cdispec.CurrentVersion,
		Kind:    CDIKind,
		// The container (virt-launcher's compute) opens the VFIO container first.
		ContainerEdits: cdispec.ContainerEdits{DeviceNodes: []*cdispec.DeviceNode{{Path: "/dev/vfio/vfio"}}},
	}
	var out []kubeletplugin.Device
	var errs []error
	// claimed are the claim's devices of each unit, by device name; seen the request
	// each device was allocated to.
	claimed := map[string]map[string]bool{}
	seen := map[string]string{}
	var names []string
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver != resources.DriverName {
			continue
		}
		dev, ok := byName[r.Device]
		if r.Pool != d.objs.Pool || !ok {
			errs = append(errs, fmt.Errorf("request %s: device %s/%s is not offered by manifest generation %d of node %s (not ready, withheld for recycle, or another node's)",
				r.Request, r.Pool, r.Device, d.v.Manifest.Generation, d.objs.Node))
			continue
		}
		bdf, group := *dev.Attributes[resources.AttrPCIBusID].StringValue, int(*dev.Attributes[resources.AttrIOMMUGroup].IntValue)
		if first, dup := seen[r.Device]; dup {
			errs = append(errs, fmt.Errorf("requests %s and %s: function %s (device %s) allocated twice in one claim", first, r.Request, bdf, r.Device))
			continue
		}
		seen[r.Device] = r.Request
		unit := *dev.Attributes[resources.AttrUnit].StringValue
		if claimed[unit] == nil {
			claimed[unit] = map[string]bool{}
		}
		claimed[unit][r.Device] = true
		if other, ok := inUse[r.Device]; ok {
			errs = append(errs, fmt.Errorf("request %s: device %s is prepared for claim %s", r.Request, r.Device, other))
			continue
		}
		if err := d.checkFunction(bdf, group); err != nil {
			errs = append(errs, fmt.Errorf("request %s: device %s: %w", r.Request, r.Device, err))
			continue
		}
		names = append(names, r.Device)
		name := cdiName(c.UID, r.Request)
		spec.Devices = append(spec.Devices, cdispec.Device{Name: name, ContainerEdits: cdispec.ContainerEdits{
			DeviceNodes: []*cdispec.DeviceNode{{Path: "/" + vfiobind.VFIODevNode(group)}},
		}})
		attrs := map[string]resourceapi.DeviceAttribute{}
		for k, a := range dev.Attributes {
			attrs[string(k)] = a
		}
		out = append(out, kubeletplugin.Device{
			Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device,
			CDIDeviceIDs: []string{CDIKind + "=" + name},
			Metadata:     &kubeletplugin.DeviceMetadata{Attributes: attrs},
		})
	}
	errs = append(errs, d.wholeUnits(claimed)...)
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	ids := slices.Sorted(maps.Keys(claimed))
	spec.Annotations = map[string]string{
		annotationUnits:      strings.Join(ids, ","),
		annotationGeneration: strconv.FormatUint(d.v.Manifest.Generation, 10),
		annotationDevices:    strings.Join(names, ","),
	}
	// The spec is read back (inUse, specUnits) under MaxFile: one larger is refused
	// here, not found unreadable at the next prepare or unprepare.
	if b, err := json.Marshal(spec); err != nil {
		return nil, fmt.Errorf("cdi spec: %w", err)
	} else if len(b) > MaxFile {
		return nil, fmt.Errorf("cdi spec: %d bytes, more than the %d the plugin reads back", len(b), MaxFile)
	}
	// The partition is the claim's before the claim is answered; a spec that is then not
	// written gives it back.
	f := d.fabric()
	if f != nil {
		if err := d.activate(f, c.UID, ids); err != nil {
			return nil, err
		}
	}
	if err := d.cdi.WriteSpec(spec, specName(c.UID)); err != nil {
		if f != nil {
			if ferr := f.Deactivate(string(c.UID)); ferr != nil {
				d.logf("claim %s: refused, its NVLink partition not released yet (the next reload asks again): %v", c.UID, ferr)
			}
		}
		return nil, fmt.Errorf("cdi spec: %w", err)
	}
	return out, nil
}

// wholeUnits holds a claim to the whole-unit rule itself rather than trusting the
// scheduler's matchAttribute: every unit the claim has a function of is offered whole to
// it. A unit with a function left out (a partial unit, or functions of two units mixed)
// is refused naming the functions claimed and those missing.
func (d *Driver) wholeUnits(claimed map[string]map[string]bool) []error {
	if len(claimed) == 0 {
		return nil
	}
	ids := slices.Sorted(maps.Keys(claimed))
	var errs []error
	for _, u := range ids {
		var got, missing []string
		for _, dev := range d.objs.Devices {
			if *dev.Attributes[resources.AttrUnit].StringValue != u {
				continue
			}
			bdf := *dev.Attributes[resources.AttrPCIBusID].StringValue
			if claimed[u][dev.Name] {
				got = append(got, bdf)
			} else {
				missing = append(missing, bdf)
			}
		}
		if len(missing) == 0 {
			continue
		}
		mixed := ""
		if len(ids) > 1 {
			mixed = fmt.Sprintf(" (the claim mixes units %s)", strings.Join(ids, ", "))
		}
		errs = append(errs, fmt.Errorf("unit %s is not claimed whole%s: functions %s claimed, %s not",
			u, mixed, strings.Join(got, " "), strings.Join(missing, " ")))
	}
	return errs
}

// checkFunction holds a function to the kernel's files now: present, bound to vfio-pci,
// in the manifest's IOMMU group, its group's VFIO node there.
func (d *Driver) checkFunction(bdf string, group int) error {
	a, err := pci.ParseAddress(bdf)
	if err != nil {
		return err
	}
	sys := vfiobind.Root(d.cfg.Root)
	dev := path.Join(pci.DevicesDir, a.String())
	if err := sys.Stat(dev); err != nil {
		return fmt.Errorf("function %s is not on the bus: %w", bdf, err)
	}
	drv, err := sys.ReadLink(path.Join(dev, "driver"))
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("function %s is bound to no driver, not %s", bdf, vfiobind.VFIODriver)
	case err != nil:
		return fmt.Errorf("function %s: driver: %w", bdf, err)
	case path.Base(filepath.ToSlash(drv)) != vfiobind.VFIODriver:
		return fmt.Errorf("function %s left %s: it is bound to %s", bdf, vfiobind.VFIODriver, path.Base(filepath.ToSlash(drv)))
	}
	g, err := sys.ReadLink(path.Join(dev, "iommu_group"))
	if err != nil {
		return fmt.Errorf("function %s: iommu_group: %w", bdf, err)
	}
	if got := path.Base(filepath.ToSlash(g)); got != strconv.Itoa(group) {
		return fmt.Errorf("function %s is in IOMMU group %s, the manifest says %d", bdf, got, group)
	}
	if err := sys.Stat(vfiobind.VFIODevNode(group)); err != nil {
		return fmt.Errorf("function %s: /%s: %w", bdf, vfiobind.VFIODevNode(group), err)
	}
	return nil
}

// UnprepareResourceClaims implements kubeletplugin.DRAPlugin: the claim's units are
// recorded as withheld until a newer generation, and only then does its CDI spec go
// (idempotent: a claim with no spec is done). A record that cannot be written lets go of
// nothing: the claim stays prepared, its units out of the slices, and the kubelet's
// retry records them again.
func (d *Driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	d.mu.Lock()
	// The manifest is verified again, as prepare does, for the newest generation signed:
	// one signed since the last reload (another unit's recycle) must not let go of the
	// units released now. If it does not verify now, they are withheld under the
	// generation verified last.
	if err := d.load(); err != nil {
		d.logf("unprepare: %v: released units are withheld under generation %d, the one verified last", err, d.v.Manifest.Generation)
	}
	out := map[types.UID]error{}
	held := d.units.clone()
	changed := false
	var release []kubeletplugin.NamespacedObject
	type fabricHeld struct {
		claim string
		units []string
		err   error
	}
	var quarantined []fabricHeld
	for _, c := range claims {
		s, err := d.spec(c.UID)
		if err != nil {
			out[c.UID] = fmt.Errorf("claim %s: %w", c.NamespacedName, err)
			continue
		}
		out[c.UID] = nil
		if s == nil {
			continue
		}
		// Withheld under the newest generation the plugin knows, not only the one the
		// claim was prepared under: a generation signed while the tenant held the unit
		// (another unit's recycle) says nothing of this one.
		gen := s.gen
		if d.v.Manifest.Generation > gen {
			gen = d.v.Manifest.Generation
		}
		// The guest is gone (the kubelet unprepares once the pod's containers are):
		// its NVLink partition is deactivated before its units go to the turnaround,
		// which resets them. A partition FM will not deactivate keeps them quarantined:
		// nothing resets or offers GPUs FM may still route NVLink traffic to.
		fresh := UnitState{Generation: gen, State: StateWithheld}
		if d.cfg.Fabric != nil {
			if err := d.cfg.Fabric.Deactivate(string(c.UID)); err != nil {
				fresh.State, fresh.Step, fresh.LastError = StateQuarantined, StepFabric, lastError(err)
				quarantined = append(quarantined, fabricHeld{string(c.UID), s.units, err})
			}
		}
		for _, u := range s.units {
			if cur, ok := held.Units[u]; !ok {
				st := fresh
				held.Units[u] = &st
				changed = true
			} else {
				if gen > cur.Generation {
					cur.Generation = gen
					changed = true
				}
				if fresh.State == StateQuarantined && cur.State != StateQuarantined {
					cur.State, cur.Step, cur.LastError, cur.NextTry = fresh.State, fresh.Step, fresh.LastError, nil
					changed = true
				}
			}
		}
		release = append(release, c)
	}
	if changed {
		if err := d.writeUnits(held); err != nil {
			for _, c := range release {
				out[c.UID] = fmt.Errorf("claim %s: %w: the claim stays prepared until its units are recorded withheld", c.NamespacedName, err)
			}
			d.mu.Unlock()
			return out, nil
		}
		d.units = held
		d.kickTurnaround()
	}
	for _, c := range release {
		if err := d.cdi.RemoveSpec(specName(c.UID)); err != nil {
			out[c.UID] = fmt.Errorf("claim %s: %w", c.NamespacedName, err)
		}
	}
	// The slices from the manifest verified last: a released unit stays out whether or
	// not the manifest verifies now.
	var err error
	if len(release) > 0 {
		err = d.render(d.v)
	}
	d.mu.Unlock()
	if err == nil && len(release) > 0 {
		err = d.publish(ctx)
	}
	for _, q := range quarantined {
		d.quarantineFabric(ctx, q.claim, q.units, q.err)
	}
	return out, err
}

// claimSpec is what a claim's CDI spec records for the plugin: the units it holds, the
// generation it was prepared under and its devices.
type claimSpec struct {
	uid            types.UID
	units, devices []string
	gen            uint64
}

// specs are the claims prepared on the node: the plugin's CDI specs in CDIDir. One that
// cannot be read is an error naming it: the units it holds are unknown, and guessing
// none would offer them.
func (d *Driver) specs() ([]*claimSpec, error) {
	paths, err := filepath.Glob(filepath.Join(d.cfg.CDIDir, specPrefix+"*.json"))
	if err != nil {
		return nil, err
	}
	var out []*claimSpec
	for _, p := range paths {
		uid := types.UID(strings.TrimSuffix(strings.TrimPrefix(filepath.Base(p), specPrefix), ".json"))
		s, err := readClaimSpec(p, uid)
		if errors.Is(err, fs.ErrNotExist) {
			continue // unprepared since the glob
		}
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, nil
}

// spec is the claim's CDI spec; nil when there is none.
func (d *Driver) spec(uid types.UID) (*claimSpec, error) {
	s, err := readClaimSpec(filepath.Join(d.cfg.CDIDir, specName(uid)), uid)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	return s, err
}

// inUse are the devices the CDI specs of claims other than uid hold, by device name.
func (d *Driver) inUse(uid types.UID) (map[string]string, error) {
	specs, err := d.specs()
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, s := range specs {
		if s.uid == uid {
			continue
		}
		for _, dev := range s.devices {
			out[dev] = string(s.uid)
		}
	}
	return out, nil
}

func readClaimSpec(p string, uid types.UID) (*claimSpec, error) {
	b, err := manifest.ReadRegular(p, MaxFile)
	if err != nil {
		return nil, err
	}
	var s cdispec.Spec
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("%s: %w", p, err)
	}
	gen, err := strconv.ParseUint(s.Annotations[annotationGeneration], 10, 64)
	if err != nil {
		return nil, fmt.Errorf("%s: annotation %s: %w", p, annotationGeneration, err)
	}
	return &claimSpec{uid: uid, units: split(s.Annotations[annotationUnits]), devices: split(s.Annotations[annotationDevices]), gen: gen}, nil
}

func split(list string) []string {
	if list == "" {
		return nil
	}
	return strings.Split(list, ",")
}

// HandleError implements kubeletplugin.DRAPlugin: background errors are reported on
// Errors (the command exits on one that is not recoverable). The helper calls every
// publishing error recoverable; a slice stored without its quarantine taints is not
// (taintsDropped): the plugin must not go on as if the taint held, and that error is
// never dropped for a full channel.
func (d *Driver) HandleError(ctx context.Context, err error, msg string) {
	utilruntime.HandleErrorWithContext(ctx, err, msg)
	if terr := taintsDropped(err); terr != nil {
		e := fmt.Errorf("%s: %w", msg, terr)
		select {
		case d.errs <- e:
		default:
			go func() { d.errs <- e }()
		}
		return
	}
	select {
	case d.errs <- fmt.Errorf("%s: %w", msg, err):
	default:
	}
}

// WatchHealthStatus implements kubeletplugin.DRAPlugin; the service is off (Start).
func (d *Driver) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}

// specName is the claim's CDI spec file (without .json); cdiName its request's device:
// the claim UID keeps a runtime's cached spec from matching a later claim.
func specName(uid types.UID) string { return specPrefix + string(uid) + ".json" }

var specPrefix = strings.ReplaceAll(resources.DriverName, ".", "_") + "_unit_"

func cdiName(uid types.UID, request string) string {
	return string(uid) + "-" + request
}
