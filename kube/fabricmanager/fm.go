package fabricmanager

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Where FM listens for its API by default: TCP 127.0.0.1, FM_CMD_PORT_NUMBER
// (nv_fm_types.h), unless its config sets FM_CMD_UNIX_SOCKET_PATH; the Kubernetes DRA
// driver for NVIDIA GPUs configures that socket as DefaultSocket.
const (
	DefaultAddress = "127.0.0.1:6666"
	DefaultSocket  = "/run/nvidia-fabricmanager/socket"
	// DefaultLibrary is found by the dynamic loader's search path, as go-nvfm's default.
	DefaultLibrary = "libnvfm.so"
	// DefaultTimeout is go-nvfm's and fmpm's connect timeout.
	DefaultTimeout = time.Second
	// DefaultReconnect is how long a call tries to connect again to an FM that does not
	// answer before it fails as FM unreachable. The plugin reads FM again every
	// plugin.FabricEvery, so a call that gives up is tried again well within the 60 s
	// an FM started with --restart waits for its active list (NVLINK.md §0.6).
	DefaultReconnect = 2 * time.Second
)

// Options say which libnvfm to load and where FM is.
type Options struct {
	Library string        // libnvfm.so to load ("": DefaultLibrary)
	Socket  string        // FM's FM_CMD_UNIX_SOCKET_PATH; wins over Address
	Address string        // FM's <ipv4>:<port> ("" and no Socket: DefaultAddress)
	Timeout time.Duration // connect timeout (0: DefaultTimeout)
	// Reconnect bounds the connects one call makes to an FM that does not answer
	// (0: DefaultReconnect); at least one is made.
	Reconnect time.Duration
}

