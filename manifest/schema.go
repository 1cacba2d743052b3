// Package manifest is the signed record the hypervisor trusts: what passage found and did
// on one boot of one node. It owns the schema (versioned, documented in SCHEMA.md), the
// canonical encoding and its digest, DSSE signing and verification, the atomic write, the
// generation counter and the measurement event log. It does not scan or bind: the boot
// stages fill the plain data types below.
//
// The schema is deliberately plain Go data (strings, numbers, slices) so this package
// depends on no other package of the project but buildinfo (a leaf that reads the
// binary's own build); the stages convert their own types into it.
package manifest

import (
	"encoding/json"
	"time"

	"github.com/passage-boot/passage/buildinfo"
)

// SchemaVersion is the version this package writes. Any change to the payload's fields,
// their meaning or their encoding bumps it.
const SchemaVersion = 6 // 6 added node.kubelet_key; 5 units[].module_id, module_source and nvlink; 4 units[].functions[].bars; 3 build and image_plan

// OldestSchemaVersion is the oldest version Verify still accepts: a hypervisor upgraded
// before its nodes must go on accepting what their previous image signs, for one
// release. Schema 5 is schema 6 without node.kubelet_key; schema 4 is schema 5 without
// units' module_id and module_source and without nvlink; schema 3 is schema 4 without functions' bars; schema 2 is schema 3 without
// build and image_plan.
const OldestSchemaVersion = 2

// PayloadType is the DSSE payloadType of a passage manifest.
const PayloadType = "application/vnd.passage.manifest+json"

// GenerationSource says where Manifest.Generation came from.
type GenerationSource string

const (
	// GenerationTPMNV: a TPM NV counter index (TPM_NT_COUNTER), monotonic in hardware.
	GenerationTPMNV GenerationSource = "tpm-nv"
	// GenerationFile: a counter file on persistent storage.
	GenerationFile GenerationSource = "file"
	// GenerationNone: no persistent counter was available; Generation is 0 and a
	// verifier cannot use it to reject replays.
	GenerationNone GenerationSource = "none"
)

// Unit and stage statuses.
const (
	StatusReady    = "ready"
	StatusDegraded = "degraded"
	StatusFailed   = "failed"
)

// Manifest is the payload of the DSSE envelope. Field order is the JSON key order: it is
// part of the schema, so do not reorder fields without bumping SchemaVersion.
type Manifest struct {
	SchemaVersion int `json:"schema_version"`
	// Build is the passage build that decided and signed (schema 3; absent in schema 2).
	Build *buildinfo.Info `json:"build,omitempty"`
	Node  Node            `json:"node"`
	// NUMACPUs are the host NUMA nodes' CPUs (schema 2), in node order: what a
	// hypervisor pins a guest cell's vCPUs to. Empty when the node's sysfs does not say.
	NUMACPUs         []NUMACPUs       `json:"numa_cpus"`
	BootID           string           `json:"boot_id"` // /proc/sys/kernel/random/boot_id
	Generation       uint64           `json:"generation"`
	GenerationSource GenerationSource `json:"generation_source"`
	Time             time.Time        `json:"time"`           // UTC, RFC 3339 with nanoseconds
	KernelRelease    string           `json:"kernel_release"` // /proc/sys/kernel/osrelease
	KernelCmdline    string           `json:"kernel_cmdline"` // /proc/cmdline
	// ImagePlan is the ACS plan the boot image's command line carried (schema 3), and
	// whether this node matched it; absent when the line carries none.
	ImagePlan *ImagePlan `json:"image_plan,omitempty"`
	Profile   Profile    `json:"profile"`
	Units     []Unit     `json:"units"`
	// NVLink is the profile's NVLink partition layout (schema 5); absent when the profile
	// declares none.
	NVLink    *NVLink       `json:"nvlink,omitempty"`
	GuestPlan *GuestPlan    `json:"guest_plan,omitempty"`
	Stages    []StageResult `json:"stages"`
	Errors    []string      `json:"errors"`
}

