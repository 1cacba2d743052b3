// Package plugin is the node side of the DRA driver: a kubelet plugin
// (k8s.io/dynamic-resource-allocation/kubeletplugin) that publishes the verified
// manifest's units as ResourceSlices, and prepares a claim only while its functions are
// still the manifest's and still on vfio-pci: it then writes the CDI spec that gives the
// pod the functions' /dev/vfio/<group> nodes, and the helper writes the KEP-5304 device
// metadata KubeVirt's virt-launcher reads the PCI address from. A unit whose claim is
// released is withheld until a newer signed generation says it is ready again (after
// passage recycle), so it is never offered between two tenants unrecycled.
package plugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

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

	"github.com/passage-boot/passage/dra/resources"
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
	// StateDir keeps the withheld units (withheld.json) across restarts of the plugin:
	// a unit released before a restart stays withheld until a newer generation. "": in
	// memory only.
	StateDir string
	// HookDir, when set, receives the verified manifest, its key and the node's UUID
	// for the KubeVirt hook (exportHook) at every successful verification.
	HookDir string
}

// withheldFile is the withheld units in StateDir: unit -> the generation it was released
// under.
const withheldFile = "withheld.json"

// MaxFile bounds every file the plugin reads back (withheld.json, the claims' CDI
// specs), and so every file it writes: one it could not read again would wedge the
// node (a restart refused, a claim never released).
const MaxFile = 1 << 20

