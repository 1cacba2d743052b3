// Package control is passage's control plane at passage.url: it issues nonces, enrols
// each node's TPM with no human step (the EK certificate against the operator's EK CA
// and intake list, a credential challenge the boot activates), verifies each boot's
// attestation with package attest, and makes the scheduler follow the verdict through a
// DeviceTaintRule on the node's pool. Its state is in the Kubernetes API and nowhere
// else, and it writes there only on evidence a stranger cannot make: a nonce is a MAC
// under a key the replicas share (checked without being stored, spent by the
// compare-and-swap of the write that records the attestation), an enrolment's state
// travels sealed in its challenge, and a record is created or changed only by a
// correct activation answer or an attestation whose quote verifies (README.md; the
// top-level README, "Control plane"; docs/DESIGN.md, "Who can send what").
package control

import (
	"encoding/json"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/passage-boot/passage/kube/dra/resources"
)

// Group is the API group of the control plane's resources: the driver's name, so a
// device taint's key, the records and the slices read as one project's.
const Group = resources.DriverName

// Version is the resources' API version.
const Version = "v1alpha1"

// The resources: PassageNode (a node's record, named by the manifest's hostname) and
// PassageEK (a TPM's claim on its one record, named by its EK's digest: created if
// absent, so one TPM never enrols as two records whatever arrives at once).
var (
	NodeResource = schema.GroupVersionResource{Group: Group, Version: Version, Resource: "passagenodes"}
	EKResource   = schema.GroupVersionResource{Group: Group, Version: Version, Resource: "passageeks"}
)

// Verdicts a record shows (status.verdict, the printer column).
const (
	// VerdictUnverified: enrolled, no attestation of the node's current boot accepted
	// (the reconciler's word for a pool published at a newer generation than verified).
	VerdictUnverified = "unverified"
	// VerdictVerified: this generation's attestation was accepted.
	VerdictVerified = "verified"
	// VerdictFailed: an attestation the node's enrolled TPM made, over a log that
	// replays, shows an unapproved boot or a rollback.
	VerdictFailed = "attestation-failed"
)

// EKLabel holds the first 63 hex digits of sha256 of the record's EK public area (a label
// value is at most 63 characters), for an operator's selector; the exchange finds a
// TPM's record by name, never by a list.
const EKLabel = Group + "/ek-sha256"

// MaxRecordName bounds a record's name (the manifest's hostname): the longest object
// name (253) less the DeviceTaintRule's prefix, so every name derived from it fits.
const MaxRecordName = 253 - len(rulePrefix)

// Node is a PassageNode: spec is the node's identity (set at enrolment, never by the
// node), status what the control plane last saw and decided.
type Node struct {
	Name            string            `json:"-"`
	ResourceVersion string            `json:"-"`
	Labels          map[string]string `json:"-"`
	Spec            NodeSpec          `json:"spec"`
	Status          NodeStatus        `json:"status"`
}

// NodeSpec is the enrolment: attest.NodeRecord's keys, and the node's name (the
// manifest's hostname, the pool passage-dra publishes under).
type NodeSpec struct {
	// Node is the manifest's hostname: the node's ResourceSlice pool, which passage-dra
	// names so whatever the Kubernetes node is called (resources.Objects.Pool).
	Node string `json:"node"`
	// EKCert is the EK certificate (DER).
	EKCert []byte `json:"ekCert,omitempty"`
	// EKPublic, AKPublic, SigningKeyPublic are TPMT_PUBLIC areas (attest.NodeRecord).
	EKPublic         []byte `json:"ekPublic,omitempty"`
	AKPublic         []byte `json:"akPublic,omitempty"`
	SigningKeyPublic []byte `json:"signingKeyPublic,omitempty"`
	// Enrolled is when the activation answer was accepted.
	Enrolled *time.Time `json:"enrolled,omitempty"`
}

// NodeStatus is what the control plane last decided, from an attestation only.
type NodeStatus struct {
	Verdict string `json:"verdict,omitempty"`
	Reason  string `json:"reason,omitempty"`
	// Time is when the verdict was reached.
	Time *time.Time `json:"time,omitempty"`
	// Generation is the newest generation an attestation was judged for, verified or
	// failed; ResetCount and BootID are that attestation's. Nothing older is taken
	// (attest.Seen), and a failed generation is left only by a newer verified one.
	Generation int64  `json:"generation,omitempty"`
	ResetCount int64  `json:"resetCount,omitempty"`
	BootID     string `json:"bootID,omitempty"`
	// Digest is the sha256 of the judged manifest's payload ("sha256:<hex>").
	Digest string `json:"digest,omitempty"`
	// KubeletKey is the judged manifest's node.kubelet_key: the digest of the kubelet
	// client key its boot made ("" when it made none). The Approver approves a kubelet's
	// certificate request only for this key of a verified record.
	KubeletKey string `json:"kubeletKey,omitempty"`
	// Nonce is when the nonce of the attestation judged was issued: a nonce issued no
	// later is spent for this record. The status write carries the resourceVersion
	// read, so of two attestations racing with one nonce only one is recorded.
	Nonce *time.Time `json:"nonce,omitempty"`
}

// EKClaim is a PassageEK: the record its TPM enrolled as.
type EKClaim struct {
	Record string `json:"record"`
	// EKPublic is the claiming TPM's EK public area (the name is its digest).
	EKPublic []byte `json:"ekPublic"`
}

func toObject(gvr schema.GroupVersionResource, kind, name, rv string, labels map[string]string, content any) (*unstructured.Unstructured, error) {
	b, err := json.Marshal(content)
	if err != nil {
		return nil, err
	}
	m := map[string]any{}
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	u := &unstructured.Unstructured{Object: m}
	u.SetAPIVersion(gvr.GroupVersion().String())
	u.SetKind(kind)
	u.SetName(name)
	u.SetResourceVersion(rv)
	if len(labels) > 0 {
		u.SetLabels(labels)
	}
	return u, nil
}

func fromObject(u *unstructured.Unstructured, into any) error {
	b, err := json.Marshal(u.Object)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, into); err != nil {
		return fmt.Errorf("%s %s: %w", u.GetKind(), u.GetName(), err)
	}
	return nil
}
