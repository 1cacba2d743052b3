// Package resources owns the Kubernetes Dynamic Resource Allocation objects of a verified
// passage manifest: one ResourceSlice pool per node whose devices are the functions of
// the node's ready units, the DeviceClass that selects them, and one ResourceClaimTemplate
// per unit shape (one request per function, all constrained to one unit), so a
// scheduler's allocator hands out whole units and never a GPU of one unit with a NIC of
// another. On a node whose manifest carries an NVLink layout, the units of each of
// Fabric Manager's partitions say so, and a template per partition size takes the whole
// units of exactly one partition (nvlink.go).
//
// Only a manifest that passed the one verification path (manifest.Keyring.VerifyFile:
// signature, semantic check, enrolled node) is rendered: Verify is the only way in.
package resources
