// Package control is passage's control plane at passage.url: it issues nonces, keeps the
// manifests boots POST, enrols each node's TPM with no human step (the EK certificate
// against the operator's EK CA and intake list, a credential challenge the boot
// activates), verifies each boot's attestation with package attest, and makes the
// scheduler follow the verdict through a DeviceTaintRule on the node's pool. Its state
// is in the Kubernetes API and nowhere else: a node's record is a PassageNode, a nonce is
// a PassageNonce used up by one resourceVersion compare-and-swap, so any replica serves
// any request and a replica killed between a node's GET and its POST loses nothing.
package control

import (
	"encoding/json"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/passage-boot/passage/dra/resources"
)

// Group is the API group of the control plane's resources: the driver's name, so a
// device taint's key, the records and the slices read as one project's.
const Group = resources.DriverName

// Version is the resources' API version.
const Version = "v1alpha1"

// The resources: PassageNode (a node's record) and PassageNonce (one issued nonce).
var (
	NodeResource  = schema.GroupVersionResource{Group: Group, Version: Version, Resource: "passagenodes"}
	NonceResource = schema.GroupVersionResource{Group: Group, Version: Version, Resource: "passagenonces"}
)

// Verdicts a record shows (status.verdict, the printer column).
const (
	// VerdictUnverified: a manifest was POSTed, no attestation of it accepted yet.
	VerdictUnverified = "unverified"
	// VerdictEnrolling: the TPM was challenged; the answer has not come.
	VerdictEnrolling = "enrolling"
	// VerdictVerified: this generation's attestation was accepted.
	VerdictVerified = "verified"
	// VerdictFailed: an attestation the node's enrolled TPM made was refused.
	VerdictFailed = "attestation-failed"
)

// EKLabel holds the first 63 hex digits of sha256 of the record's EK public area (a label
// value is at most 63 characters): the attestation POST finds a TPM's record by it, and
// compares the whole key after.
const EKLabel = Group + "/ek-sha256"

// ManifestLabel holds the first 63 hex digits of the sha256 of the payload of the
// manifest the record holds: an unenrolled TPM's attestation names its manifest only
// through passage's event log, whose last event is that digest.
const ManifestLabel = Group + "/manifest-sha256"

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
	// EKCert is the EK certificate (DER); empty until enrolled.
	EKCert []byte `json:"ekCert,omitempty"`
	// EKPublic, AKPublic, SigningKeyPublic are TPMT_PUBLIC areas (attest.NodeRecord).
	EKPublic         []byte `json:"ekPublic,omitempty"`
	AKPublic         []byte `json:"akPublic,omitempty"`
	SigningKeyPublic []byte `json:"signingKeyPublic,omitempty"`
	// Enrolled is when the activation answer was accepted.
	Enrolled *time.Time `json:"enrolled,omitempty"`
}

// NodeStatus is what the control plane last saw and decided.
type NodeStatus struct {
	Verdict string `json:"verdict,omitempty"`
	Reason  string `json:"reason,omitempty"`
	// Time is when the verdict was reached.
	Time *time.Time `json:"time,omitempty"`
	// Generation and ResetCount are the newest accepted (attest.Seen): the rollback
	// check holds the next attestation to them.
	Generation int64  `json:"generation,omitempty"`
	ResetCount int64  `json:"resetCount,omitempty"`
	BootID     string `json:"bootID,omitempty"`
	// Manifest is the envelope last POSTed for the node: the attestation POST, on any
	// replica, verifies against it.
	Manifest *HeldManifest `json:"manifest,omitempty"`
	// Pending is the control plane's half of an enrolment between the 428 challenge
	// and the answer (attest.Pending JSON: no secret, the credential's digest).
	Pending *PendingEnrolment `json:"pending,omitempty"`
}

// HeldManifest is a POSTed manifest envelope, kept until its attestation comes.
type HeldManifest struct {
	Envelope   []byte `json:"envelope"`
	Digest     string `json:"digest"` // sha256:<hex> of the payload
	Generation int64  `json:"generation"`
	BootID     string `json:"bootID"`
	// Issued is when the nonce the boot took was issued, if known: for the
	// nonce-to-verdict time.
	Posted time.Time `json:"posted"`
}

// PendingEnrolment is an issued challenge.
type PendingEnrolment struct {
	AKName  string          `json:"akName"` // hex
	Pending json.RawMessage `json:"pending"`
	Issued  time.Time       `json:"issued"`
}

// Nonce is a PassageNonce: its name is the nonce in hex.
type Nonce struct {
	Issued time.Time  `json:"issued"`
	Used   *time.Time `json:"used,omitempty"`
	// Record is the record the attestation that used it was for.
	Record string `json:"record,omitempty"`
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