// ImagePlan is the plan a signed boot image carries on its command line (`make uki
// PLAN=F`): passage.plan=, the digest of the saved plan file, and the pci=config_acs=
// the kernel programmed before passage ran; and how this node's own plan compared.
type ImagePlan struct {
	Digest      string   `json:"digest"`     // "sha256:<hex>" of the plan file; "" when the line names none
	ConfigACS   string   `json:"config_acs"` // the pci=config_acs= argument, as the line spells it
	Matched     bool     `json:"matched"`    // this node plans exactly what the argument sets
	Differences []string `json:"differences"`
	// Kernel is what the kernel's log says it did with the argument ("configured 12
	// ports", "refused", "no port configured"); "" when there was no log to read.
	Kernel string `json:"kernel"`
}

// Node identifies the machine. DMI fields are empty when the firmware does not expose them
// (or, for product_serial, when the file is root-only and unreadable).
type Node struct {
	Hostname  string `json:"hostname"`
	DMISerial string `json:"dmi_serial"` // /sys/class/dmi/id/product_serial
	DMIUUID   string `json:"dmi_uuid"`   // /sys/class/dmi/id/product_uuid
	BoardName string `json:"board_name"` // /sys/class/dmi/id/board_name
	Vendor    string `json:"vendor"`     // /sys/class/dmi/id/sys_vendor
	Product   string `json:"product"`    // /sys/class/dmi/id/product_name
	// KubeletKey is "sha256:<hex>" of the SubjectPublicKeyInfo (DER) of the kubelet client
	// key this boot made (schema 6; absent when it made none): the attestation that
	// vouches for the manifest vouches for the key, and passage-control approves the
	// kubelet's certificate request only for it (initramfs/kubelet).
	KubeletKey string `json:"kubelet_key,omitempty"`
}

// NUMACPUs is one NUMA node's CPU list, as /sys/devices/system/node/node<N>/cpulist
// writes it ("0-63,128-191").
type NUMACPUs struct {
	Node int    `json:"node"`
	CPUs string `json:"cpus"`
}

// Profile names the role rules the node was labelled with and the sha256 of their bytes,
// so the hypervisor can tell two nodes labelled by different rules apart.
type Profile struct {
	Name   string `json:"name"`
	Digest string `json:"digest"` // "sha256:<hex>"
}

// Unit is one GPU with the devices that travel with it into a guest.
type Unit struct {
	ID       string   `json:"id"`
	Status   string   `json:"status"` // StatusReady, StatusDegraded or StatusFailed
	Reasons  []string `json:"reasons"`
	NUMANode int      `json:"numa_node"` // -1 when the platform does not say
	// ModuleID is the GPU's Module ID (1..N, Fabric Manager's physicalId), as the profile
	// declares it by the GPU's position (schema 5). 0 is unknown: a unit whose Module ID
	// the profile does not give is signed as such, never guessed. ModuleSource names the
	// declaration ("profile b300: modules[0000:17:00.0]"); "" when unknown.
	ModuleID     int         `json:"module_id"`
	ModuleSource string      `json:"module_source"`
	Functions    []Function  `json:"functions"`
	ACSChanges   []ACSChange `json:"acs_changes"`
	ATSFindings  []Finding   `json:"ats_findings"`
	// Erase is the erase stage's record (schema 2); absent when nothing was erased.
	Erase *UnitErase `json:"erase,omitempty"`
	// UpLink is the link of the root port above the unit's GPU, the unit's link to the
	// CPU (schema 2): a guest's emulated root port cannot show it, so the hypervisor's
	// NCCL topology file carries it. Zero when the GPU has no root port above it.
	UpLink Link `json:"uplink"`

	// schema is the version of the manifest being encoded (set by Marshal): a unit of a
	// schema 2 to 4 payload is encoded as those schemas have it, without Module ID.
	schema int
}

// unitSchema4 is a unit as schemas 2 to 4 encode it: Unit without module_id and
// module_source. It is frozen with those schemas.
type unitSchema4 struct {
	ID          string      `json:"id"`
	Status      string      `json:"status"`
	Reasons     []string    `json:"reasons"`
	NUMANode    int         `json:"numa_node"`
	Functions   []Function  `json:"functions"`
	ACSChanges  []ACSChange `json:"acs_changes"`
	ATSFindings []Finding   `json:"ats_findings"`
	Erase       *UnitErase  `json:"erase,omitempty"`
	UpLink      Link        `json:"uplink"`
}