func (o Options) withDefaults() Options {
	if o.Library == "" {
		o.Library = DefaultLibrary
	}
	if o.Socket == "" && o.Address == "" {
		o.Address = DefaultAddress
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.Reconnect <= 0 {
		o.Reconnect = DefaultReconnect
	}
	return o
}

// where names FM's endpoint in errors.
func (o Options) where() string {
	if o.Socket != "" {
		return "unix:" + o.Socket
	}
	return o.Address
}

// Return is an fmReturn_t (nv_fm_types.h).
type Return int32

// The fmReturn_t values, with nv_fm_types.h's names.
const (
	FM_ST_SUCCESS                            Return = 0
	FM_ST_BADPARAM                           Return = -1
	FM_ST_GENERIC_ERROR                      Return = -2
	FM_ST_NOT_SUPPORTED                      Return = -3
	FM_ST_UNINITIALIZED                      Return = -4
	FM_ST_TIMEOUT                            Return = -5
	FM_ST_VERSION_MISMATCH                   Return = -6
	FM_ST_IN_USE                             Return = -7
	FM_ST_NOT_CONFIGURED                     Return = -8
	FM_ST_CONNECTION_NOT_VALID               Return = -9
	FM_ST_NVLINK_ERROR                       Return = -10
	FM_ST_RESOURCE_BAD                       Return = -11
	FM_ST_RESOURCE_IN_USE                    Return = -12
	FM_ST_RESOURCE_NOT_IN_USE                Return = -13
	FM_ST_RESOURCE_EXHAUSTED                 Return = -14
	FM_ST_RESOURCE_NOT_READY                 Return = -15
	FM_ST_PARTITION_EXISTS                   Return = -16
	FM_ST_PARTITION_ID_IN_USE                Return = -17
	FM_ST_PARTITION_ID_NOT_IN_USE            Return = -18
	FM_ST_PARTITION_NAME_IN_USE              Return = -19
	FM_ST_PARTITION_NAME_NOT_IN_USE          Return = -20
	FM_ST_PARTITION_ID_NAME_MISMATCH         Return = -21
	FM_ST_NOT_READY                          Return = -22
	FM_ST_RESOURCE_USED_IN_THIS_PARTITION    Return = -23
	FM_ST_RESOURCE_USED_IN_ANOTHER_PARTITION Return = -24
	FM_ST_PARTITION_MISWIRED_TRUNKS          Return = -25
	FM_ST_PARTITION_INSUFFICIENT_TRUNKS      Return = -26
	FM_ST_PARTITION_MISSING_SWITCHES         Return = -27
	FM_ST_PARTITION_NETWORK_CONFIG_ERROR     Return = -28
	FM_ST_PARTITION_ROUTE_PROGRAMMING_ERROR  Return = -29
)

var returnNames = []string{
	"FM_ST_SUCCESS", "FM_ST_BADPARAM", "FM_ST_GENERIC_ERROR", "FM_ST_NOT_SUPPORTED", "FM_ST_UNINITIALIZED",
	"FM_ST_TIMEOUT", "FM_ST_VERSION_MISMATCH", "FM_ST_IN_USE", "FM_ST_NOT_CONFIGURED", "FM_ST_CONNECTION_NOT_VALID",
	"FM_ST_NVLINK_ERROR", "FM_ST_RESOURCE_BAD", "FM_ST_RESOURCE_IN_USE", "FM_ST_RESOURCE_NOT_IN_USE",
	"FM_ST_RESOURCE_EXHAUSTED", "FM_ST_RESOURCE_NOT_READY", "FM_ST_PARTITION_EXISTS", "FM_ST_PARTITION_ID_IN_USE",
	"FM_ST_PARTITION_ID_NOT_IN_USE", "FM_ST_PARTITION_NAME_IN_USE", "FM_ST_PARTITION_NAME_NOT_IN_USE",
	"FM_ST_PARTITION_ID_NAME_MISMATCH", "FM_ST_NOT_READY", "FM_ST_RESOURCE_USED_IN_THIS_PARTITION",
	"FM_ST_RESOURCE_USED_IN_ANOTHER_PARTITION", "FM_ST_PARTITION_MISWIRED_TRUNKS", "FM_ST_PARTITION_INSUFFICIENT_TRUNKS",
	"FM_ST_PARTITION_MISSING_SWITCHES", "FM_ST_PARTITION_NETWORK_CONFIG_ERROR", "FM_ST_PARTITION_ROUTE_PROGRAMMING_ERROR",
}

// String is the header's name with the number, as fmpm's "fmReturn: N" gives it:
// "FM_ST_IN_USE (-7)".
func (r Return) String() string {
	if r <= 0 && int(-r) < len(returnNames) {
		return fmt.Sprintf("%s (%d)", returnNames[-r], int32(r))
	}
	return fmt.Sprintf("fmReturn_t %d", int32(r))
}

// Error is FM's answer other than FM_ST_SUCCESS to one operation, given on a working
// connection: FM said no.
type Error struct {
	Op   string // "activate partition 4", "list partitions", "connect unix:/run/..."
	Code Return
}

func (e *Error) Error() string { return "fm: " + e.Op + ": " + e.Code.String() }

// UnreachableError is an operation FM did not answer: no connection could be made
// within Options.Reconnect, or the one just made answered CONNECTION_NOT_VALID or
// TIMEOUT. It says nothing of FM's state: a partition it concerns may be active or not.
type UnreachableError struct {
	Op    string // "deactivate partition 4"
	Where string // FM's endpoint
	// Answered is what the connection before gave the operation (0: none was open).
	Answered Return
	// Connect is the last connect's code, Attempts the connects made in For (at
	// most Options.Reconnect and the last connect's timeout).
	Connect  Return
	Attempts int
	For      time.Duration
	// Within is Options.Reconnect, which the message names: the same outage reads
	// the same from one call to the next, whatever the attempts' timing.
	Within time.Duration
}

func (e *UnreachableError) Error() string {
	s := fmt.Sprintf("fm: %s: FM unreachable at %s", e.Op, e.Where)
	if e.Answered != FM_ST_SUCCESS {
		s += fmt.Sprintf(" (the connection answered %s, not taken as FM's answer)", e.Answered)
	}
	if e.Connect != FM_ST_SUCCESS {
		s += fmt.Sprintf(": connect %s, again for %v", e.Connect, e.Within)
	}
	return s
}

// Code is FM's return code in err; ok is false when err is not FM's answer (FM
// unreachable, the library not loaded, no cgo, a ledger write).
func Code(err error) (r Return, ok bool) {
	var e *Error
	if errors.As(err, &e) {
		return e.Code, true
	}
	return 0, false
}

// Unreachable says whether err is, or wraps, FM not answering.
func Unreachable(err error) bool {
	var u *UnreachableError
	return errors.As(err, &u)
}

// Partition is one fmFabricPartitionInfo_t.
type Partition struct {
	ID     uint32 // partitionId
	Active bool   // isActive
	GPUs   []GPU  // gpuInfo[numGpus]
}

// GPU is one fmFabricPartitionGpuInfo_t.
type GPU struct {
	PhysicalID uint32 // physicalId: the GPU's Module ID on H100 and later (not its BDF, nor PCI order)
	// UUID and PCIBusID are empty on H100 and later (FM User Guide, "Data Structures").
	UUID, PCIBusID      string
	NumNvLinksAvailable uint32
	MaxNumNvLinks       uint32
	NvlinkLineRateMBps  uint32
}

// Modules are the partition's members' Module IDs, sorted.
func (p Partition) Modules() []int {
	m := make([]int, len(p.GPUs))
	for i, g := range p.GPUs {
		m[i] = int(g.PhysicalID)
	}
	slices.Sort(m)
	return m
}

// Degraded names the members with fewer NVLinks available than they have: FM returns
// the supported partitions on H100 and B200/B300 "regardless of the GPU degradation
// states" (FM User Guide, "Error Handling"), so the count is the caller's to check.
func (p Partition) Degraded() []string {
	var out []string
	for _, g := range p.GPUs {
		if g.NumNvLinksAvailable < g.MaxNumNvLinks {
			out = append(out, fmt.Sprintf("module %d has %d of %d NVLinks", g.PhysicalID, g.NumNvLinksAvailable, g.MaxNumNvLinks))
		}
	}
	return out
}

func (p Partition) String() string {
	s := fmt.Sprintf("partition %d (modules %s", p.ID, moduleList(p.Modules()))
	if p.Active {
		s += ", active"
	}
	return s + ")"
}

// moduleList is "1,2,3" ("none" when empty).
func moduleList(m []int) string {
	if len(m) == 0 {
		return "none"
	}
	s := make([]string, len(m))
	for i, v := range m {
		s[i] = strconv.Itoa(v)
	}
	return strings.Join(s, ",")
}
