// Package fabricmanager drives NVIDIA Fabric Manager (FM) in shared NVSwitch mode
// (FABRIC_MODE=1) for the DRA plugin: FM must activate a partition holding exactly a
// VM's GPUs before the VM starts, and deactivate it before the GPUs are reset and
// recycled. It talks to FM through FM's own client library, libnvfm.so, loaded at run
// time by NVIDIA's go-nvfm bindings (cgo); there is no public wire protocol.
//
// Client is one connection to FM: the partition list, activate, deactivate, and the
// active list FM asks for after a --restart. Fabric is the plugin's side of it: which
// claim holds which partition, in a ledger written before FM is asked to do anything,
// so that a plugin restart, or an FM restart, finds what is active and why.
//
// # Start and stop order
//
// NVIDIA's FM User Guide gives the shared-mode VM sequence in a chapter whose body no
// stored copy has (NVLINK.md §3); the nearest official text is its vGPU chapter, taken
// here as the best available source:
//
//   - Activate before the VM starts: boot, driver, FM init, activate, VM life,
//     deactivate is the guide's order. The plugin activates at PrepareResourceClaims,
//     before KubeVirt's launcher can open the GPUs, and answers the kubelet only once
//     the ledger says the partition is the claim's. A single-GPU claim activates its
//     single-GPU partition too (NVLINK.md §1, inferred: Ubicloud does so for every size).
//   - Deactivate after the guest stops: "Do not deactivate partitions when VMs are
//     executing on the GPUs". The kubelet unprepares a claim only once the pod's
//     containers are gone, so the plugin deactivates in UnprepareResourceClaims.
//   - Deactivate before any reset: "GPU reset is done from the host after the VM shuts
//     down and the partition is deactivated". The plugin deactivates before it records
//     the units withheld, which is what hands them to the turnaround (erase, reset,
//     rebind); the turnaround also refuses to recycle a unit whose module the ledger
//     still gives to a claim. A partition that will not deactivate leaves its units
//     quarantined, never recycled.
//
// Integrators differ on the teardown (Ubicloud deactivates first, a dra-driver review
// proposed rebinding to nvidia first; NVLINK.md §3); the order above is the one the
// guide's sentences allow.
//
// # FM restarts
//
// An FM started with --restart rejects queries, activation and deactivation
// (FM_ST_NOT_CONFIGURED, "Fabric Manager instance is initializing") until the hypervisor
// tells it which partitions are active (fmSetActivatedFabricPartitions), and exits if
// that does not come within 60 s (FM User Guide, "Resiliency"). Fabric.Resume hands FM
// the ledger's list; the plugin calls it at start and every plugin.FabricEvery (5 s,
// whatever its --reload), and Activate and Deactivate call it when FM answers
// FM_ST_NOT_CONFIGURED.
//
// # FM not answering
//
// A call FM did not answer says nothing of a partition: Client gives it as an
// *UnreachableError, never as a code, and Deactivate counts a partition released only
// on FM's word (Fabric.Deactivate), so the units of a partition FM may still
// hold are quarantined, never reset.
package fabricmanager