// MarshalJSON encodes the unit as its manifest's schema has it: module_id and
// module_source always from schema 5 on (0 and "" when unknown), never before, so that
// an earlier schema's payload still marshals back to its own bytes.
func (u Unit) MarshalJSON() ([]byte, error) {
	if u.schema > 0 && u.schema < 5 {
		return encodeJSON(unitSchema4{ID: u.ID, Status: u.Status, Reasons: u.Reasons, NUMANode: u.NUMANode, Functions: u.Functions,
			ACSChanges: u.ACSChanges, ATSFindings: u.ATSFindings, Erase: u.Erase, UpLink: u.UpLink})
	}
	type unit Unit // the fields without this method
	return encodeJSON(unit(u))
}

// NVLink is the NVLink partition layout of the node's platform: each set of Module IDs
// Fabric Manager can activate as one partition, as the profile lists them. It names
// module sets, not FM's partition IDs, which are read from FM. Source says where the
// layout came from ("profile b300: nvlink_partitions").
type NVLink struct {
	Partitions [][]int `json:"partitions"`
	Source     string  `json:"source"`
}

// Function is one PCIe function of a unit. IDs are lower-case hex with a 0x prefix, as in
// the sysfs files they come from ("0x10de"); Class is the 24-bit class code ("0x030200").
type Function struct {
	BDF             string `json:"bdf"` // "0000:f2:00.0"
	Vendor          string `json:"vendor"`
	Device          string `json:"device"`
	SubsystemVendor string `json:"subsystem_vendor"`
	SubsystemDevice string `json:"subsystem_device"`
	Class           string `json:"class"`
	Role            string `json:"role"`
	IOMMUGroup      int    `json:"iommu_group"` // -1 when the function has no group
	NUMANode        int    `json:"numa_node"`
	DriverBefore    string `json:"driver_before"`
	DriverAfter     string `json:"driver_after"`
	Link            Link   `json:"link"`
	// BARs are the function's Base Address Registers with their sizes (schema 4; absent
	// before, and for a function without BARs): what a guest's firmware must find room
	// for when the function is passed through.
	BARs []BAR `json:"bars,omitempty"`
}

// BAR is one Base Address Register, in lspci's terms ("Region 1: Memory at ...
// (64-bit, prefetchable) [size=512G]"). Size is in bytes, from the host kernel's sizing
// (sysfs resource); 0 when the scan could not say (an lspci dump).
type BAR struct {
	Index        int    `json:"index"`
	Size         uint64 `json:"size"`
	IO           bool   `json:"io"`
	Is64         bool   `json:"is64"`
	Prefetchable bool   `json:"prefetchable"`
}

// Link is the function's PCIe link as LnkCap/LnkSta report it; speeds in lspci's words
// ("64GT/s"), widths as lane counts.
type Link struct {
	Speed    string `json:"speed"`
	Width    int    `json:"width"`
	MaxSpeed string `json:"max_speed"`
	MaxWidth int    `json:"max_width"`
}

// ACSChange is one bridge's ACS Control register: what it held, what the plan wanted,
// what was read back after the write. Values use lspci's ACSCtl notation
// ("SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans+").
type ACSChange struct {
	Port   string `json:"port"` // bridge BDF
	Before string `json:"before"`
	Target string `json:"target"`
	After  string `json:"after"`
	Result string `json:"result"` // "applied", "unchanged", "mismatch", "failed: ..."
}

// Finding is one observation of a check (ATS on a ConnectX-8 function, a stage's note).
type Finding struct {
	Object   string `json:"object"` // what it concerns: a BDF, a unit, a file
	Severity string `json:"severity"`
	Message  string `json:"message"`
}

// GuestPlan is the guest topology the hypervisor should build, with the GPU/NIC distance
// matrices (PIX, PXB, PHB, NODE, SYS, NV18) it should observe on the host and in the
// guest. Plan carries the topology package's own plan document unchanged, so the
// manifest schema does not have to follow every change of the plan's shape.
type GuestPlan struct {
	Plan          json.RawMessage `json:"plan,omitempty"`
	MatrixLabels  []string        `json:"matrix_labels"`
	HostMatrix    [][]string      `json:"host_matrix"`
	ExpectedGuest [][]string      `json:"expected_guest_matrix"`
}

// StageResult is one boot stage's outcome. Duration is in nanoseconds, as Go encodes a
// time.Duration.
type StageResult struct {
	Name     string        `json:"name"`
	Status   string        `json:"status"`
	Duration time.Duration `json:"duration_ns"`
	Findings []Finding     `json:"findings"`
	Changes  []string      `json:"changes"`
}