// Driver is the plugin's state: the verified manifest's objects and the withheld units.
type Driver struct {
	cfg    Config
	mu     sync.Mutex
	v      *manifest.Verified
	objs   *resources.Objects
	held   map[string]uint64 // unit -> the generation it was released under
	helper *kubeletplugin.Helper
	cdi    *cdi.Cache
	errs   chan error
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
	d := &Driver{cfg: cfg, held: map[string]uint64{}, cdi: c, errs: make(chan error, 16)}
	if err := d.readHeld(); err != nil {
		return nil, err
	}
	if err := d.load(); err != nil {
		return nil, err
	}
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

// load verifies the manifest again and renders it without the withheld units; a unit
// withheld under a generation older than the manifest's is offered again (the node was
// recycled and signed it ready).
func (d *Driver) load() error {
	v, err := resources.Verify(d.cfg.Manifest, d.cfg.Source)
	if err != nil {
		return err
	}
	if err := d.exportHook(v); err != nil {
		return err
	}
	opts := d.cfg.Options
	opts.Withhold = map[string]bool{}
	released := false
	for u, gen := range d.held {
		if v.Manifest.Generation > gen {
			delete(d.held, u)
			released = true
			continue
		}
		opts.Withhold[u] = true
	}
	if released {
		if err := d.writeHeld(); err != nil {
			return err
		}
	}
	objs, err := resources.Render(v, opts)
	if err != nil {
		return err
	}
	d.v, d.objs = v, objs
	return nil
}

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
	objs := d.Objects()
	return d.helper.PublishResources(ctx, resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		objs.Node: {Slices: toSlices(objs)},
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
	defer d.mu.Unlock()
	out := map[types.UID]kubeletplugin.PrepareResult{}
	// The manifest is read and verified again: prepare holds a claim to what is signed
	// now, not to what was signed when the slices were published.
	if err := d.load(); err != nil {
		for _, c := range claims {
			out[c.UID] = kubeletplugin.PrepareResult{Err: fmt.Errorf("claim %s/%s: %w", c.Namespace, c.Name, err)}
		}
		return out, nil
	}
	for _, c := range claims {
		devs, err := d.prepare(c)
		if err != nil {
			err = fmt.Errorf("claim %s/%s: %w", c.Namespace, c.Name, err)
		}
		out[c.UID] = kubeletplugin.PrepareResult{Devices: devs, Err: err}
	}
	return out, nil
}

func (d *Driver) prepare(c *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	if c.Status.Allocation == nil {
		return nil, errors.New("not allocated")
	}
	byName := map[string]resourceapi.Device{}
	for _, dev := range d.objs.Devices {
		byName[dev.Name] = dev
	}
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
		if r.Pool != d.objs.Node || !ok {
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
	if err := d.cdi.WriteSpec(spec, specName(c.UID)); err != nil {
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

// UnprepareResourceClaims implements kubeletplugin.DRAPlugin: the claim's CDI spec goes,
// and its units are withheld from the slices until a newer generation (idempotent: a
// claim with no spec is done).
func (d *Driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	d.mu.Lock()
	out := map[types.UID]error{}
	changed := false
	for _, c := range claims {
		units, gen, err := d.specUnits(c.UID)
		if err != nil {
			out[c.UID] = fmt.Errorf("claim %s: %w", c.NamespacedName, err)
			continue
		}
		for _, u := range units {
			if cur, ok := d.held[u]; !ok || gen > cur {
				d.held[u] = gen
				changed = true
			}
		}
		out[c.UID] = d.cdi.RemoveSpec(specName(c.UID))
	}
	var err error
	if changed {
		if err = d.writeHeld(); err == nil {
			err = d.load()
		}
	}
	d.mu.Unlock()
	if err == nil && changed {
		err = d.publish(ctx)
	}
	return out, err
}

func (d *Driver) readHeld() error {
	if d.cfg.StateDir == "" {
		return nil
	}
	p := filepath.Join(d.cfg.StateDir, withheldFile)
	b, err := manifest.ReadRegular(p, MaxFile)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err == nil {
		d.held, err = decodeHeld(b)
	}
	if err != nil {
		return fmt.Errorf("withheld units %s: %w (the released units it names would be offered unrecycled: repair or remove it once the node is recycled)", p, err)
	}
	return nil
}

// decodeHeld is withheld.json: a JSON object of unit IDs to generations. Anything else
// (null, another type, an empty unit) is refused at start: a nil map would panic the
// next unprepare, and guessing would offer a released unit again.
func decodeHeld(b []byte) (map[string]uint64, error) {
	var held map[string]uint64
	if err := json.Unmarshal(b, &held); err != nil {
		return nil, err
	}
	if held == nil {
		return nil, errors.New("not a JSON object of units (null)")
	}
	for u := range held {
		if u == "" {
			return nil, errors.New("an empty unit ID")
		}
	}
	return held, nil
}

// writeHeld records the withheld units before they are published without them: a
// restart must not offer a released unit again.
func (d *Driver) writeHeld() error {
	if d.cfg.StateDir == "" {
		return nil
	}
	b, err := json.Marshal(d.held)
	if err == nil && len(b) > MaxFile {
		err = fmt.Errorf("%d bytes, more than the %d the plugin reads back", len(b), MaxFile)
	}
	if err == nil {
		err = manifest.WriteAtomic(d.cfg.StateDir, withheldFile, b)
	}
	if err != nil {
		return fmt.Errorf("withheld units: %w", err)
	}
	return nil
}

// inUse are the devices the CDI specs of claims other than uid hold, by device name.
func (d *Driver) inUse(uid types.UID) (map[string]string, error) {
	specs, err := filepath.Glob(filepath.Join(d.cfg.CDIDir, specPrefix+"*.json"))
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, p := range specs {
		other := types.UID(strings.TrimSuffix(strings.TrimPrefix(filepath.Base(p), specPrefix), ".json"))
		if other == uid {
			continue
		}
		s, err := readSpec(p)
		if err != nil {
			return nil, err
		}
		for _, dev := range strings.Split(s.Annotations[annotationDevices], ",") {
			if dev != "" {
				out[dev] = string(other)
			}
		}
	}
	return out, nil
}

func readSpec(p string) (*cdispec.Spec, error) {
	b, err := manifest.ReadRegular(p, MaxFile)
	if err != nil {
		return nil, err
	}
	var s cdispec.Spec
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("%s: %w", p, err)
	}
	return &s, nil
}

// specUnits reads the units a claim's CDI spec names; none when there is no spec.
func (d *Driver) specUnits(uid types.UID) ([]string, uint64, error) {
	p := filepath.Join(d.cfg.CDIDir, specName(uid))
	s, err := readSpec(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, 0, nil
	}
	if err != nil {
		return nil, 0, err
	}
	gen, err := strconv.ParseUint(s.Annotations[annotationGeneration], 10, 64)
	if err != nil {
		return nil, 0, fmt.Errorf("%s: annotation %s: %w", p, annotationGeneration, err)
	}
	var units []string
	if u := s.Annotations[annotationUnits]; u != "" {
		units = strings.Split(u, ",")
	}
	return units, gen, nil
}

// HandleError implements kubeletplugin.DRAPlugin: background errors are reported on
// Errors (the command exits on one that is not recoverable).
func (d *Driver) HandleError(ctx context.Context, err error, msg string) {
	utilruntime.HandleErrorWithContext(ctx, err, msg)
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
